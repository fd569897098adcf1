"""Node-side client of the guest daemon, through the per-sandbox shim's unix socket.

One :class:`GuestConnection` multiplexes every request on one connection: a single reader task
dispatches ``res``/``chunk`` frames by request id and ``ev`` frames by command id.

- :meth:`GuestConnection.request` -- one answer (chunks carrying ``part`` lists are merged into it).
- :meth:`GuestConnection.stream` -- a :class:`GuestStream`: iterate ``(chunk header, payload)``;
  the final ``res`` is in ``.result`` once iteration ends. ``fs.read`` is fetched in windows of
  :data:`READ_WINDOW` bytes and ``replay`` in pages of :data:`REPLAY_WINDOW`, one request each, so a
  slow consumer never buffers a whole file or history here nor holds up the shared connection.
- :meth:`GuestConnection.upload` -- ``fs.write`` from an async iterator of bytes (aborts on error).
- :meth:`GuestConnection.events` -- a command's events, replayed then live, deduplicated by ``seq``,
  acking consumed output so the guest's flow control follows the slowest subscriber.

The guest is hostile
--------------------
Whoever is root inside a sandbox can write any bytes into this channel (the daemon's stdout is
``/proc/1/fd/1``), so everything a guest can make this module keep is bounded, and nothing a guest
sends takes the connection, the node agent or other sandboxes' channels down:

- Frames: the shim forwards whole frames of at most ``protocol.MAX_FRAME`` bytes, and the reader
  reads one length-checked frame at a time (a length beyond that closes the channel; a frame that
  never ends costs one frame). A header that does not parse, or nests past the parser's recursion
  limit, is skipped. Events are rebuilt from the protocol's fields with the protocol's types
  (:func:`clean_event`): nothing else in them is passed on, and an event that does not fit is dropped.
- Ids: answers and chunks for requests that are not pending here (or whose id is not an int) are
  dropped; an error answer becomes the error its code names, with its message only. Events are kept only
  for commands this connection tracks -- started by its own ``exec`` (for the attach grace) or with
  a subscriber (an :meth:`~GuestConnection.events` call); an event naming any other id is dropped,
  acked without keeping state (at ack boundaries, so commands nobody watches run on), and never
  makes the agent track anything.
- Buffers: every queue a guest fills charges each item its payload plus :data:`ITEM_COST` against
  its own limit and against the connection's :data:`BUDGET`, so one guest holds at most BUDGET of
  the agent's memory (plus one item per consumer: an empty queue always takes one, so every
  consumer progresses), whatever the number of commands and subscribers. Past a limit:

  ===============================  ==============  ==============================================
  queue                            limit           past it
  ===============================  ==============  ==============================================
  a subscriber's live events       SUB_LIMIT       dropped; the subscriber replays them from the
                                                   guest's buffer (a ``gap`` if the guest evicted
                                                   them meanwhile)
  output held for a command's      SUB_LIMIT       the hold ends; its first subscriber replays
  first subscriber (attach grace)
  a streaming request's chunks     STREAM_LIMIT    dropped; the stream asks again from where its
  (``fs.read``, ``replay``)                        consumer got (offset, seq): one seamless stream
  an answer's part lists           ANSWER_LIMIT    dropped; the request fails with ``too_large``
  ===============================  ==============  ==============================================

- Writes the guest provokes (acks) are skipped while the channel's write buffer holds
  :data:`WRITE_LIMIT` bytes (a guest that does not read its input); acks carry absolute offsets,
  so the next one carries the progress.
- Backpressure: the reader stops reading the socket while its own buffer is full (the stream
  reader's limit), which backs up through the shim into the guest's stdout. It never waits for a
  consumer: one stalled HTTP client must not stall its sandbox's other requests, so queues drop.
- Fairness: every channel shares the node agent's event loop; the reader yields to it every
  :data:`YIELD_EVERY` frames, so a guest flooding tiny frames does not hold up other sandboxes, and
  reads at most :data:`FRAME_RATE` frames a second (backpressure: the rest waits in the guest).
- Nothing here kills an instance: each rule above keeps the node bounded and loses nothing an
  honest guest still has. What was dropped is counted in :attr:`GuestConnection.dropped` and logged
  once per reason per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeGuard

import structlog

from space import errors
from space.guest import protocol

log = structlog.get_logger("space.node.guest")

Header = dict[str, Any]

#: Ack a subscriber's progress at least this often (and whenever its queue drains).
ACK_EVERY = 256 * 1024
#: Live events a subscriber may hold (bytes, with ITEM_COST each) before it falls back to replaying
#: from the guest's buffer. An honest guest stops WINDOW (4 MiB) past the slowest subscriber's acks.
SUB_LIMIT = 8 << 20
#: After ``exec`` the client keeps a command's output (unacked) this long for its first subscriber:
#: output that comes before the caller's ``events`` call (a separate HTTP request for API clients)
#: would otherwise be acked on arrival and could be evicted from a small guest buffer before the
#: replay. The guest stops at its flow-control window meanwhile, which bounds what is kept; a command
#: nobody subscribes to runs unattended once the grace ends.
ATTACH_GRACE = 2.0
READ_WINDOW = 8 << 20
#: Events one ``replay`` request asks the guest for (``max_bytes``; payload + 64 per event).
REPLAY_WINDOW = 4 << 20
#: Chunks one streaming request may hold for its consumer: a read window (or a replay page) with room.
STREAM_LIMIT = READ_WINDOW + (1 << 20)
#: Weight (:func:`weight`: about the memory of the parsed JSON) of the part lists of one answer. The
#: guest lists at most 100,000 entries (about 80 MiB by this measure).
ANSWER_LIMIT = 128 << 20
#: Everything the queues of one connection may hold together.
BUDGET = 128 << 20
#: What a queued item costs beyond its payload (its rebuilt header, the tuple, the bytes object).
ITEM_COST = 512
#: Acks are not written while this much waits to go to the guest.
WRITE_LIMIT = 1 << 20
#: Frames the reader dispatches before it lets the event loop run other tasks.
YIELD_EVERY = 64
#: Frames per second one connection is read at, at most, after a burst of FRAME_BURST seconds' worth:
#: a guest flooding tiny frames backs up into its own stdout instead of taking the node agent's CPU
#: from other sandboxes. Honest bulk output is ~8,000 frames/s (64 KiB frames at 500 MB/s).
FRAME_RATE = 50_000.0
FRAME_BURST = 0.2
#: Longest command id acked for a command nobody tracks (ours are ~16 characters).
MAX_CMD_ID = 128
_INT_MAX = (1 << 63) - 1
_CLOSED: Header = {"t": "closed"}
_KINDS = {"out": "out", "exit": "exit", "gap": "gap"}  # the interned names, not the guest's copies


def _error(err: Any) -> errors.SpaceError:
    """The error the guest's answer names: its code and message only (the daemon sends no more, and
    the rest of a hostile answer is not passed on to whoever made the request)."""
    if not isinstance(err, dict):
        return errors.Internal(f"malformed error from guest: {str(err)[:200]}")
    code, message = err.get("code"), err.get("message")
    cls = errors.BY_CODE.get(code, errors.Internal) if isinstance(code, str) else errors.Internal
    text = message[:2000] if isinstance(message, str) else f"malformed error from guest: {str(err)[:200]}"
    return errors.from_wire(cls.status, {"error": {"code": cls.code, "message": text}})


def _count(v: Any) -> TypeGuard[int]:
    """A protocol counter: a plain non-negative int (not a bool) that fits a signed 64-bit column."""
    return type(v) is int and 0 <= v <= _INT_MAX


def _small(v: Any) -> int | None:
    return v if type(v) is int and -(1 << 31) <= v < (1 << 31) else None


def clean_event(h: Any, cid: str | None = None) -> Header | None:
    """The event ``h`` rebuilt from the protocol's fields (``cid``: the id string to use), or None if
    it is not an ``out``/``exit``/``gap`` event whose fields have the protocol's types."""
    if not isinstance(h, dict):
        return None
    k = h.get("kind")
    kind = _KINDS.get(k) if isinstance(k, str) else None
    seq = h.get("seq")
    name = h.get("cmd")
    if kind is None or not _count(seq) or seq < 1 or not isinstance(name, str):
        return None
    ev: Header = {"t": "ev", "kind": kind, "cmd": cid if cid is not None else name, "seq": seq}
    if kind == "out":
        off, fd = h.get("off"), h.get("fd")
        if not _count(off) or type(fd) is not int or fd not in (1, 2):
            return None
        ev["off"] = off
        ev["fd"] = fd
    elif kind == "exit":
        ev["exit_code"] = _small(h.get("exit_code"))
        ev["signal"] = _small(h.get("signal"))
        ev["timed_out"] = h.get("timed_out") is True
    else:
        lost = h.get("lost_bytes")
        ev["lost_bytes"] = lost if _count(lost) else 0
    return ev


