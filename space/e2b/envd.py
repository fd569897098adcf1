"""The envd app: the RPC services, ``/files`` and ``/health`` of every sandbox, on SPACE's port.

Requests reach it through :class:`space.e2b.edge.E2BDispatch` (they carry ``E2b-Sandbox-Id``).
Errors take the form the SDK maps: Connect errors for RPCs, E2B's edge 502 for a sandbox that is
gone, ``{"code": <int>, "message"}`` for the plain HTTP endpoints.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from space.api.auditing import AuditMiddleware
from space.api.state import AppState
from space.e2b import files, filesystem, process
from space.e2b.connect import ConnectError
from space.e2b.edge import EdgeError, Unauthenticated, authenticate
from space.errors import SpaceError

log = structlog.get_logger("space.e2b.envd")

Handler = Callable[[AppState, Request], Awaitable[Response]]
SERVICES: dict[str, dict[str, Any]] = {
    "process.Process": process.RPCS,
    "filesystem.Filesystem": filesystem.RPCS,
}


def create_envd_app(state: AppState) -> FastAPI:
    app = FastAPI(title="SPACE envd facade", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.space = state

    @app.exception_handler(EdgeError)
    async def _edge(_: Request, exc: EdgeError) -> Response:
        return exc.response()

    @app.exception_handler(ConnectError)
    async def _connect(_: Request, exc: ConnectError) -> Response:
        return exc.response()

    @app.exception_handler(Unauthenticated)
    async def _unauth(_: Request, exc: Unauthenticated) -> Response:
        return ConnectError("unauthenticated", exc.message).response()

    @app.exception_handler(SpaceError)
    async def _space(_: Request, exc: SpaceError) -> Response:
        return ConnectError.of(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("e2b.envd.unhandled", error=repr(exc))
        return ConnectError("internal", "internal error; see the server log").response()

    # One route per RPC, so that each has its own path (the audit names calls by route).
    for service, methods in SERVICES.items():
        for method, handler in methods.items():
            app.add_api_route(f"/{service}/{method}", _endpoint(state, handler), methods=["POST"])

    @app.post("/{service}/{method}")
    async def unknown(service: str, method: str) -> Response:
        raise ConnectError("unimplemented", f"{service}/{method} is not implemented")

    app.include_router(files.router)
    app.add_middleware(AuditMiddleware, prefix="/", known_only=True)
    return app


def _endpoint(state: AppState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        # The sandbox's envd token first: nothing of the request is read, nor anything done for
        # it, before (the handler's own ``target`` finds it checked).
        await authenticate(state, request)
        return await handler(state, request)

    return endpoint

