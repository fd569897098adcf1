"""WebSocket upgrades through the port proxy: a client connection over a stream we opened, the relay
between it and the caller's ASGI WebSocket, and the node's route. Both hops use the first two: the
control plane to the node (over the node's unix socket or mutual TLS) and the node into the sandbox
(over the connection :mod:`space.node.network.port_proxy` registers, so a snapshot's reset cuts it
like any proxied request). The node answers a server's refusal (an HTTP answer instead of ``101``)
with that answer and :data:`~space.node.network.port_proxy.UPSTREAM_STATUS` naming its status; any
other refusal is the node's own error.

The relay is message by message, not byte by byte: each hop is an ASGI server that has parsed the
frames already. Every message is bounded (:data:`MAX_MESSAGE`, uvicorn's own ``ws_max_size``, so a
message that passes one hop passes the next); a larger one closes the connection with 1009, never
buffered. Pings are answered by the hop that gets them (each hop's server pings its own client), so
the relay carries data and close frames only; a close code travels end to end.

The client side is websockets' sans-I/O protocol on our own streams: its asyncio client would
re-quote an already percent-encoded path (``%2F`` into ``%252F``) and reads proxies from the
environment, and the node's side must run on the socket it registered before the SYN.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Annotated

import structlog
from fastapi import APIRouter, Path
from starlette.responses import Response as HTTPResponse
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.client import ClientProtocol
from websockets.datastructures import Headers
from websockets.exceptions import InvalidHandshake, InvalidStatus
from websockets.frames import CloseCode, Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.typing import Subprotocol
from websockets.uri import WebSocketURI

from space.errors import BadGateway, PortNotOpen
from space.node.network.port_proxy import (
    OWN_RESPONSE_HEADERS,
    UPSTREAM_HOST,
    UPSTREAM_STATUS,
    end_to_end,
    open_upstream,
    upstream_host,
    upstream_target,
)

if TYPE_CHECKING:
    from space.node.sandboxes.manager import SandboxManager

log = structlog.get_logger(__name__)

#: The largest message any hop relays (uvicorn's default ``ws_max_size``, which bounds the ASGI side).
MAX_MESSAGE = 16 * 2**20
#: Bytes read from the far side at once.
READ_CHUNK = 1 << 16
#: Request headers of the WebSocket handshake itself: each hop makes its own.
HANDSHAKE_HEADERS = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-protocol",
                               "sec-websocket-extensions", "sec-websocket-accept"})
#: Seconds the closing handshake may take before the connection is simply closed.
CLOSE_TIMEOUT = 5.0
#: Close codes an endpoint may send (RFC 6455 7.4); others (1005, 1006, 1015) only describe a close.
_SENDABLE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})


class Refused(Exception):
    """The far side answered the handshake with an HTTP response instead of switching protocols."""

    def __init__(self, response: Response) -> None:
        super().__init__(f"the WebSocket handshake was answered {response.status_code}")
        self.response = response


class HandshakeFailed(Exception):
    """The far side's answer was no valid WebSocket handshake (nor any HTTP response)."""


@dataclasses.dataclass(frozen=True)
class Closed:
    """The far side closed: the code and reason it sent (1006 if it just went away)."""

    code: int
    reason: str = ""


def sendable(code: int | None) -> int:
    """``code`` if an endpoint may send it, else what stands for it: 1000 for "no code", 1011 for an
    abnormal end."""
    if code is None or code == CloseCode.NO_STATUS_RCVD:
        return 1000
    if code in _SENDABLE or 3000 <= code <= 4999:
        return code
    return 1011