def weight(obj: Any, cap: int) -> int:
    """About what ``obj`` (parsed JSON) occupies in memory, counted up to a little past ``cap``."""
    total = 0
    stack = [obj]
    while stack and total <= cap:
        o = stack.pop()
        if isinstance(o, str):
            total += 49 + len(o)
        elif isinstance(o, dict):
            total += 64 + 24 * len(o)
            for k, v in o.items():
                total += len(k)
                stack.append(v)
        elif isinstance(o, list):
            total += 56 + 8 * len(o)
            stack.extend(o)
        elif o is not None and not isinstance(o, bool):
            total += 32
    return total


class _Budget:
    """What the queues of one connection hold, against one ceiling (:data:`BUDGET`)."""

    def __init__(self) -> None:
        self.used = 0

    def take(self, cost: int, *, always: bool = False) -> bool:
        if not always and self.used + cost > BUDGET:
            return False
        self.used += cost
        return True

    def give(self, cost: int) -> None:
        self.used -= cost


class _Queue:
    """A FIFO of ``(header, payload)`` bounded by its own limit and the connection's budget."""

    __slots__ = ("_budget", "_limit", "cost", "ended", "items", "wakeup")

    def __init__(self, budget: _Budget, limit: int) -> None:
        self._budget = budget
        self._limit = limit
        self.items: deque[tuple[Header, bytes]] = deque()
        self.cost = 0
        self.ended = False
        self.wakeup = asyncio.Event()

    def put(self, header: Header, payload: bytes) -> bool:
        """Queue an item; False (not queued) past the queue's limit or the connection's budget. An
        empty queue always takes one item, so that its consumer makes progress."""
        cost = len(payload) + ITEM_COST
        if self.items and (self.cost + cost > self._limit or not self._budget.take(cost)):
            return False
        if not self.items:
            self._budget.take(cost, always=True)
        self.items.append((header, payload))
        self.cost += cost
        self.wakeup.set()
        return True

    def pop(self) -> tuple[Header, bytes]:
        header, payload = self.items.popleft()
        cost = len(payload) + ITEM_COST
        self.cost -= cost
        self._budget.give(cost)
        return header, payload

    def clear(self) -> None:
        self._budget.give(self.cost)
        self.cost = 0
        self.items.clear()

    def end(self) -> None:
        self.ended = True
        self.wakeup.set()

    async def get(self) -> tuple[Header, bytes] | None:
        """The next item; None once the queue has ended and is drained."""
        while not self.items:
            if self.ended:
                return None
            self.wakeup.clear()
            await self.wakeup.wait()
        return self.pop()


