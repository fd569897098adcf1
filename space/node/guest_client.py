"""Node-side client of the guest daemon, through the per-sandbox shim's unix socket.

One :class:`GuestConnection` multiplexes every request on one connection: a single reader task
dispatches ``res``/``chunk`` frames by request id and ``ev`` frames by command id.

- :meth:`GuestConnection.request` -- one answer (chunks carrying ``part`` lists are merged into it).
- :meth:`GuestConnection.stream` -- a :class:`GuestStream`: iterate ``(chunk header, payload)``;
  the final ``res`` is in ``.result`` once iteration ends. ``fs.read`` is fetched in windows of
  :data:`READ_WINDOW` bytes, one request each, so a slow consumer never buffers a whole file here
  nor holds up the shared connection.
- :meth:`GuestConnection.upload` -- ``fs.write`` from an async iterator of bytes (aborts on error).
- :meth:`GuestConnection.events` -- a command's events, replayed then live, deduplicated by ``seq``,
  acking consumed output so the guest's flow control follows the slowest subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from space import errors
from space.guest import protocol

Header = dict[str, Any]

#: Ack a subscriber's progress at least this often (and whenever its queue drains).
ACK_EVERY = 256 * 1024
#: Live events a subscriber may hold before it falls back to replaying from the guest's buffer.
SUB_LIMIT = 16 << 20
#: After ``exec`` the client keeps a command's output (unacked) this long for its first subscriber:
#: output that comes before the caller's ``events`` call (a separate HTTP request for API clients)
#: would otherwise be acked on arrival and could be evicted from a small guest buffer before the
#: replay. The guest stops at its flow-control window meanwhile, which bounds what is kept; a command
#: nobody subscribes to runs unattended once the grace ends.
ATTACH_GRACE = 2.0
READ_WINDOW = 8 << 20
_CLOSED: Header = {"t": "closed"}


def _error(err: Any) -> errors.SpaceError:
    if not isinstance(err, dict):
        return errors.Internal(f"malformed error from guest: {err!r}")
    cls = errors.BY_CODE.get(str(err.get("code")), errors.Internal)
    return errors.from_wire(cls.status, {"error": err})


class _Pending:
    __slots__ = ("fut", "op", "parts", "queue")

    def __init__(self, op: str, streaming: bool) -> None:
        self.op = op
        self.fut: asyncio.Future[Header] = asyncio.get_running_loop().create_future()
        self.queue: asyncio.Queue[tuple[Header, bytes] | None] | None = (
            asyncio.Queue() if streaming else None)
        self.parts: dict[str, list[Any]] = {}

    def chunk(self, header: Header, payload: bytes) -> None:
        key = header.get("part")
        if isinstance(key, str):
            self.parts.setdefault(key, []).extend(header.get(key) or [])
        elif self.queue is not None:
            self.queue.put_nowait((header, payload))

    def finish(self, header: Header) -> None:
        for key, items in self.parts.items():
            header[key] = items + list(header.get(key) or [])
        if not self.fut.done():
            self.fut.set_result(header)
        if self.queue is not None:
            self.queue.put_nowait(None)


class _Sub:
    """One ``events()`` consumer's queue of live events."""

    def __init__(self) -> None:
        self.items: deque[tuple[Header, bytes]] = deque()
        self.bytes = 0
        self.overflow = False
        self.closed = False
        self.wakeup = asyncio.Event()
        self.consumed = 0  # output offset this consumer has taken

    def push(self, header: Header, payload: bytes) -> None:
        if self.overflow:
            return
        if self.bytes + len(payload) > SUB_LIMIT:
            self.overflow = True  # the consumer will replay what it missed from the guest's buffer
        else:
            self.items.append((header, payload))
            self.bytes += len(payload)
        self.wakeup.set()

    async def get(self) -> tuple[Header, bytes] | None:
        """The next live event; None once an overflow's backlog is drained (time to replay)."""
        while not self.items:
            if self.overflow:
                self.overflow = False
                return None
            if self.closed:
                raise errors.Unavailable("guest channel closed")
            self.wakeup.clear()
            await self.wakeup.wait()
        header, payload = self.items.popleft()
        self.bytes -= len(payload)
        return header, payload


class _Cmd:
    def __init__(self) -> None:
        self.subs: set[_Sub] = set()
        self.arrived = 0  # end offset of the latest live output
        self.acked = 0
        self.exited = False
        self.held: asyncio.TimerHandle | None = None  # the attach grace (see ATTACH_GRACE)
        self.early: list[tuple[Header, bytes]] = []  # live events kept during the grace
        self.early_bytes = 0