class ClientSocket:
    """A WebSocket client connection over a stream pair the caller opened."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, protocol: ClientProtocol,
                 response: Response, on_close: Callable[[], None] | None) -> None:
        self._reader, self._writer, self._protocol = reader, writer, protocol
        #: The server's 101 answer (its headers are passed on).
        self.response = response
        self.subprotocol: str | None = protocol.subprotocol
        self._on_close = on_close
        self._parts: list[bytes] = []
        self._text = False
        self._ready: list[str | bytes | Closed] = []
        self._closed = False

    @classmethod
    async def open(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, host: str, target: str,
                   headers: Iterable[tuple[str, str]] = (), subprotocols: Iterable[str] = (),
                   timeout: float = 30.0, on_close: Callable[[], None] | None = None) -> ClientSocket:
        """Send the handshake for ``target`` (``/path?query``, already percent-encoded: sent as it
        is) with ``Host: host`` and ``headers``; the connection once the server switched protocols.
        :class:`Refused` with the server's HTTP answer if it did not, :class:`HandshakeFailed` if
        its answer made no sense or did not come within ``timeout``. ``on_close`` closes the stream
        (default: the writer's close)."""
        path, _, query = target.partition("?")
        offered = [Subprotocol(p) for p in subprotocols]
        protocol = ClientProtocol(WebSocketURI(secure=False, host="ws.invalid", port=80, path=path, query=query),
                                  subprotocols=offered or None, max_size=MAX_MESSAGE)
        request = protocol.connect()
        del request.headers["Host"]  # the headers are a multidict: setting one adds one
        request.headers["Host"] = host
        for name, value in headers:
            request.headers[name] = value
        protocol.send_request(request)
        try:
            async with asyncio.timeout(timeout):
                for data in protocol.data_to_send():
                    writer.write(data)
                await writer.drain()
                ended = False
                while True:
                    events = protocol.events_received()
                    for i, event in enumerate(events):
                        if isinstance(event, Response):
                            exc = protocol.handshake_exc
                            if isinstance(exc, InvalidStatus):
                                raise Refused(event)
                            if exc is not None:
                                raise HandshakeFailed(f"invalid WebSocket handshake answer: {exc}")
                            opened = cls(reader, writer, protocol, event, on_close)
                            # Frames that came in the same read as the 101 (a server that greets first).
                            opened._take(events[i + 1:])
                            await opened._flush()  # their pongs
                            return opened
                    if ended:
                        exc = protocol.handshake_exc
                        raise HandshakeFailed("the connection closed during the WebSocket handshake"
                                              + (f": {exc}" if exc is not None else ""))
                    data = await reader.read(READ_CHUNK)
                    if data:
                        protocol.receive_data(data)
                    else:
                        protocol.receive_eof()
                        ended = True
        except TimeoutError:
            raise HandshakeFailed(f"no WebSocket handshake answer within {timeout:g} s") from None
        except (OSError, InvalidHandshake) as exc:
            raise HandshakeFailed(f"the WebSocket handshake failed: {exc}") from None

    async def recv(self) -> str | bytes | Closed:
        """The next whole message, or :class:`Closed` once the far side closed or went away."""
        while not self._ready:
            if self._closed:
                return self._end()
            try:
                data = await self._reader.read(READ_CHUNK)
            except OSError:
                data = b""
            if data:
                self._protocol.receive_data(data)
            else:
                self._protocol.receive_eof()
            await self._flush()  # pongs, the answer to a close, the close of a failed connection
            self._take(self._protocol.events_received())
            if not data:
                self._closed = True
        return self._ready.pop(0)

    def _take(self, events: Iterable[object]) -> None:
        for event in events:
            if isinstance(event, Frame):
                self._on_frame(event)
        p = self._protocol
        if p.state is State.CLOSED or p.close_rcvd is not None or p.parser_exc is not None:
            self._closed = True

    def _end(self) -> Closed:
        # The far side's close frame; else the one the protocol sent when it failed the connection
        # (1009 for a message over the bound, 1002 for a protocol error); else it just went away.
        p = self._protocol
        close = p.close_rcvd or p.close_sent
        return Closed(close.code, close.reason) if close is not None else Closed(CloseCode.ABNORMAL_CLOSURE)

    def _on_frame(self, frame: Frame) -> None:
        if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
            self._text, self._parts = frame.opcode is Opcode.TEXT, [bytes(frame.data)]
        elif frame.opcode is Opcode.CONT:
            self._parts.append(bytes(frame.data))
        else:
            return  # control frames: the protocol answered pings and closes already
        if frame.fin:
            message = b"".join(self._parts)
            self._parts = []
            if not self._text:
                self._ready.append(message)
                return
            try:
                self._ready.append(message.decode())
            except UnicodeDecodeError:
                self._protocol.fail(CloseCode.INVALID_DATA, "a text message that is not UTF-8")
                self._closed = True

    async def send(self, message: str | bytes) -> None:
        if isinstance(message, str):
            self._protocol.send_text(message.encode())
        else:
            self._protocol.send_binary(message)
        await self._flush()

    async def _flush(self) -> None:
        # An empty chunk is the protocol's "half-close now": the connection is closed whole instead
        # (a shutdown would leave the sandbox's side of it in TIME_WAIT, see port_proxy).
        data = b"".join(self._protocol.data_to_send())
        if data and not self._writer.transport.is_closing():
            self._writer.write(data)
            with contextlib.suppress(OSError):
                await self._writer.drain()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """The closing handshake (bounded by :data:`CLOSE_TIMEOUT`), then the connection closed."""
        try:
            if self._protocol.state is State.OPEN:
                self._protocol.send_close(sendable(code), reason[:120])
                await self._flush()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CLOSE_TIMEOUT):
                        while not self._closed:
                            await self.recv()
                            self._ready.clear()
        finally:
            self.abort()

    def abort(self) -> None:
        """Close the connection now, without a closing handshake."""
        self._closed = True
        if self._on_close is not None:
            self._on_close()
        else:
            self._writer.close()


def forwarded_headers(raw: Iterable[tuple[bytes, bytes]], drop: Iterable[str] = ()) -> list[tuple[str, str]]:
    """A handshake request's end-to-end headers for the next hop: without hop-by-hop ones, the
    handshake's own, ``Host`` and ``Authorization`` (the caller's credential) nor ``drop``."""
    pairs = end_to_end(raw, drop=("host", "authorization", "expect", *HANDSHAKE_HEADERS, *drop))
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in pairs]


