"""Values read from the database that the hot paths use on every call, never older than a bound.

A create reads the node rows, the node's identity, the tenant's egress limits and its quotas. Each
is allowed to be ``ttl`` seconds old (a change made through another replica applies within that),
and until now each was read again on the first call after ``ttl`` had passed: with creates a
second or more apart, which is how agents create, every create paid every read (issue 18 measured
it: the warm create's share of these reads had grown to a quarter of it).

:class:`Fresh` keeps the same bound and moves the reads off the request path: the keys used
lately are read again in the background before they get too old, so a request finds them fresh.
A value older than ``ttl`` is never served; a key nobody asked for in ``keep_for`` seconds is
left to expire (an idle replica reads nothing), and at most ``keep_at_most`` keys are kept warm
(beyond that, a request reads as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger(__name__)

K = TypeVar("K")
V = TypeVar("V")


class Fresh(Generic[K, V]):
    def __init__(self, name: str, load: Callable[[K], Awaitable[V]], *, ttl: float, keep_for: float = 60.0,
                 keep_at_most: int = 64, max_entries: int = 10_000,
                 cacheable: Callable[[V], bool] | None = None) -> None:
        self.name = name
        self._load = load
        self.ttl = ttl
        self.keep_for = keep_for
        self.keep_at_most = keep_at_most
        self.max_entries = max_entries
        self._cacheable = cacheable
        #: key → (monotonic time the read that produced it started, value)
        self._values: dict[K, tuple[float, V]] = {}
        #: Keys by last use, most recent last (the ones the keeper reads again).
        self._used: OrderedDict[K, float] = OrderedDict()
        #: Bumped by :meth:`forget`: a read that started before must not store its (older) value.
        self._generation: dict[K, int] = {}
        self._inflight: dict[K, asyncio.Future[V]] = {}
        self._keeper: asyncio.Task[None] | None = None
        #: Reads made on a request's path and in the background (for tests and metrics).
        self.reads = {"request": 0, "background": 0}

    async def get(self, key: K) -> V:
        now = time.monotonic()
        self._used[key] = now
        self._used.move_to_end(key)
        while len(self._used) > self.keep_at_most:
            self._used.popitem(last=False)
        self._ensure_keeper()
        hit = self._values.get(key)
        if hit is not None and now - hit[0] <= self.ttl:
            return hit[1]
        self.reads["request"] += 1
        return await self._read(key)

    def peek(self, key: K) -> V | None:
        """The value if one at most ``ttl`` old is at hand (no read)."""
        hit = self._values.get(key)
        if hit is not None and time.monotonic() - hit[0] <= self.ttl:
            return hit[1]
        return None

    def forget(self, key: K) -> None:
        """This replica changed what ``key`` reads: the next get reads it again."""
        self._values.pop(key, None)
        self._generation[key] = self._generation.get(key, 0) + 1

    def clear(self) -> None:
        for key in list(self._values):
            self.forget(key)

    async def _read(self, key: K) -> V:
        """One read per key at a time: callers that come while it runs share its answer."""
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        started, generation = time.monotonic(), self._generation.get(key, 0)
        try:
            value = await self._load(key)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: nobody else may be waiting
            raise
        finally:
            self._inflight.pop(key, None)
        fut.set_result(value)
        if self._generation.get(key, 0) == generation and (self._cacheable is None or self._cacheable(value)):
            if key not in self._values and len(self._values) >= self.max_entries:
                self._values.clear()
            self._values[key] = (started, value)
        return value

    def _ensure_keeper(self) -> None:
        loop = asyncio.get_running_loop()
        if self._keeper is not None and not self._keeper.done() and self._keeper.get_loop() is loop:
            return
        self._keeper = loop.create_task(self._keep(), name=f"fresh:{self.name}")

    async def _keep(self) -> None:
        """Read again, every ``ttl / 2``, the keys used in the last ``keep_for`` seconds whose
        value is more than ``ttl / 2`` old; stop once none was used that recently."""
        step = self.ttl / 2
        while True:
            await asyncio.sleep(step)
            now = time.monotonic()
            while self._used and now - next(iter(self._used.values())) > self.keep_for:
                self._used.popitem(last=False)
            if not self._used:
                return
            for key in list(self._used):
                hit = self._values.get(key)
                if hit is not None and now - hit[0] <= step:
                    continue
                try:
                    self.reads["background"] += 1
                    await self._read(key)
                except Exception as exc:  # the request path reads (and reports) it itself
                    log.warning("fresh.read_failed", cache=self.name, error=str(exc) or repr(exc))

    def stop(self) -> None:
        """Stop reading in the background (without waiting: :meth:`aclose` waits)."""
        if self._keeper is not None:
            self._keeper.cancel()

    async def aclose(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await self._keeper
            self._keeper = None


Owner = TypeVar("Owner")


class FreshPerOwner(Generic[Owner, K, V]):
    """One :class:`Fresh` per owner (a ``Store``: one process may hold several, e.g. tests, or an
    API and a controller on different databases), made on first use and gone with its owner.
    ``load(owner, key)`` reads a value; :meth:`forget` and :meth:`clear` apply to every owner's."""

    def __init__(self, name: str, load: Callable[[Owner, K], Awaitable[V]], *, ttl: float,
                 max_entries: int = 10_000) -> None:
        self.name = name
        self._load = load
        self.ttl = ttl
        self.max_entries = max_entries
        self._by_owner: weakref.WeakKeyDictionary[Owner, Fresh[K, V]] = weakref.WeakKeyDictionary()

    def of(self, owner: Owner) -> Fresh[K, V]:
        cache = self._by_owner.get(owner)
        if cache is None:
            load, ref = self._load, weakref.ref(owner)  # a strong one would keep the owner forever

            async def read(key: K) -> V:
                target = ref()
                if target is None:
                    raise ReferenceError(f"{self.name}: the owner of this cache is gone")
                return await load(target, key)

            cache = self._by_owner[owner] = Fresh(self.name, read, ttl=self.ttl, max_entries=self.max_entries)
            weakref.finalize(owner, cache.stop)
        return cache

    async def get(self, owner: Owner, key: K) -> V:
        return await self.of(owner).get(key)

    def forget(self, key: K) -> None:
        for cache in list(self._by_owner.values()):
            cache.forget(key)

    def clear(self) -> None:
        for cache in list(self._by_owner.values()):
            cache.clear()
