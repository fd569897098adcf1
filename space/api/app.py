"""The public API application."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from space.api import (
    apikeys,
    audit,
    commands,
    egress,
    files,
    lifecycle,
    metrics,
    nodes,
    openapi,
    pools,
    ports,
    sandboxes,
    secrets,
    snapshots,
    templates,
    tenant_keys,
    tenants,
)
from space.api.auditing import AuditMiddleware
from space.api.auth import AuthenticateFirst
from space.api.limits import RequestLimits, e2b_body_classes, space_body_class
from space.api.state import AppState
from space.e2b.control import create_control_app
from space.e2b.edge import E2BDispatch
from space.e2b.envd import create_envd_app
from space.e2b.ports import create_ports_app
from space.errors import SpaceError
from space.store import db
from space.web import install_error_handlers


def create_app(state: AppState) -> FastAPI:
    app = FastAPI(
        title="SPACE",
        version="1",
        description="Sandboxes for long-running AI agents. See docs/api.md.",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.space = state
    install_error_handlers(app)
    openapi.install(app)
    # Innermost first: authentication before any route reads a body; each body bounded in size and
    # time before anything reads it (counted and audited like any answer).
    app.add_middleware(AuthenticateFirst)
    app.add_middleware(RequestLimits, classify=space_body_class(state.max_upload_bytes))
    metrics.install(app)
    app.add_middleware(AuditMiddleware)
    for module in (sandboxes, lifecycle, snapshots, commands, files, templates, apikeys, nodes, pools,
                   secrets):
        app.include_router(module.router)
    for module in (tenants, tenant_keys, audit, egress, ports):
        app.include_router(module.router)

    # Outermost: E2B's planes (E2b-Sandbox-Id traffic, E2B's control paths) never reach SPACE's routes.
    e2b = e2b_body_classes(state.max_upload_bytes)
    app.add_middleware(E2BDispatch, control=RequestLimits(create_control_app(state), classify=e2b["control"]),
                       envd=RequestLimits(create_envd_app(state), classify=e2b["envd"]),
                       ports=RequestLimits(create_ports_app(state), classify=e2b["ports"]), domain=state.e2b_domain)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        """Liveness: this process serves requests. Nothing it depends on is asked, so a database
        outage does not get every replica restarted (that is readiness's business)."""
        return {"status": "ok"}

    head = db.head_revision()

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Readiness: the database answers and its schema is the one this code was written for
        (a replica of a newer or older release waits out a migration instead of taking traffic)."""
        try:
            revision = await state.store.schema_revision()
            if revision != head:  # before anything reads tables of another schema
                return JSONResponse({"status": "unready", "database": "ok", "migration": revision,
                                     "expected_migration": head}, status_code=503)
            nodes = len(await state.store.list_nodes("ready"))
        except SpaceError as exc:
            return JSONResponse({"status": "unready", "database": exc.message}, status_code=503)
        return JSONResponse({"status": "ready", "database": "ok", "migration": revision, "nodes": nodes})

    return app