class _Pending:
    __slots__ = ("_budget", "fut", "op", "parts", "queue", "too_large", "truncated", "weight")

    def __init__(self, budget: _Budget, op: str, streaming: bool) -> None:
        self._budget = budget
        self.op = op
        self.fut: asyncio.Future[Header] = asyncio.get_running_loop().create_future()
        self.queue = _Queue(budget, STREAM_LIMIT) if streaming else None
        self.truncated = False  # chunks were dropped past STREAM_LIMIT: the stream asks again
        self.parts: dict[str, list[Any]] = {}
        self.weight = 0
        self.too_large = False

    def chunk(self, header: Header, payload: bytes) -> str | None:
        """Take a chunk of the answer; the reason it was dropped, if it was."""
        key = header.get("part")
        if isinstance(key, str):
            items = header.get(key)
            if self.too_large:
                return "answer_too_large"
            if not isinstance(items, list):
                return "bad_chunk"
            w = weight(items, ANSWER_LIMIT)
            if self.weight + w > ANSWER_LIMIT or not self._budget.take(w):
                self._drop_parts()
                self.too_large = True
                return "answer_too_large"
            self.parts.setdefault(key, []).extend(items)
            self.weight += w
            return None
        if self.queue is None:
            return "unexpected_chunk"
        if self.truncated:
            return "stream_window"
        clean: Header = {}
        if "ev" in header:
            ev = clean_event(header["ev"])
            if ev is None:
                return "bad_event"
            clean["ev"] = ev
        if not self.queue.put(clean, payload):
            self.truncated = True
            return "stream_window"
        return None

    def _drop_parts(self) -> None:
        self._budget.give(self.weight)
        self.weight = 0
        self.parts = {}

    def finish(self, header: Header) -> None:
        if self.too_large:
            header = {"t": "res", "ok": False, "error": {
                "code": errors.PayloadTooLarge.code,
                "message": f"the guest's answer to {self.op} is larger than {ANSWER_LIMIT} bytes"}}
        for key, items in self.parts.items():
            tail = header.get(key)
            header[key] = items + (tail if isinstance(tail, list) else [])
        self._drop_parts()  # the lists now belong to the answer (and whoever awaits it)
        if not self.fut.done():
            self.fut.set_result(header)
        if self.queue is not None:
            self.queue.end()


