"""Prometheus metrics of the API process (a plain ASGI middleware: streams pass through untouched)."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.api.views import backup
from space.lifecycle import State

REGISTRY = CollectorRegistry()
REQUESTS = Counter("space_http_requests_total", "HTTP requests", ["method", "route", "status"],
                   registry=REGISTRY)
LATENCY = Histogram("space_http_request_seconds", "HTTP request latency (to response start)",
                    ["method", "route"], registry=REGISTRY,
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
OPERATIONS = Counter("space_operations_total", "Finished operations", ["kind", "status"], registry=REGISTRY)
WORST_RPO = Gauge("space_backup_worst_rpo_seconds",
                  "Age of the oldest durable state among a node's backed-up sandboxes (disk backup or "
                  "uploaded full checkpoint, whichever is newer), read from the database at scrape time",
                  ["node"], registry=REGISTRY)


class MetricsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                route: Any = scope.get("route")
                name = getattr(route, "path", "unmatched")
                LATENCY.labels(scope["method"], name).observe(time.perf_counter() - t0)
                REQUESTS.labels(scope["method"], name, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_wrapper)


def install(app: FastAPI) -> None:
    app.add_middleware(MetricsMiddleware)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        state = getattr(request.app.state, "space", None)
        if state is not None:
            await _worst_rpo(state.store)
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def _worst_rpo(store: Any) -> None:
    """Every API replica answers the same (the rows are the truth), so any replica may be scraped."""
    now = dt.datetime.now(dt.UTC)
    worst: dict[str, float] = {}
    for sb in await store.list_sandboxes(states=[State.RUNNING.value, State.PAUSED.value]):
        b = backup(sb, now)
        if b is not None and sb.node_id is not None:
            worst[sb.node_id] = max(worst.get(sb.node_id, 0.0), float(b["rpo_s"]))
    WORST_RPO.clear()
    for node, rpo in worst.items():
        WORST_RPO.labels(node).set(rpo)