class GuestStream:
    """Async iterator over a request's chunks; ``result`` holds the final answer afterwards."""

    def __init__(self, conn: GuestConnection, op: str, args: Header) -> None:
        self._conn = conn
        self._op = op
        self._args = args
        self._rid: int | None = None
        self._pending: _Pending | None = None
        self._done = False
        self.result: Header | None = None
        self._paged = op == "fs.read"
        self._offset = int(args.get("offset") or 0)
        self._left: int | None = args.get("length")
        self._asked = 0

    def __aiter__(self) -> GuestStream:
        return self

    async def __anext__(self) -> tuple[Header, bytes]:
        while True:
            if self._pending is None:
                if self._done:
                    raise StopAsyncIteration
                self._send()
            assert self._pending is not None
            queue = self._pending.queue
            assert queue is not None
            item = await queue.get()
            if item is not None:
                if self._paged:
                    self._offset += len(item[1])
                    if self._left is not None:
                        self._left -= len(item[1])
                return item
            header = self._pending.fut.result()
            self._release()
            result = self._conn._result(header)
            if self._paged and result.get("read") == self._asked and self._left != 0:
                continue  # the window was full: there may be more
            self.result = result
            self._done = True
            raise StopAsyncIteration

    def _send(self) -> None:
        args = dict(self._args)
        if self._paged:
            self._asked = READ_WINDOW if self._left is None else min(READ_WINDOW, self._left)
            args.update(offset=self._offset, length=self._asked)
        self._rid, self._pending = self._conn._start(self._op, args, b"", streaming=True)

    def _release(self) -> None:
        if self._rid is not None:
            self._conn._pending.pop(self._rid, None)
        self._rid = None
        self._pending = None

    async def aclose(self) -> None:
        """Stop early: later chunks of this request are dropped on arrival."""
        self._release()
        self._done = True