def answer_headers(headers: Headers, drop: Iterable[str] = ()) -> list[tuple[bytes, bytes]]:
    """A far side's 101 (or refusal) headers to pass back: end to end, none of the handshake's own."""
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.raw_items()]
    return end_to_end(raw, drop=(*HANDSHAKE_HEADERS, *OWN_RESPONSE_HEADERS, "content-length", *drop))


async def relay(caller: WebSocket, far: ClientSocket, **log_context: object) -> None:
    """Messages both ways between the accepted ``caller`` and ``far`` until one side closes; the
    other is then closed with the same code. ``far`` is closed however this ends."""

    async def caller_to_far() -> Closed:
        while True:
            try:
                message = await caller.receive()
            except (WebSocketDisconnect, RuntimeError, OSError):
                return Closed(CloseCode.GOING_AWAY)
            if message["type"] == "websocket.disconnect":
                return Closed(int(message.get("code") or 1000), str(message.get("reason") or ""))
            data = message.get("bytes")
            await far.send(data if data is not None else str(message.get("text") or ""))

    async def far_to_caller() -> Closed:
        while True:
            message = await far.recv()
            if isinstance(message, Closed):
                return message
            if isinstance(message, bytes):
                await caller.send_bytes(message)
            else:
                await caller.send_text(message)

    up = asyncio.create_task(caller_to_far())
    down = asyncio.create_task(far_to_caller())
    try:
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        first = done.pop()
        for task in (up, down):
            if task is not first:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        try:
            end = first.result()
        except (OSError, RuntimeError) as exc:  # the caller went away while a message was sent to it
            log.info("wsrelay.caller_gone", error=str(exc) or repr(exc), **log_context)
            end = Closed(CloseCode.GOING_AWAY)
            first = up
        if first is up:
            await far.close(end.code, end.reason)
        else:
            if end.code == CloseCode.ABNORMAL_CLOSURE:
                log.info("wsrelay.far_side_broke", **log_context)
            with contextlib.suppress(OSError, RuntimeError):
                await caller.close(sendable(end.code), end.reason[:120])
    finally:
        for task in (up, down):
            task.cancel()
        far.abort()


# -- the node's route ----------------------------------------------------------------------------


def port_websocket_router(manager: SandboxManager) -> APIRouter:
    """The WebSocket twin of the port proxy's routes, to be included under the node API's ``/v1``."""
    router = APIRouter()

    async def proxy(sandbox_id: str, port: Annotated[int, Path(ge=1, le=65535)], websocket: WebSocket) -> None:
        await manager.guest(sandbox_id)  # 404 unknown, 409 not running, the error of a dead one
        net = manager.net(sandbox_id)
        if net is None:
            raise PortNotOpen(f"sandbox {sandbox_id} runs without network: port is not open (port {port})",
                              sandbox_id=sandbox_id, port=port)
        host = upstream_host(websocket.headers.raw, port)  # as for any proxied request
        up = await open_upstream(manager, sandbox_id, net.sandbox_ip, port)
        assert up.reader is not None and up.writer is not None
        try:
            far = await ClientSocket.open(up.reader, up.writer, host=host,
                                          target=upstream_target(websocket.scope).decode("latin-1"),
                                          headers=forwarded_headers(websocket.headers.raw, drop=(UPSTREAM_HOST,)),
                                          subprotocols=websocket.scope.get("subprotocols") or (), on_close=up.close)
        except Refused as refused:
            up.close()
            answer = refused.response
            if answer.status_code < 200:
                raise BadGateway(f"the server on port {port} of sandbox {sandbox_id} answered the WebSocket "
                                 f"handshake {answer.status_code}", sandbox_id=sandbox_id, port=port) from None
            denial = HTTPResponse(bytes(answer.body), status_code=answer.status_code)
            length = [h for h in denial.raw_headers if h[0] == b"content-length"]
            denial.raw_headers = [*answer_headers(answer.headers), *length,
                                  (UPSTREAM_STATUS.encode(), str(answer.status_code).encode())]
            await websocket.send_denial_response(denial)
            return
        except HandshakeFailed as exc:
            up.close()
            raise BadGateway(f"the server on port {port} of sandbox {sandbox_id} did not take the WebSocket: {exc}",
                             sandbox_id=sandbox_id, port=port) from None
        except BaseException:
            up.close()
            raise
        await websocket.accept(subprotocol=far.subprotocol, headers=answer_headers(far.response.headers))
        await relay(websocket, far, sandbox=sandbox_id, port=port)

    for route in ("/sandboxes/{sandbox_id}/ports/{port}", "/sandboxes/{sandbox_id}/ports/{port}/{path:path}"):
        router.add_api_websocket_route(route, proxy)
    return router
