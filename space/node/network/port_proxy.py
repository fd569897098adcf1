"""Requests to a server listening inside a sandbox (``0.0.0.0:PORT`` in the guest), proxied by the
node: ``/v1/sandboxes/{id}/ports/{port}/{path}``, every method, both bodies streamed chunk by chunk.

The node connects to the sandbox's address on its own veth (nftables lets the replies of
connections the *host* opened back in: :mod:`space.node.helper.verbs_net`). Such a connection is a
TCP peer of the sandbox, and gVisor cannot checkpoint a sandbox holding an established connection
or one in TIME_WAIT (docs/notes/network.md). Hence:

- one connection per request, never kept alive or pooled;
- every upstream socket has ``SO_LINGER {on, 0}`` and is only ever closed, never shut down: its
  close is a RST, never a FIN, so the sandbox is never the side left in TIME_WAIT (a sandbox that
  closed first sits in FIN_WAIT_2 until our RST, then CLOSED);
- :data:`UPSTREAMS` knows every open (or opening) connection per sandbox, and :func:`reset` aborts
  them all before a full snapshot (:meth:`SandboxManager.take_snapshot`, next to the gateway's reset);
- a connection is registered under the sandbox's manager lock, which a snapshot holds from before
  its reset until after its checkpoint: no new connection slips in between.

The HTTP/1.1 client is httpcore (httpx's engine) on a stream of our own, so that the socket is in the
registry before its SYN leaves. The node answers ``200`` with the server's status in
``X-Space-Upstream-Status`` (:data:`UPSTREAM_STATUS`): any other status is the node's own error (404
unknown sandbox, 409 not running, 502 ``port_not_open``), which the control plane's node client turns
back into the same error, never mistaking it for the server's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Annotated, Any

import httpcore
import httpx
import structlog
from fastapi import APIRouter, Path, Request, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from space.errors import BadGateway, InvalidRequest, PortNotOpen

if TYPE_CHECKING:
    from space.node.sandboxes.manager import SandboxManager

log = structlog.get_logger(__name__)

LINGER0 = struct.pack("ii", 1, 0)
CONNECT_TIMEOUT = 10.0
#: A server that stops acknowledging (its sandbox died or is paused) frees the request in ~2 min.
_KEEPALIVE = ((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1), (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 60),
              (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10), (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 6),
              (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 120_000))
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
UPSTREAM_STATUS = "x-space-upstream-status"
#: The header in which the control plane names the ``Host`` a sandbox's servers see (the sandbox's
#: ``port_host``, E2B's ``maskRequestHost``); without it they see ``localhost:<port>``. A client's
#: own copy never gets past the API (:func:`space.api.ports.proxy_to_port` drops it).
UPSTREAM_HOST = "x-space-upstream-host"
#: A ``port_host``: host name or address characters, with ``${PORT}`` standing for the port anywhere.
PORT_HOST_PATTERN = r"^(?:[A-Za-z0-9._~\-\[\]:]|\$\{PORT\})+$"
PORT_HOST_MAX = 255
_PORT_HOST = re.compile(PORT_HOST_PATTERN)
#: Headers of one hop only (RFC 9110 7.6.1), plus the ones every hop sets itself.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"})
OWN_RESPONSE_HEADERS = frozenset({"date", "server", UPSTREAM_STATUS})


def end_to_end(raw: Iterable[tuple[bytes, bytes]], drop: Iterable[str] = ()) -> list[tuple[bytes, bytes]]:
    """``raw`` without hop-by-hop headers (also those the ``Connection`` header names) nor ``drop``."""
    pairs = [(k.lower(), v) for k, v in raw]
    named = {t.strip() for k, v in pairs if k == b"connection" for t in v.lower().split(b",")}
    skip = {h.encode() for h in HOP_BY_HOP} | {h.lower().encode() for h in drop} | named
    return [(k, v) for k, v in pairs if k not in skip]


def has_body(raw: Iterable[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in raw)


def subpath(scope: Scope) -> str:
    """What follows ``/ports/{port}/`` in the request's raw path: still percent-encoded, as the
    client sent it (the route's decoded ``{path}`` would lose ``%2F`` and the like)."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    after = raw.split(b"/ports/", 1)[1] if b"/ports/" in raw else b""
    return after.partition(b"/")[2].decode("latin-1")


def upstream_target(scope: Scope) -> bytes:
    """The request target for the server: :func:`subpath` and the query string."""
    query: bytes = scope.get("query_string", b"")
    return b"/" + subpath(scope).encode("latin-1") + (b"?" + query if query else b"")


#: What a relayed body's iterator raises when the far side broke off (reset, closed mid-body).
def canonical_name(name: bytes) -> bytes:
    """A header name as most servers write it (``Host``, ``Content-Type``, ``X-Request-Id``): names
    are case-insensitive, but a server in the sandbox may compare them as written (E2B's edge sends
    them so)."""
    return b"-".join(part[:1].upper() + part[1:].lower() for part in name.split(b"-"))


def upstream_host(raw: Iterable[tuple[bytes, bytes]], port: int) -> str:
    """The ``Host`` the server on ``port`` sees: the control plane's :data:`UPSTREAM_HOST` with
    ``${PORT}`` replaced, else ``localhost:<port>`` (what dev servers' host checks accept)."""
    named = [v for k, v in raw if k.lower() == UPSTREAM_HOST.encode()]
    if not named:
        return f"localhost:{port}"
    template = named[0].decode("latin-1")
    if len(named) > 1 or len(template) > PORT_HOST_MAX or not _PORT_HOST.match(template):
        raise InvalidRequest(f"{UPSTREAM_HOST} must be one host[:port], ${{PORT}} for the port", header=UPSTREAM_HOST)
    return template.replace("${PORT}", str(port))


UPSTREAM_BROKE = (httpcore.NetworkError, httpcore.ProtocolError, httpx.TransportError)


class RelayResponse(StreamingResponse):
    """A streamed answer with exactly these headers (repeated ones kept) and a cleanup that runs
    however the response ends: sent, failed, or the client gone.

    A body the far side broke off is left unfinished: the status line is out, so the only way to
    tell the client is a response without its end (the server then closes the connection), never
    a clean end that would pass a cut-short body off as whole."""

    def __init__(self, body: AsyncIterator[bytes], status_code: int, headers: list[tuple[bytes, bytes]],
                 on_close: Callable[[], Awaitable[None]], **log_context: Any) -> None:
        super().__init__(body, status_code=status_code)
        self.raw_headers = headers
        self._on_close = on_close
        self._log_context = log_context

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except UPSTREAM_BROKE as exc:
            log.warning("port_proxy.stream_broken", error=str(exc) or repr(exc), **self._log_context)
        finally:
            await self._on_close()


# -- connections into sandboxes ------------------------------------------------------------------


class Upstream(httpcore.AsyncNetworkStream):
    """One TCP connection from the node into a sandbox."""

    def __init__(self, owner: Upstreams, sandbox_id: str) -> None:
        self.owner, self.sandbox_id = owner, sandbox_id
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER0)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for level, opt, value in _KEEPALIVE:
            self.sock.setsockopt(level, opt, value)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        #: Aborted by :meth:`Upstreams.reset` (reads and writes fail from then on).
        self.killed = False
        self._gone = asyncio.Event()

    async def connect(self, ip: str, port: int, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(self.sock, (ip, port))
                if not self.killed:
                    self.reader, self.writer = await asyncio.open_connection(sock=self.sock, limit=1 << 16)
        except BaseException:
            self.close()
            raise
        if self.killed:  # reset while the handshake finished: the close below is its RST
            self.close()
            raise ConnectionResetError("reset before a snapshot of the sandbox")

    def kill(self) -> None:
        """Abort now: a RST (whatever is unsent is dropped)."""
        self.killed = True
        if self.writer is not None:
            self.close()
        else:
            # Still connecting: a shutdown aborts a SYN_SENT socket, and the connecting task
            # closes it (see connect); one that connected meanwhile is reset there.
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the socket now (SO_LINGER 0: a RST) and leave the registry; idempotent. Never while
        a connect is pending on it (the loop still watches its descriptor then)."""
        if self.writer is not None:
            # abort() stops the loop watching the socket at once (its own close of the same socket
            # object comes a turn later and does nothing), so it can be closed right here.
            self.writer.transport.abort()
        self.sock.close()
        self._gone.set()
        self.owner._discard(self)

    async def wait_gone(self) -> None:
        await self._gone.wait()

    # httpcore.AsyncNetworkStream ----------------------------------------------------------------

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        assert self.reader is not None
        try:
            async with asyncio.timeout(timeout):
                data = await self.reader.read(max_bytes)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc
        if self.killed:
            raise httpcore.ReadError("the connection was reset before a snapshot of the sandbox")
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        assert self.writer is not None
        if self.killed or self.writer.transport.is_closing():
            raise httpcore.WriteError("the connection is closed")
        try:
            self.writer.write(buffer)
            async with asyncio.timeout(timeout):
                await self.writer.drain()
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        self.close()

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # only asked of pooled idle connections, which we never keep
            return False
        return self.writer.get_extra_info(info) if self.writer is not None else None


class Upstreams:
    """The node's open connections into sandboxes, by sandbox."""

    def __init__(self) -> None:
        self._by_sandbox: dict[str, set[Upstream]] = {}

    def count(self, sandbox_id: str) -> int:
        return len(self._by_sandbox.get(sandbox_id, ()))

    def add(self, sandbox_id: str) -> Upstream:
        """A new socket toward the sandbox, registered before it connects (call it under the
        sandbox's manager lock, then :meth:`Upstream.connect` without awaiting anything between)."""
        up = Upstream(self, sandbox_id)
        self._by_sandbox.setdefault(sandbox_id, set()).add(up)
        return up

    def _discard(self, up: Upstream) -> None:
        conns = self._by_sandbox.get(up.sandbox_id)
        if conns is not None:
            conns.discard(up)
            if not conns:
                del self._by_sandbox[up.sandbox_id]

    async def reset(self, sandbox_id: str, timeout: float = 5.0) -> int:
        """Abort every connection into the sandbox and wait until their sockets are closed (their
        RSTs sent); how many there were."""
        victims = list(self._by_sandbox.get(sandbox_id, ()))
        for up in victims:
            up.kill()
        if victims:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    for up in victims:
                        await up.wait_gone()
            log.info("port_proxy.reset", sandbox=sandbox_id, connections=len(victims))
        return len(victims)


#: Every connection this node agent has open into its sandboxes.
UPSTREAMS = Upstreams()


async def reset(sandbox_id: str) -> int:
    """Before a checkpoint: abort the node's proxied connections into the sandbox (RST)."""
    return await UPSTREAMS.reset(sandbox_id)


# -- the route -----------------------------------------------------------------------------------


async def open_upstream(manager: SandboxManager, sandbox_id: str, ip: str, port: int) -> Upstream:
    # Registered under the manager's lock: a snapshot holds it from before its reset until after
    # its checkpoint, so a connection is either reset by it or opened after it.
    async with manager._lock(sandbox_id):
        up = UPSTREAMS.add(sandbox_id)
    try:
        await up.connect(ip, port, CONNECT_TIMEOUT)
    except ConnectionRefusedError:
        raise PortNotOpen(f"sandbox {sandbox_id} is running but port is not open (port {port})",
                          sandbox_id=sandbox_id, port=port) from None
    except TimeoutError:
        raise PortNotOpen(f"sandbox {sandbox_id} did not answer on port {port} within {CONNECT_TIMEOUT:g} s: "
                          "port is not open", sandbox_id=sandbox_id, port=port) from None
    except OSError as exc:
        raise BadGateway(f"cannot connect to port {port} of sandbox {sandbox_id}: {exc}",
                         sandbox_id=sandbox_id, port=port) from None
    return up


def ports_router(manager: SandboxManager) -> APIRouter:
    """``/sandboxes/{id}/ports/{port}[/{path}]``, to be included under the node API's ``/v1``."""
    router = APIRouter()

    async def proxy(sandbox_id: str, port: Annotated[int, Path(ge=1, le=65535)], request: Request) -> Response:
        await manager.guest(sandbox_id)  # 404 unknown, 409 not running, the error of a dead one
        net = manager.net(sandbox_id)
        if net is None:
            raise PortNotOpen(f"sandbox {sandbox_id} runs without network: port is not open (port {port})",
                              sandbox_id=sandbox_id, port=port)
        host = upstream_host(request.headers.raw, port)
        headers = end_to_end(request.headers.raw, drop=("host", "authorization", "expect", UPSTREAM_HOST))
        if "transfer-encoding" in request.headers and "content-length" not in request.headers:
            headers.append((b"transfer-encoding", b"chunked"))
        headers.insert(0, (b"host", host.encode()))
        headers = [(canonical_name(name), value) for name, value in headers]
        up = await open_upstream(manager, sandbox_id, net.sandbox_ip, port)
        conn = httpcore.AsyncHTTP11Connection(httpcore.Origin(b"http", net.sandbox_ip.encode(), port), up)
        body = request.stream() if has_body(request.headers.raw) else None
        try:
            resp = await conn.handle_async_request(httpcore.Request(
                request.method.encode(), httpcore.URL(scheme=b"http", host=net.sandbox_ip.encode(), port=port,
                                                      target=upstream_target(request.scope)),
                headers=headers, content=body,
                extensions={"timeout": {"connect": CONNECT_TIMEOUT, "read": None, "write": None, "pool": None}}))
        except httpcore.ProtocolError as exc:
            up.close()
            raise BadGateway(f"the server on port {port} of sandbox {sandbox_id} sent no valid answer: {exc}",
                             sandbox_id=sandbox_id, port=port) from None
        except (httpcore.NetworkError, httpcore.TimeoutException) as exc:
            up.close()
            raise BadGateway(f"the connection to port {port} of sandbox {sandbox_id} failed: {exc}",
                             sandbox_id=sandbox_id, port=port) from None
        except BaseException:
            up.close()
            raise

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in resp.aiter_stream():
                yield chunk

        async def close() -> None:
            up.close()

        drop = set(OWN_RESPONSE_HEADERS)
        if resp.status < 200 or resp.status in (204, 304):
            drop.add("content-length")  # the entity's size, not of this (empty) body: our 200 has none
        out = [(UPSTREAM_STATUS.encode(), str(resp.status).encode()), *end_to_end(resp.headers, drop=drop)]
        return RelayResponse(chunks(), 200, out, close, sandbox=sandbox_id, port=port)

    for route in ("/sandboxes/{sandbox_id}/ports/{port}", "/sandboxes/{sandbox_id}/ports/{port}/{path:path}"):
        router.add_api_route(route, proxy, methods=METHODS, include_in_schema=False)
    return router