class _Sub:
    """One ``events()`` consumer's queue of live events."""

    def __init__(self, budget: _Budget) -> None:
        self.queue = _Queue(budget, SUB_LIMIT)
        self.overflow = False
        self.closed = False
        self.consumed = 0  # output offset this consumer has taken

    @property
    def items(self) -> deque[tuple[Header, bytes]]:
        return self.queue.items

    def push(self, header: Header, payload: bytes) -> None:
        if self.overflow:
            return
        if not self.queue.put(header, payload):
            self.overflow = True  # the consumer will replay what it missed from the guest's buffer
            self.queue.wakeup.set()

    async def get(self) -> tuple[Header, bytes] | None:
        """The next live event; None once an overflow's backlog is drained (time to replay)."""
        while not self.queue.items:
            if self.overflow:
                self.overflow = False
                return None
            if self.closed:
                raise errors.Unavailable("guest channel closed")
            self.queue.wakeup.clear()
            await self.queue.wakeup.wait()
        return self.queue.pop()


class _Cmd:
    """A command this connection tracks: exec'd here (within its attach grace) or subscribed to."""

    __slots__ = ("acked", "arrived", "early", "held", "id", "subs")

    def __init__(self, cid: str, budget: _Budget) -> None:
        self.id = cid
        self.subs: set[_Sub] = set()
        self.arrived = 0  # end offset of the latest live output
        self.acked = 0
        self.held: asyncio.TimerHandle | None = None  # the attach grace (see ATTACH_GRACE)
        self.early = _Queue(budget, SUB_LIMIT)  # live events kept during the grace


