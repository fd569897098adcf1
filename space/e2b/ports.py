"""Traffic for a port other than envd's: proxied to that port inside the sandbox.

E2B serves a sandbox's ports publicly unless the sandbox was created with
``network.allowPublicTraffic: false``; then requests need its traffic token
(``E2B-Traffic-Access-Token``). SPACE keeps that choice per sandbox (``public_ports``) and also takes
the envd access token (``X-Access-Token``), which the code-interpreter SDK sends. The token is
checked before anything is done for the request: a private sandbox is woken, and its idle timer
refreshed, only for a request that carries one of its tokens. A public port is open to anyone by
its owner's choice, so such a request may wake an auto-resuming sandbox, as on E2B. The facade's own
headers and tokens are not passed on to the server in the sandbox. A WebSocket handshake is taken
on the same terms and relayed to the server (:func:`space.api.ports.proxy_websocket`).
"""

from __future__ import annotations

from typing import Final

from fastapi import FastAPI, WebSocket
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from space.api.ports import proxy_to_port, proxy_websocket
from space.api.state import AppState
from space.e2b import tokens
from space.e2b.edge import EdgeError, Target, Unauthenticated, http_error, route, sandbox_row, target
from space.errors import SpaceError
from space.node.network.port_proxy import METHODS
from space.store import Sandbox

#: Headers that are the facade's business, not the sandbox server's.
FACADE_HEADERS: Final = ("e2b-sandbox-id", "e2b-sandbox-port", "x-access-token", "e2b-traffic-access-token")


def port_token_ok(st: AppState, request: HTTPConnection, sb: Sandbox) -> bool:
    """Its traffic token as ``E2B-Traffic-Access-Token``, or its envd token (which allows more) as
    ``X-Access-Token``."""
    traffic = request.headers.get("e2b-traffic-access-token")
    if traffic is not None and tokens.check_traffic(st.secret, sb, traffic):
        return True
    envd = request.headers.get("x-access-token")
    return envd is not None and tokens.check_envd(st.secret, sb, envd)


def create_ports_app(state: AppState) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.space = state

    @app.exception_handler(EdgeError)
    async def _edge(_: Request, exc: EdgeError) -> Response:
        return exc.response()

    @app.exception_handler(Unauthenticated)
    async def _unauthenticated(_: Request, exc: Unauthenticated) -> Response:
        # E2B answers a private port's request without its token 403 (its own SDK tests check it).
        return http_error(403, exc.message)

    @app.exception_handler(SpaceError)
    async def _space(_: Request, exc: SpaceError) -> Response:
        if exc.code == "port_not_open":
            return EdgeError(str(exc.details.get("sandbox_id") or ""),
                             f"The sandbox is running but port is not open: {exc.message}").response()
        return http_error(exc.status, exc.message)

    async def authorized(request: HTTPConnection) -> Target:
        r = route(request)
        sb = await sandbox_row(state, r.sandbox_id)
        if not sb.public_ports and not port_token_ok(state, request, sb):
            raise Unauthenticated("this sandbox's ports need its access token (E2B-Traffic-Access-Token "
                                   "or X-Access-Token)")
        # Its token checked, or its ports public (open to anyone, by its owner's choice).
        return await target(state, request, authenticated=sb)

    async def proxy(request: Request) -> Response:
        r = route(request)
        t = await authorized(request)
        try:
            return await proxy_to_port(state, t.sandbox, t.node, r.port, request.scope["path"], request,
                                       drop=FACADE_HEADERS)
        except SpaceError as exc:
            if exc.code == "port_not_open":
                raise EdgeError(t.sandbox.id, f"The sandbox is running but port is not open ({r.port})") from None
            raise

    async def proxy_ws(websocket: WebSocket) -> None:
        r = route(websocket)
        t = await authorized(websocket)
        try:
            await proxy_websocket(t.sandbox, t.node, r.port, websocket.scope["path"], websocket, drop=FACADE_HEADERS)
        except SpaceError as exc:
            if exc.code == "port_not_open":
                raise EdgeError(t.sandbox.id, f"The sandbox is running but port is not open ({r.port})") from None
            raise

    app.add_api_route("/{path:path}", proxy, methods=list(METHODS), include_in_schema=False)
    app.add_api_websocket_route("/{path:path}", proxy_ws)
    return app
