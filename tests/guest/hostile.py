"""A hostile guest at the guest-client seam: the guest end of a socketpair, speaking the protocol's
framing (or not) from a thread, and a measure of what the node side keeps while it does.

Used by ``test_guest_hostile.py``; ``hostile_guest.py`` is the same malice as PID 1 of a sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import queue
import socket
import threading
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from space.guest import protocol
from space.node.sandboxes.guest_client import GuestConnection

Header = dict[str, Any]
MiB = 1 << 20
#: Frames are written in batches of about this many bytes (a flood is many small frames).
BATCH = 256 * 1024


class FakeGuest:
    """The guest end of a socketpair. A reader thread answers requests with ``handlers[op]`` (run in
    that thread; by default every request is only queued in ``requests``); tests write whatever they
    like with blocking sends. ``read=False``: nobody ever reads what the host sends."""

    def __init__(self, sock: socket.socket, *, read: bool = True) -> None:
        self.sock = sock
        self.requests: queue.Queue[Header] = queue.Queue()
        self.handlers: dict[str, Callable[[Header], None]] = {
            "hello": lambda h: self.reply(h, version=1, boot_ms=1.0, pid=1)}
        self.acks: dict[str, int] = {}
        self._write = threading.Lock()
        self.closing = False
        self._reader: threading.Thread | None = None
        if read:
            self._reader = threading.Thread(target=self._read, name="fake-guest", daemon=True)
            self._reader.start()

    def _read(self) -> None:
        f = self.sock.makefile("rb")
        while True:
            try:
                frame = protocol.read_frame(f.read)
            except (OSError, ValueError, protocol.ProtocolError):
                return
            if frame is None:
                return
            h, _ = frame
            if h.get("t") == "ack":
                self.acks[str(h.get("cmd"))] = int(h.get("bytes") or 0)
            elif h.get("t") == "req":
                handler = self.handlers.get(str(h.get("op")))
                if handler is not None:
                    handler(h)
                else:
                    self.requests.put(h)

    def raw(self, data: bytes) -> None:
        try:
            with self._write:
                self.sock.sendall(data)
        except OSError:
            if not self.closing:
                raise  # a flood still running when the test ends just stops

    def send(self, header: Header, payload: bytes = b"") -> None:
        self.raw(protocol.encode(header, payload))

    def flood(self, frames: Iterable[tuple[Header, bytes]]) -> None:
        """Send many frames, batched into large writes."""
        buf = bytearray()
        for header, payload in frames:
            buf += protocol.encode(header, payload)
            if len(buf) >= BATCH:
                self.raw(bytes(buf))
                buf.clear()
        if buf:
            self.raw(bytes(buf))

    def reply(self, req: Header, **result: Any) -> None:
        self.send({"t": "res", "id": req["id"], "ok": True, **result})

    def request(self, op: str, timeout: float = 30.0) -> Header:
        """The next request of kind ``op`` the host sent (others are dropped)."""
        while True:
            h = self.requests.get(timeout=timeout)
            if h.get("op") == op:
                return h

    def close(self) -> None:
        self.closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@contextlib.asynccontextmanager
async def seam(*, read: bool = True) -> AsyncIterator[tuple[GuestConnection, FakeGuest]]:
    """A GuestConnection (as the node agent opens one, 4 MiB reader limit) to a FakeGuest."""
    host, guest = socket.socketpair()
    fake = FakeGuest(guest, read=read)
    reader, writer = await asyncio.open_unix_connection(sock=host, limit=4 << 20)
    conn = GuestConnection(reader, writer)
    try:
        yield conn, fake
    finally:
        # The test is over before the host side closes: a flood still writing then meets a closed
        # peer, which is its end, not a failure (it raised in a thread, reported in a later test).
        fake.closing = True
        await conn.close()
        fake.close()


class Retained:
    """Python heap the process holds (tracemalloc) beyond what it held when measuring started."""

    def __init__(self) -> None:
        self.base = 0

    def __enter__(self) -> Retained:
        gc.collect()
        tracemalloc.start()
        self.base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        tracemalloc.stop()

    def now(self) -> int:
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - self.base

    def peak(self) -> int:
        return tracemalloc.get_traced_memory()[1] - self.base


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking fake-guest action while the event loop keeps reading the channel."""
    return await asyncio.to_thread(fn, *args)


async def settle(conn: GuestConnection, fake: FakeGuest) -> None:
    """Until the host has read everything the fake guest sent before now: the channel is ordered,
    so once the host has the answer to a request made now, it has dispatched all earlier frames."""
    async with asyncio.timeout(120):
        await conn.request("hello", timeout=120)


def out_events(cid: str, n: int, size: int, *, start_seq: int = 1, start_off: int = 0
               ) -> Iterator[tuple[Header, bytes]]:
    payload = b"x" * size
    for i in range(n):
        yield ({"t": "ev", "kind": "out", "cmd": cid, "seq": start_seq + i, "fd": 1,
                "off": start_off + i * size}, payload)


#: What the daemon charges per buffered event on top of its payload (guest_procs.EVENT_OVERHEAD).
EVENT_COST = 64


class CommandLog:
    """What an honest guest would hold in its replay buffers: ``serve_replay`` answers ``replay``
    from it, windowed by ``max_bytes`` as the daemon does. ``hostile_replays`` answers that many
    replays first with everything at once, ignoring the window (a guest that floods its answer)."""

    def __init__(self, fake: FakeGuest, hostile_replays: int = 0) -> None:
        self.fake = fake
        self.events: dict[str, list[tuple[Header, bytes]]] = {}
        self.exited: set[str] = set()
        self.hostile_replays = hostile_replays
        self.replays = 0
        self.lock = threading.Lock()
        fake.handlers["replay"] = self.serve_replay

    def record(self, frames: Iterable[tuple[Header, bytes]]) -> Iterator[tuple[Header, bytes]]:
        """Log events as they are sent (wrap a flood with it)."""
        for frame in frames:
            header = frame[0]
            with self.lock:
                self.events.setdefault(header["cmd"], []).append(frame)
                if header.get("kind") == "exit":
                    self.exited.add(header["cmd"])
            yield frame

    def serve_replay(self, h: Header) -> None:
        cid = str(h.get("cmd"))
        after = int(h.get("after") or 0)
        window = h.get("max_bytes")
        self.replays += 1
        if self.replays <= self.hostile_replays:
            window = None
        with self.lock:
            log = self.events.get(cid)
            evs = [e for e in (log or []) if e[0]["seq"] > after]
            last_seq = log[-1][0]["seq"] if log else 0
            state = "exited" if cid in self.exited else "running"
        if log is None:
            self.fake.send({"t": "res", "id": h["id"], "ok": False,
                            "error": {"code": "not_found", "message": f"no command {cid!r}"}})
            return
        frames: list[tuple[Header, bytes]] = []
        used = 0
        more = False
        for ev, payload in evs:
            cost = len(payload) + EVENT_COST
            if window is not None and frames and used + cost > window:
                more = True
                break
            frames.append(({"t": "chunk", "id": h["id"], "ev": ev}, payload))
            used += cost
        self.fake.flood(frames)
        self.fake.reply(h, last_seq=last_seq, state=state, **({"more": True} if more else {}))