class GuestStream:
    """Async iterator over a request's chunks; ``result`` holds the final answer afterwards.

    ``fs.read`` and ``replay`` are paged: one request per window, the next one asked from where the
    consumer got (and again if the client dropped chunks past STREAM_LIMIT)."""

    def __init__(self, conn: GuestConnection, op: str, args: Header) -> None:
        self._conn = conn
        self._op = op
        self._args = args
        self._rid: int | None = None
        self._pending: _Pending | None = None
        self._done = False
        self.result: Header | None = None
        self._offset = int(args.get("offset") or 0)
        self._left: int | None = args.get("length")
        self._asked = 0
        self._after = int(args.get("after") or 0)
        self._after_off: int | None = args.get("after_off")
        self._progressed = False

    def __aiter__(self) -> GuestStream:
        return self

    async def __anext__(self) -> tuple[Header, bytes]:
        while True:
            if self._pending is None:
                if self._done:
                    raise StopAsyncIteration
                self._send()
            assert self._pending is not None and self._pending.queue is not None
            item = await self._pending.queue.get()
            if item is not None:
                header, payload = item
                if self._op == "fs.read":
                    if self._left is not None:
                        payload = payload[: self._left] if len(payload) > self._left else payload
                        self._left -= len(payload)
                    if not payload:
                        continue
                    self._offset += len(payload)
                    self._progressed = True
                elif self._op == "replay" and "ev" in header:
                    ev = header["ev"]
                    if ev["seq"] > self._after:
                        self._after = ev["seq"]
                        self._progressed = True
                        if ev["kind"] == "out":
                            self._after_off = ev["off"] + len(payload)
                        elif ev["kind"] == "gap":
                            self._after_off = None
                return header, payload
            header = self._pending.fut.result()
            truncated = self._pending.truncated
            self._release()
            result = self._conn._result(header)
            if self._more(result, truncated):
                continue
            if truncated and not (self._op == "fs.read" and self._left == 0):
                raise errors.PayloadTooLarge(
                    f"the guest sent more than {STREAM_LIMIT} bytes for one {self._op} request")
            self.result = result
            self._done = True
            raise StopAsyncIteration

    def _more(self, result: Header, truncated: bool) -> bool:
        """Whether another page follows (only after one that moved the stream on)."""
        if not self._progressed:
            return False
        if self._op == "fs.read":
            return self._left != 0 and (truncated or result.get("read") == self._asked)
        if self._op == "replay":
            return truncated or result.get("more") is True
        return False

    def _send(self) -> None:
        args = dict(self._args)
        if self._op == "fs.read":
            self._asked = READ_WINDOW if self._left is None else min(READ_WINDOW, self._left)
            args.update(offset=self._offset, length=self._asked)
        elif self._op == "replay":
            args.update(after=self._after, max_bytes=REPLAY_WINDOW)
            args.pop("after_off", None)
            if self._after_off is not None:
                args["after_off"] = self._after_off
        self._progressed = False
        self._rid, self._pending = self._conn._start(self._op, args, b"", streaming=True)

    def _release(self) -> None:
        if self._rid is not None:
            self._conn._pending.pop(self._rid, None)
        if self._pending is not None and self._pending.queue is not None:
            self._pending.queue.clear()
        self._rid = None
        self._pending = None

    async def aclose(self) -> None:
        """Stop early: later chunks of this request are dropped on arrival."""
        self._release()
        self._done = True


