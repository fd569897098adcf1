"""/v1/sandboxes/{id}/ports/{port}/{path}: a request to a server listening in the sandbox (on
``0.0.0.0:PORT``), passed through its node (:mod:`space.node.network.port_proxy`) with both bodies
streamed; a WebSocket handshake on the same routes is relayed message by message
(:mod:`space.node.network.port_websocket`), through the node to the server.

:func:`proxy_to_port` and :func:`proxy_websocket` are also what the E2B facade calls for its
``E2b-Sandbox-Port`` traffic.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response, WebSocket

from space.api.auth import Principal, principal
from space.api.dataplane import SandboxNode, running_sandbox
from space.api.state import AppState, app_state
from space.errors import InvalidPath
from space.node.network.port_proxy import (
    METHODS,
    OWN_RESPONSE_HEADERS,
    UPSTREAM_HOST,
    UPSTREAM_STATUS,
    RelayResponse,
    end_to_end,
    has_body,
    subpath,
)
from space.node.network.port_websocket import Refused, answer_headers, forwarded_headers, relay
from space.store import Sandbox

router = APIRouter()

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]
Port = Annotated[int, Path(ge=1, le=65535)]
#: Methods a read-only API key may send through.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _node_target(sandbox_id: str, port: int, path: str, query: str) -> str:
    segments = path.lstrip("/").split("/")
    # The node's URL must stay under this sandbox's ports: the HTTP client would resolve literal
    # dot segments (``../../other/files``) into another route of the node API.
    if any(s in (".", "..") for s in segments):
        raise InvalidPath("a port path may not contain '.' or '..' segments", path=path)
    opaque = "/".join(segments).replace("#", "%23").replace("?", "%3F")
    return f"/v1/sandboxes/{sandbox_id}/ports/{port}/{opaque}" + ("?" + query.replace("#", "%23") if query else "")


async def proxy_to_port(st: AppState, sb: Sandbox, node: SandboxNode, port: int, path: str,
                        request: Request, drop: tuple[str, ...] = ()) -> Response:
    """Send ``request`` (method, headers, streamed body; its query string) to ``path`` on ``port``
    of the running sandbox ``sb`` and stream the server's answer back: its status, its headers
    without hop-by-hop ones, its body chunk by chunk. ``path`` is raw (percent-encoded as the
    client sent it), with or without its leading ``/``, without a query.

    The caller's ``Authorization`` (its API key) is not passed on; the server sees ``Host:
    localhost:<port>`` (or the sandbox's ``port_host``), nor any header named in ``drop``
    (lowercase). Nothing listening: 502 ``port_not_open``."""
    headers: dict[str, str] = {}
    for k, v in end_to_end(request.headers.raw, drop=("host", "authorization", "expect", UPSTREAM_HOST, *drop)):
        name, value = k.decode("latin-1"), v.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    if sb.port_host:
        headers[UPSTREAM_HOST] = sb.port_host
    query = request.scope.get("query_string", b"").decode("latin-1")
    route = f"/v1/sandboxes/{sb.id}/ports/{port}"
    target = _node_target(sb.id, port, path, query)
    resp = await node.open_stream(request.method, route, tail=target[len(route):],
                                  content=request.stream() if has_body(request.headers.raw) else None,
                                  headers=headers)
    status = int(resp.headers.get(UPSTREAM_STATUS, resp.status_code))
    return RelayResponse(resp.aiter_raw(), status, end_to_end(resp.headers.raw, drop=OWN_RESPONSE_HEADERS),
                         resp.aclose, sandbox=sb.id, port=port)


async def proxy_websocket(sb: Sandbox, node: SandboxNode, port: int, path: str, websocket: WebSocket,
                          drop: tuple[str, ...] = ()) -> None:
    """Relay the WebSocket ``websocket`` asks for (not yet accepted) to ``path`` on ``port`` of the
    running sandbox ``sb``: accepted with the server's subprotocol once the server took it, then
    message by message until either side closes. A server that refuses (an HTTP answer) has that
    answer passed back; the node's own refusal is its error, like any request's."""
    query = websocket.scope.get("query_string", b"").decode("latin-1")
    route = f"/v1/sandboxes/{sb.id}/ports/{port}"
    target = _node_target(sb.id, port, path, query)
    try:
        headers = forwarded_headers(websocket.headers.raw, drop=(UPSTREAM_HOST, *drop))
        if sb.port_host:
            headers.append((UPSTREAM_HOST, sb.port_host))
        far = await node.open_websocket(route, tail=target[len(route):], headers=headers,
                                        subprotocols=websocket.scope.get("subprotocols") or ())
    except Refused as refused:
        answer = refused.response
        denial = Response(bytes(answer.body), status_code=answer.status_code)
        length = [h for h in denial.raw_headers if h[0] == b"content-length"]
        denial.raw_headers = [*answer_headers(answer.headers, drop=(UPSTREAM_STATUS,)), *length]
        await websocket.send_denial_response(denial)
        return
    try:
        await websocket.accept(subprotocol=far.subprotocol, headers=answer_headers(far.response.headers))
    except BaseException:
        far.abort()
        raise
    await relay(websocket, far, sandbox=sb.id, port=port)


async def _proxy(sandbox_id: str, port: Port, request: Request, who: Auth, st: St) -> Response:
    if request.method not in SAFE_METHODS:
        who.require_write()
    sb, node = await running_sandbox(st, sandbox_id, who.tenant, read_only=who.read_only)
    return await proxy_to_port(st, sb, node, port, subpath(request.scope), request)


async def _proxy_websocket(sandbox_id: str, port: Port, websocket: WebSocket, who: Auth, st: St) -> None:
    who.require_write()  # a WebSocket carries data both ways
    sb, node = await running_sandbox(st, sandbox_id, who.tenant)
    await proxy_websocket(sb, node, port, subpath(websocket.scope), websocket)


for _route in ("/v1/sandboxes/{sandbox_id}/ports/{port}", "/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}"):
    # Out of the OpenAPI document: one route for every method would repeat its operation id.
    router.add_api_route(_route, _proxy, methods=METHODS, include_in_schema=False)
    router.add_api_websocket_route(_route, _proxy_websocket)
