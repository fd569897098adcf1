"""The sandboxes' client connections: tracking, and closing them so no sandbox is left in TIME_WAIT.

gVisor cannot checkpoint a sandbox holding an established TCP connection or one in TIME_WAIT, and
every TCP peer of a sandbox is this gateway. TIME_WAIT falls on the side that sends the first FIN,
so the gateway closes client connections like this (mitmproxy's connection handler is patched per
connection, in ``client_connected``):

- Every client socket gets ``SO_LINGER {on, 0}``: its final ``close()`` sends a RST, never a FIN.
- The sandbox closed first (we read its FIN): once everything we sent has been acknowledged
  (mitmproxy's write buffer empty, then the kernel's ``SIOCOUTQ`` at 0, so no reply is cut short)
  the socket is closed: RST. The sandbox, in FIN_WAIT_2, goes straight to CLOSED.
- The gateway closes first (upstream finished, ``Connection: close``...): once the sandbox has
  acknowledged all the data it gets ``CLOSE_GRACE`` to close first (a client that knows the
  response is complete does so at once: then RST, as above). Only then a graceful FIN: both ends
  sending FIN at the same moment would leave the sandbox in TIME_WAIT (measured: curl against an
  HTTP/1.0 upstream did, and the checkpoint failed). The sandbox sees a clean EOF and, as the
  passive closer, never enters TIME_WAIT; the
  socket is kept (a ``dup`` outliving mitmproxy's close) until the sandbox closes its end, then
  closed; after ``LINGER`` seconds without that it is reset.
- mitmproxy's half-close of the client (``write_eof``) is not used: it would be a FIN after which
  the sandbox might close first and sit in TIME_WAIT.
- ``reset(ip)`` (before a checkpoint) aborts every connection of a sandbox at once: RST.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import os
import socket
import struct
import termios
import time
from typing import Any

from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import events

from space.egress_policy import IPAddress
from space.gateway.registry import normalize_ip
from space.gateway.stats import Stats

log = logging.getLogger("space.gateway")

LINGER0 = struct.pack("ii", 1, 0)
LINGER = 30.0  # seconds a gateway-closed connection waits for the sandbox to close its end
CLOSE_GRACE = 0.1  # seconds the sandbox gets to close first before the gateway sends its FIN
DRAIN_STALL = 10.0  # seconds without progress after which unacknowledged data is given up


@dataclasses.dataclass
class Target:
    """Where a tunnel (CONNECT or transparent) goes: the name, the port, the address checked."""

    host: str
    port: int
    ip: IPAddress


@dataclasses.dataclass
class Conn:
    client: Any  # mitmproxy.connection.Client
    ip: str
    handler: Any  # mitmproxy.proxy.server.ConnectionHandler
    sock: Any  # asyncio.trsock.TransportSocket
    transport: asyncio.Transport
    transparent: bool = False
    tunnel: Target | None = None
    intercept: bool = False
    denied: bool = False
    closing: bool = False
    aborted: bool = False
    #: Addresses checked for upstream connections not opened yet: (host, port) → address.
    pending: dict[tuple[str, int], IPAddress] = dataclasses.field(default_factory=dict)
    #: Server connection id → the address mitmproxy thinks it has (restored after connecting).
    swapped: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    tasks: set[asyncio.Task[Any]] = dataclasses.field(default_factory=set)


class Connections:
    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self._conns: dict[str, Conn] = {}
        self._lingering: dict[int, tuple[str, socket.socket, asyncio.TimerHandle]] = {}
        self.proxyserver: Any = None  # set by the addon once mitmproxy runs

    # ---- bookkeeping -------------------------------------------------------------------------------

    def attach(self, client: Any) -> Conn | None:
        """Take charge of a new client connection: SO_LINGER 0 and the close policy above."""
        handler = self.proxyserver.connections.get(client.id) if self.proxyserver is not None else None
        if handler is None:
            return None
        writer = handler.transports[client].writer
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER0)
        conn = Conn(client=client, ip=normalize_ip(client.peername[0]), handler=handler, sock=sock,
                    transport=writer.transport,
                    transparent=type(client.proxy_mode).__name__ == "TransparentMode")
        self._conns[client.id] = conn
        self._patch(conn)
        return conn

    def detach(self, client: Any) -> None:
        conn = self._conns.pop(client.id, None)
        if conn is not None:
            for t in conn.tasks:
                t.cancel()

    def get(self, client_id: str) -> Conn | None:
        return self._conns.get(client_id)

    def of_ip(self, ip: str) -> list[Conn]:
        return [c for c in self._conns.values() if c.ip == ip]

    def count(self, ip: str | None = None) -> int:
        if ip is None:
            return len(self._conns) + len(self._lingering)
        return len(self.of_ip(ip)) + sum(1 for v in self._lingering.values() if v[0] == ip)

    # ---- aborting ----------------------------------------------------------------------------------

    def abort(self, conn: Conn) -> None:
        """Reset one client connection now (RST; whatever is unsent is dropped)."""
        if conn.aborted:
            return
        conn.aborted = conn.denied = conn.closing = True
        self.stats.resets += 1
        for t in conn.tasks:
            t.cancel()
        conn.client.state = ConnectionState.CLOSED
        conn.transport.abort()  # closes the socket at once: SO_LINGER 0 makes that a RST
        self._cancel_handler(conn, "reset by the gateway")

    async def reset(self, ip: str, timeout: float = 5.0) -> int:
        """Abort every connection of ``ip`` and wait until they are gone; how many there were."""
        victims = self.of_ip(ip)
        for conn in victims:
            self.abort(conn)
        lingering = [fd for fd, v in self._lingering.items() if v[0] == ip]
        for fd in lingering:
            self._end_linger(fd)
        deadline = time.monotonic() + timeout
        while self.of_ip(ip) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return len(victims) + len(lingering)

    async def close_all(self, timeout: float = 5.0) -> None:
        """Reset every connection (shutting down) and wait for mitmproxy's handlers to finish."""
        for conn in list(self._conns.values()):
            self.abort(conn)
        for fd in list(self._lingering):
            self._end_linger(fd)
        deadline = time.monotonic() + timeout
        while self._conns and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    # ---- the close policy --------------------------------------------------------------------------

    def _patch(self, conn: Conn) -> None:
        handler, client, stats = conn.handler, conn.client, self.stats
        orig_close = handler.close_connection
        orig_event = handler.server_event

        def close_connection(connection: Any, half_close: bool = False) -> None:
            if connection is not client:
                orig_close(connection, half_close)
            else:
                self._close_client(conn)

        async def server_event(event: Any) -> None:
            if type(event) is events.DataReceived:
                if event.connection is client:
                    stats.bytes_up += len(event.data)
                else:
                    stats.bytes_down += len(event.data)
            await orig_event(event)

        handler.close_connection = close_connection
        handler.server_event = server_event

    def _close_client(self, conn: Conn) -> None:
        if conn.closing:
            return
        conn.closing = True
        if not conn.client.state & ConnectionState.CAN_READ:
            # The sandbox sent its FIN already. Keep mitmproxy's handler waiting (CAN_WRITE) until
            # our data is acknowledged, then its close is a RST.
            conn.client.state = ConnectionState.CAN_WRITE
            self._spawn(conn, self._drain_then_reset(conn))
        else:
            conn.client.state = ConnectionState.CLOSED
            with contextlib.suppress(Exception):
                conn.transport.pause_reading()
            self._spawn(conn, self._drain_then_fin(conn))

    def _spawn(self, conn: Conn, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)

    def _cancel_handler(self, conn: Conn, why: str) -> None:
        io = conn.handler.transports.get(conn.client)
        if io is not None and io.handler is not None:
            io.handler.cancel(why)

    async def _drain_then_reset(self, conn: Conn) -> None:
        try:
            await self._drain(conn, kernel=True)
        finally:
            self._cancel_handler(conn, "closed by command")

    async def _drain_then_fin(self, conn: Conn) -> None:
        try:
            await self._drain(conn, kernel=True)
            if await self._client_closes(conn, CLOSE_GRACE):
                return  # the handler's close is a RST: the sandbox, in FIN_WAIT_2, goes to CLOSED
            fd = conn.sock.fileno()
            if fd >= 0 and not conn.transport.is_closing():
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_WR)
                    self._linger(conn.ip, os.dup(fd))
        finally:
            self._cancel_handler(conn, "closed by command")

    async def _client_closes(self, conn: Conn, grace: float) -> bool:
        """Whether the sandbox sends its FIN within ``grace`` seconds (read by peeking)."""
        fd = conn.sock.fileno()
        if fd < 0:
            return False
        peek = socket.socket(fileno=os.dup(fd))
        try:
            peek.setblocking(False)
            deadline = time.monotonic() + grace
            while not conn.transport.is_closing():
                try:
                    # EOF: it closed. Data: a pipelined request, so it will not close first.
                    return peek.recv(1, socket.MSG_PEEK) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    return True
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(0.002)
            return False
        finally:
            os.close(peek.detach())  # the dup only: the connection itself stays open

    async def _drain(self, conn: Conn, *, kernel: bool) -> None:
        """Until everything written is in the kernel (and, with ``kernel``, acknowledged)."""
        last, stall = -1, time.monotonic() + DRAIN_STALL
        while not conn.transport.is_closing():
            pending = conn.transport.get_write_buffer_size()
            if not pending and kernel:
                pending = _outq(conn.sock)
            if not pending:
                return
            now = time.monotonic()
            if pending != last:
                last, stall = pending, now + DRAIN_STALL
            elif now > stall:
                log.warning("giving up on %d unacknowledged bytes to %s", pending, conn.ip)
                return
            await asyncio.sleep(0.002)

    def _linger(self, ip: str, fd: int) -> None:
        """Hold a FIN'd socket until the sandbox closes its end (or LINGER passes), then close it."""
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(LINGER, self._end_linger, fd)
        self._lingering[fd] = (ip, sock, timer)

        def readable() -> None:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._end_linger(fd)

        loop.add_reader(fd, readable)

    def _end_linger(self, fd: int) -> None:
        item = self._lingering.pop(fd, None)
        if item is None:
            return
        _, sock, timer = item
        timer.cancel()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fd)
        sock.close()


def _outq(sock: Any) -> int:
    """Bytes the kernel still holds for the peer (unsent or unacknowledged)."""
    try:
        buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", buf)[0])