class GuestConnection:
    """A multiplexed connection to one guest daemon (see the module docstring). ``label`` names it
    in logs (the sandbox id)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 label: str = "") -> None:
        self._reader = reader
        self._writer = writer
        self.label = label
        # Ids start at a random point: answers still in flight for a previous connection (the node
        # agent restarted) must not be taken for answers to this one.
        self._ids = itertools.count(int.from_bytes(os.urandom(6), "big") + 1)
        self._pending: dict[int, _Pending] = {}
        self._cmds: dict[str, _Cmd] = {}
        self._budget = _Budget()
        self._paid = 0.0  # see _pace
        #: Frames (or parts of them) dropped, by reason (see the module docstring).
        self.dropped: dict[str, int] = {}
        self._closed = asyncio.Event()
        self.hello: Header = {}
        self._task = asyncio.create_task(self._read_loop(), name="guest-reader")

    @property
    def buffered(self) -> int:
        """Bytes (with ITEM_COST per item) the queues of this connection hold for their consumers."""
        return self._budget.used

    # -- lifecycle ----------------------------------------------------------------------------

    @classmethod
    async def connect(cls, socket_path: str, *, timeout: float = 10.0, label: str = "") -> GuestConnection:
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
            conn = cls(reader, writer, label=label)
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
            cmd.early.clear()
            for sub in cmd.subs:
                sub.closed = True
                sub.queue.wakeup.set()

    def _pace(self, now: float) -> float:
        """Seconds to wait before reading on, for the reader to keep to FRAME_RATE."""
        self._paid = max(self._paid + YIELD_EVERY / FRAME_RATE, now - FRAME_BURST)
        return max(self._paid - now, 0.0)

    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        self._paid = loop.time() - FRAME_BURST  # frames are paid for up to this moment
        frames = 0
        try:
            while True:
                prefix = await self._reader.readexactly(8)
                rest, hlen = protocol.decode_lengths(prefix)
                body = await self._reader.readexactly(rest)
                try:
                    header, payload = protocol.decode_body(body, hlen)
                except protocol.ProtocolError:
                    self._drop("bad_header")  # one bad header; the framing itself is intact
                    continue
                self._dispatch(header, payload)
                frames += 1
                if frames >= YIELD_EVERY:  # the stream reader returns without yielding while it has data
                    frames = 0
                    await asyncio.sleep(self._pace(loop.time()))
        except (asyncio.IncompleteReadError, ConnectionError, protocol.ProtocolError, OSError):
            pass
        finally:
            self._on_closed()

    def _dispatch(self, header: Header, payload: bytes) -> None:
        t = header.get("t")
        if t == "ev":
            if header.get("kind") in ("out", "exit"):
                self._on_event(header, payload)
            return
        rid = header.get("id")
        p = self._pending.get(rid) if type(rid) is int else None  # any JSON may stand in for an id
        if t == "chunk":
            why = "unknown_request" if p is None else p.chunk(header, payload)
            if why is not None:
                self._drop(why)
        elif t == "res":
            if p is None:
                self._drop("unknown_request")
            else:
                del self._pending[header["id"]]
                p.finish(header)

    def _drop(self, why: str) -> None:
        n = self.dropped.get(why, 0)
        self.dropped[why] = n + 1
        if n == 0:
            log.info("guest.frame_dropped", sandbox=self.label, reason=why)

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
        p = _Pending(self._budget, op, streaming)
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
                if self._pending.pop(rid, None) is not None:
                    p.finish(dict(_CLOSED))  # releases what its parts held
            return self._result(header)
        except BaseException:
            cmd = self._cmds.get(held) if held is not None else None
            if cmd is not None and not cmd.subs:
                self._forget(cmd)  # no command started (or we cannot know): nothing to hold
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
            if self._pending.pop(rid, None) is not None:
                p.finish(dict(_CLOSED))
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
        name = header.get("cmd")
        cmd = self._cmds.get(name) if isinstance(name, str) else None
        if cmd is None:
            self._ack_untracked(header, payload)
            return
        ev = clean_event(header, cmd.id)
        if ev is None:
            self._drop("bad_event")
            return
        if ev["kind"] == "out":
            cmd.arrived = max(cmd.arrived, ev["off"] + len(payload))
        for sub in cmd.subs:
            sub.push(ev, payload)
        if cmd.subs:
            return
        if cmd.held is not None:
            if not cmd.early.put(ev, payload):  # the guest ignores its window (host was silent)
                self._unhold(cmd)
            return
        self._forget(cmd)

    def _ack_untracked(self, header: Header, payload: bytes) -> None:
        """A command nobody here tracks (started before this connection, or its hold and
        subscribers are gone): ack its output at ACK_EVERY boundaries so it runs on, keeping nothing."""
        self._drop("untracked_command")
        name, off = header.get("cmd"), header.get("off")
        if header.get("kind") != "out" or not isinstance(name, str) or not 0 < len(name) <= MAX_CMD_ID:
            return
        if not _count(off):
            return
        end = off + len(payload)
        if end // ACK_EVERY > off // ACK_EVERY:
            self._write_ack(name, end)

    def _write_ack(self, cid: str, n: int) -> bool:
        if self.closed or self._writer.transport.get_write_buffer_size() > WRITE_LIMIT:
            return False  # the guest does not read its input: don't pile acks up for it
        self._writer.write(protocol.encode({"t": "ack", "cmd": cid, "bytes": n}))
        return True

    def _hold(self, cid: str, grace: float) -> None:
        """Hold ``cid``'s acks for its first subscriber, at most ``grace`` seconds."""
        cmd = self._cmds.get(cid)
        if cmd is None:
            cmd = self._cmds[cid] = _Cmd(cid, self._budget)
        if cmd.held is not None:
            cmd.held.cancel()
        cmd.held = asyncio.get_running_loop().call_later(grace, self._unhold, cmd)

    def _unhold(self, cmd: _Cmd) -> None:
        if cmd.held is not None:
            cmd.held.cancel()
            cmd.held = None
        cmd.early.clear()
        if self._cmds.get(cmd.id) is cmd and not cmd.subs:
            self._ack(cmd, force=True)  # nobody came: run unattended from here
            self._forget(cmd)

    def _forget(self, cmd: _Cmd) -> None:
        """Stop tracking ``cmd`` (no subscriber is left and no hold)."""
        if cmd.held is not None:
            cmd.held.cancel()
            cmd.held = None
        cmd.early.clear()
        if self._cmds.get(cmd.id) is cmd:
            del self._cmds[cmd.id]

    def _ack(self, cmd: _Cmd, *, force: bool) -> None:
        target = min(s.consumed for s in cmd.subs) if cmd.subs else cmd.arrived
        if target > cmd.acked and (force or target - cmd.acked >= ACK_EVERY) and self._write_ack(cmd.id, target):
            cmd.acked = target

    async def events(self, cmd: str, after: int = 0) -> AsyncGenerator[tuple[Header, bytes], None]:
        """Events of ``cmd`` with ``seq > after``: ``out`` (+ payload), ``gap`` (output evicted from
        the guest's buffer before we got it; ``lost_bytes``) and finally ``exit``. Close the
        iterator (``contextlib.aclosing``) when leaving early, so it stops holding back acks."""
        state = self._cmds.get(cmd)
        if state is None:
            state = self._cmds[cmd] = _Cmd(cmd, self._budget)
        sub = _Sub(self._budget)
        state.subs.add(sub)
        early = state.early
        state.early = _Queue(self._budget, SUB_LIMIT)
        if state.held is not None:
            state.held.cancel()
            state.held = None
        if after != 0 or [ev["seq"] for ev, _ in early.items] != list(range(1, len(early.items) + 1)):
            early.clear()  # not the command's whole beginning: the guest's replay is the truth
        last = after
        last_off: int | None = 0 if after == 0 else None

        def took(header: Header, payload: bytes, queue_empty: bool) -> None:
            nonlocal last_off
            if header.get("kind") == "out":
                last_off = header["off"] + len(payload)
                sub.consumed = max(sub.consumed, last_off)
                self._ack(state, force=queue_empty)

        try:
            replay_first = not early.items
            while early.items:  # what arrived before we subscribed, from the start
                held, data = early.pop()
                last = held["seq"]
                yield held, data
                if held.get("kind") == "exit":
                    return
                took(held, data, False)
            # Held events continue seamlessly into the live queue (registered at the same moment):
            # a replay now could report as evicted what is still on its way to us.
            while True:
                if replay_first:
                    args: Header = {"cmd": cmd, "after": last}
                    if last_off is not None:
                        args["after_off"] = last_off
                    replay = self.stream("replay", **args)
                    in_queue = False
                    try:
                        async for chunk, payload in replay:
                            ev = chunk.get("ev")
                            if ev is None or ev["seq"] <= last:
                                continue
                            if ev["kind"] == "gap":
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
                            if ev["kind"] == "exit":
                                return
                            took(ev, payload, False)
                    finally:  # a consumer leaving mid-replay: what the page holds goes back
                        await replay.aclose()
                    res = replay.result or {}
                    last_seq = res.get("last_seq")
                    if not in_queue and res.get("state") == "exited" and last >= (last_seq if _count(last_seq) else 0):
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
                    if ev["kind"] == "exit":
                        return
                    took(ev, payload, not sub.items)
        finally:
            early.clear()
            sub.queue.clear()
            state.subs.discard(sub)
            if not self.closed:
                self._ack(state, force=True)
            if not state.subs and state.held is None:
                self._forget(state)
