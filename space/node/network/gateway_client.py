"""The node agent's client of the egress gateway's control socket.

The protocol is newline-delimited JSON, one answer per request on its connection, and the gateway
serves its connections concurrently. Calls about one sandbox address (``ip``) go one at a time, in
the order they were made: a ``delete`` never overtakes the ``put`` before it, which could leave a
departed sandbox's policy and secrets on an address the next sandbox gets. Calls about different
addresses go side by side on up to ``connections`` connections: one connection held by a lock made
a burst of creates queue on it, each claim waiting for every earlier one's round trip (~2.5 ms each
on a busy host, the last of 20 ~50 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

from space.errors import Unavailable

#: Connections kept to the gateway at most (each an idle file descriptor on both sides when quiet).
CONNECTIONS = 8
#: The longest answer read (the audit log's pages are the big ones).
MAX_ANSWER = 1 << 24

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter, int]


class GatewayClient:
    """Requests to the gateway over its control socket (see the module's docstring for the order)."""

    def __init__(self, socket_path: Path, *, timeout: float = 10.0, connections: int = CONNECTIONS) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._slots = asyncio.Semaphore(connections)
        self._idle: list[_Conn] = []
        #: Per address: its lock and how many calls hold or wait for it (the entry goes at zero).
        self._order: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        #: Raised by :meth:`close`: a connection of an earlier generation is never used again.
        self._generation = 0

    async def call(self, op: str, **args: Any) -> dict[str, Any]:
        ip = args.get("ip")
        if ip is None:
            return await self._call(op, args)
        key = str(ip)
        lock, users = self._order.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                return await self._call(op, args)
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._order[key]

    async def _call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        request = json.dumps({"op": op, **args}).encode() + b"\n"
        async with self._slots:
            for attempt in (1, 2):  # an idle connection may be to a gateway since restarted: once more, anew
                conn: _Conn | None = None
                try:
                    async with asyncio.timeout(self.timeout):
                        conn = self._idle.pop() if attempt == 1 and self._idle else await self._open()
                        reader, writer, _ = conn
                        writer.write(request)
                        await writer.drain()
                        line = await reader.readline()
                    if not line:
                        raise ConnectionResetError("gateway closed the control connection")
                    reply: dict[str, Any] = json.loads(line)
                except (OSError, TimeoutError, ValueError) as exc:
                    if conn is not None:
                        await _close(conn)
                    await self._drop_idle()  # they are as old as the one that failed
                    if attempt == 2 or isinstance(exc, ValueError):
                        raise Unavailable(f"egress gateway unreachable: {exc}", op=op) from exc
                    continue
                except BaseException:
                    # Cancelled mid-call: its answer may still come, and would be read as the next
                    # call's. The connection goes.
                    if conn is not None:
                        conn[1].close()
                    raise
                self._keep(conn)
                if not reply.get("ok", False):
                    raise Unavailable(f"egress gateway refused {op}: {reply.get('error', reply)}")
                return reply
        raise AssertionError("unreachable")

    async def _open(self) -> _Conn:
        reader, writer = await asyncio.open_unix_connection(str(self.socket_path), limit=MAX_ANSWER)
        return reader, writer, self._generation

    def _keep(self, conn: _Conn) -> None:
        if conn[2] == self._generation:
            self._idle.append(conn)
        else:
            conn[1].close()

    async def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await _close(conn)

    async def close(self) -> None:
        """Close every connection (a restarted gateway listens on a new socket); calls under way
        finish on theirs, which are then closed, not kept."""
        self._generation += 1
        await self._drop_idle()


async def _close(conn: _Conn) -> None:
    writer = conn[1]
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