class GuestConnection:
    """A multiplexed connection to one guest daemon (see the module docstring)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        # Ids start at a random point: answers still in flight for a previous connection (the node
        # agent restarted) must not be taken for answers to this one.
        self._ids = itertools.count(int.from_bytes(os.urandom(6), "big") + 1)
        self._pending: dict[int, _Pending] = {}
        self._cmds: dict[str, _Cmd] = {}
        self._closed = asyncio.Event()
        self.hello: Header = {}
        self._task = asyncio.create_task(self._read_loop(), name="guest-reader")

    # -- lifecycle ----------------------------------------------------------------------------

    @classmethod
    async def connect(cls, socket_path: str, *, timeout: float = 10.0) -> GuestConnection:
        """Connect (retrying until the shim listens) and wait for the guest to answer ``hello``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: BaseException | None = None
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise errors.Unavailable(f"guest channel {socket_path} not ready: {last}")
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(socket_path, limit=4 << 20), left)
            except (OSError, TimeoutError) as exc:
                last = exc
                await asyncio.sleep(min(0.02, max(left, 0)))  # retry backoff while the shim starts
                continue
            conn = cls(reader, writer)
            try:
                conn.hello = await conn.request("hello", timeout=max(deadline - loop.time(), 0.001))
                return conn
            except errors.Timeout as exc:
                await conn.close()
                raise errors.Unavailable(f"guest at {socket_path} did not answer hello") from exc
            except errors.Unavailable as exc:  # the shim went away under us: try again
                await conn.close()
                last = exc

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        """Returns when the channel has dropped (or was closed)."""
        await self._closed.wait()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._on_closed()

    def _on_closed(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._writer.close()
        for p in list(self._pending.values()):
            p.finish(dict(_CLOSED))
        self._pending.clear()
        for cmd in self._cmds.values():
            if cmd.held is not None:
                cmd.held.cancel()
            for sub in cmd.subs:
                sub.closed = True
                sub.wakeup.set()

    async def _read_loop(self) -> None:
        try:
            while True:
                prefix = await self._reader.readexactly(8)
                rest, hlen = protocol.decode_lengths(prefix)
                body = await self._reader.readexactly(rest)
                try:
                    header, payload = protocol.decode_body(body, hlen)
                except protocol.ProtocolError:
                    continue  # one bad header; the framing itself is intact
                self._dispatch(header, payload)
        except (asyncio.IncompleteReadError, ConnectionError, protocol.ProtocolError, OSError):
            pass
        finally:
            self._on_closed()

    def _dispatch(self, header: Header, payload: bytes) -> None:
        t = header.get("t")
        if t == "ev":
            kind = header.get("kind")
            if kind in ("out", "exit") and isinstance(header.get("cmd"), str):
                self._on_event(header, payload)
        elif t == "chunk":
            p = self._pending.get(header.get("id"))  # type: ignore[arg-type]
            if p is not None:
                p.chunk(header, payload)
        elif t == "res":
            p = self._pending.pop(header.get("id"), None)  # type: ignore[arg-type]
            if p is not None:
                p.finish(header)

    # -- sending ------------------------------------------------------------------------------

    def _send(self, header: Header, payload: bytes = b"") -> None:
        if self.closed:
            raise errors.Unavailable("guest channel closed")
        try:
            frame = protocol.encode(header, payload)
        except protocol.ProtocolError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        self._writer.write(frame)

    def _start(self, op: str, args: Header, payload: bytes, *, streaming: bool) -> tuple[int, _Pending]:
        rid = next(self._ids)
        p = _Pending(op, streaming)
        self._send({**args, "t": "req", "id": rid, "op": op}, payload)
        self._pending[rid] = p
        return rid, p

    @staticmethod
    def _result(header: Header) -> Header:
        if header.get("t") == "closed":
            raise errors.Unavailable("guest channel closed")
        if not header.get("ok"):
            raise _error(header.get("error"))
        return {k: v for k, v in header.items() if k not in ("t", "id", "ok")}

    # -- requests -----------------------------------------------------------------------------

    async def request(self, op: str, payload: bytes = b"", *,
                      timeout: float | None = 30.0, **args: Any) -> Header:
        """One request, one answer. Raises the :mod:`space.errors` class the guest's code names,
        :class:`~space.errors.Timeout` past ``timeout``, :class:`~space.errors.Unavailable` if the
        channel closes. ``exec`` holds the command's acks for its first subscriber (ATTACH_GRACE)."""
        held = args.get("cmd") if op == "exec" and isinstance(args.get("cmd"), str) else None
        if held is not None:
            self._hold(held, ATTACH_GRACE)
        try:
            rid, p = self._start(op, args, payload, streaming=False)
            try:
                async with asyncio.timeout(timeout):
                    header = await p.fut
            except TimeoutError:
                raise errors.Timeout(f"guest did not answer {op} within {timeout}s") from None
            finally:
                self._pending.pop(rid, None)
            return self._result(header)
        except BaseException:
            cmd = self._cmds.get(held) if held is not None else None
            if held is not None and cmd is not None and not cmd.subs:
                if cmd.held is not None:
                    cmd.held.cancel()
                del self._cmds[held]  # no command started (or we cannot know): nothing to hold
            raise

    def stream(self, op: str, **args: Any) -> GuestStream:
        """Chunks of a request's answer; see :class:`GuestStream` (``.result`` has the ``res``)."""
        return GuestStream(self, op, args)

    async def upload(self, op: str, chunks: AsyncIterator[bytes], **args: Any) -> Header:
        """Stream ``chunks`` as ``data`` frames of request ``op`` (``fs.write``); abort on failure."""
        rid, p = self._start(op, args, b"", streaming=False)
        try:
            async for chunk in chunks:
                if p.fut.done():
                    break  # the guest already answered (an error): stop sending
                for i in range(0, len(chunk), protocol.MAX_PAYLOAD):
                    part = chunk[i : i + protocol.MAX_PAYLOAD] if len(chunk) > protocol.MAX_PAYLOAD else chunk
                    self._send({"t": "data", "id": rid, "eof": False}, bytes(part))
                await self._drain()
            if not p.fut.done():
                self._send({"t": "data", "id": rid, "eof": True})
            header = await p.fut
        except BaseException:
            if not p.fut.done() and not self.closed:
                with contextlib.suppress(errors.SpaceError):
                    self._send({"t": "data", "id": rid, "abort": True})
            raise
        finally:
            self._pending.pop(rid, None)
        return self._result(header)

    async def _drain(self) -> None:
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            raise errors.Unavailable(f"guest channel closed: {exc}") from None
        if self.closed:
            raise errors.Unavailable("guest channel closed")

    # -- command events -----------------------------------------------------------------------

    def _on_event(self, header: Header, payload: bytes) -> None:
        cid: str = header["cmd"]
        cmd = self._cmds.get(cid)
        if cmd is None:
            cmd = self._cmds[cid] = _Cmd()
        if header.get("kind") == "out" and isinstance(header.get("off"), int):
            cmd.arrived = max(cmd.arrived, header["off"] + len(payload))
        elif header.get("kind") == "exit":
            cmd.exited = True
        for sub in cmd.subs:
            sub.push(header, payload)
        if not cmd.subs and cmd.held is not None:
            cmd.early.append((header, payload))
            cmd.early_bytes += len(payload)
            if cmd.early_bytes > SUB_LIMIT:  # the guest ignores its window (host was silent)
                self._unhold(cid, cmd)
            return
        if not cmd.subs:
            self._ack(cid, cmd, force=False)
            if cmd.exited:
                del self._cmds[cid]

    def _hold(self, cid: str, grace: float) -> None:
        """Hold ``cid``'s acks for its first subscriber, at most ``grace`` seconds."""
        cmd = self._cmds.get(cid)
        if cmd is None:
            cmd = self._cmds[cid] = _Cmd()
        if cmd.held is not None:
            cmd.held.cancel()
        cmd.held = asyncio.get_running_loop().call_later(grace, self._unhold, cid, cmd)

    def _unhold(self, cid: str, cmd: _Cmd) -> None:
        if cmd.held is not None:
            cmd.held.cancel()
            cmd.held = None
        cmd.early, cmd.early_bytes = [], 0
        if self._cmds.get(cid) is not cmd or cmd.subs:
            return
        self._ack(cid, cmd, force=True)  # nobody came: run unattended from here
        if cmd.exited:
            del self._cmds[cid]

    def _ack(self, cid: str, cmd: _Cmd, *, force: bool) -> None:
        target = min(s.consumed for s in cmd.subs) if cmd.subs else cmd.arrived
        if target > cmd.acked and (force or target - cmd.acked >= ACK_EVERY) and not self.closed:
            cmd.acked = target
            self._writer.write(protocol.encode({"t": "ack", "cmd": cid, "bytes": target}))

    async def events(self, cmd: str, after: int = 0) -> AsyncGenerator[tuple[Header, bytes], None]:
        """Events of ``cmd`` with ``seq > after``: ``out`` (+ payload), ``gap`` (output evicted from
        the guest's buffer before we got it; ``lost_bytes``) and finally ``exit``. Close the
        iterator (``contextlib.aclosing``) when leaving early, so it stops holding back acks."""
        state = self._cmds.get(cmd)
        if state is None:
            state = self._cmds[cmd] = _Cmd()
        sub = _Sub()
        state.subs.add(sub)
        early = state.early if after == 0 else []
        if state.held is not None:
            state.held.cancel()
            state.held = None
        state.early, state.early_bytes = [], 0
        if [ev["seq"] for ev, _ in early] != list(range(1, len(early) + 1)):
            early = []  # not the command's whole beginning: the guest's replay is the truth
        last = after
        last_off: int | None = 0 if after == 0 else None

        def took(header: Header, payload: bytes, queue_empty: bool) -> None:
            nonlocal last_off
            if header.get("kind") == "out" and isinstance(header.get("off"), int):
                last_off = header["off"] + len(payload)
                sub.consumed = max(sub.consumed, last_off)
                self._ack(cmd, state, force=queue_empty)

        try:
            for held, data in early:  # what arrived before we subscribed, from the start
                last = held["seq"]
                yield held, data
                if held.get("kind") == "exit":
                    return
                took(held, data, False)
            # Held events continue seamlessly into the live queue (registered at the same moment):
            # a replay now could report as evicted what is still on its way to us.
            replay_first = not early
            while True:
                if replay_first:
                    args: Header = {"cmd": cmd, "after": last}
                    if last_off is not None:
                        args["after_off"] = last_off
                    replay = self.stream("replay", **args)
                    in_queue = False
                    async for chunk, payload in replay:
                        ev = chunk.get("ev")
                        if not isinstance(ev, dict) or not isinstance(ev.get("seq"), int) or ev["seq"] <= last:
                            continue
                        if ev.get("kind") == "gap":
                            # Events and answers share one ordered channel: whatever the guest sent
                            # before this replay is in our live queue by now, evicted there or not.
                            if sub.items and sub.items[0][0]["seq"] <= last + 1:
                                in_queue = True
                                await replay.aclose()
                                break
                            last, last_off = ev["seq"], None
                            yield ev, b""
                            continue
                        last = ev["seq"]
                        yield ev, payload
                        if ev.get("kind") == "exit":
                            return
                        took(ev, payload, False)
                    res = replay.result or {}
                    if not in_queue and res.get("state") == "exited" and last >= int(res.get("last_seq", 0)):
                        return
                replay_first = True
                while True:
                    item = await sub.get()
                    if item is None:
                        break  # we dropped live events: fetch them from the guest's buffer
                    ev, payload = item
                    if ev["seq"] <= last:
                        continue
                    if ev["seq"] != last + 1:
                        break  # a hole: the replay fills it
                    last = ev["seq"]
                    yield ev, payload
                    if ev.get("kind") == "exit":
                        return
                    took(ev, payload, not sub.items)
        finally:
            state.subs.discard(sub)
            if not self.closed:
                self._ack(cmd, state, force=True)
            if not state.subs and state.exited and self._cmds.get(cmd) is state:
                del self._cmds[cmd]
