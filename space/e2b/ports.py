"""Traffic for a port other than envd's: proxied to that port inside the sandbox.

E2B serves a sandbox's ports publicly unless the sandbox was created with
``network.allowPublicTraffic: false``; then requests need its traffic token
(``E2B-Traffic-Access-Token``). SPACE keeps that choice per sandbox (``public_ports``) and also takes
the envd access token (``X-Access-Token``), which the code-interpreter SDK sends. The facade's own
headers and tokens are not passed on to the server in the sandbox.
"""

from __future__ import annotations

from typing import Final

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from space.api.ports import proxy_to_port
from space.api.state import AppState
from space.e2b.edge import EdgeError, check_envd_token, http_error, route, target
from space.errors import SpaceError
from space.node.port_proxy import METHODS

#: Headers that are the facade's business, not the sandbox server's.
FACADE_HEADERS: Final = ("e2b-sandbox-id", "e2b-sandbox-port", "x-access-token", "e2b-traffic-access-token")


def _token_ok(st: AppState, request: Request, sandbox_id: str) -> bool:
    for name in ("e2b-traffic-access-token", "x-access-token"):
        token = request.headers.get(name)
        if token is not None and check_envd_token(st.secret, sandbox_id, token):
            return True
    return False


def create_ports_app(state: AppState) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.space = state

    @app.exception_handler(EdgeError)
    async def _edge(_: Request, exc: EdgeError) -> Response:
        return exc.response()

    @app.exception_handler(SpaceError)
    async def _space(_: Request, exc: SpaceError) -> Response:
        if exc.code == "port_not_open":
            return EdgeError(str(exc.details.get("sandbox_id") or ""),
                             f"The sandbox is running but port is not open: {exc.message}").response()
        return http_error(exc.status, exc.message)

    async def proxy(request: Request) -> Response:
        r = route(request)
        t = await target(state, request, authorized=True)
        if not t.sandbox.public_ports and not _token_ok(state, request, t.sandbox.id):
            return http_error(401, "this sandbox's ports need its access token (E2B-Traffic-Access-Token "
                                   "or X-Access-Token)")
        try:
            return await proxy_to_port(state, t.sandbox, t.node, r.port, request.scope["path"], request,
                                       drop=FACADE_HEADERS)
        except SpaceError as exc:
            if exc.code == "port_not_open":
                raise EdgeError(t.sandbox.id, f"The sandbox is running but port is not open ({r.port})") from None
            raise

    app.add_api_route("/{path:path}", proxy, methods=list(METHODS), include_in_schema=False)
    return app
