"""Leader election among controllers: the holder of the ``leader`` lease runs the singletons.

Any number of controllers claim operations; exactly one at a time runs the jobs that must not run
twice at once (reconcile and node heartbeats, policy ticks, the egress audit drain). It holds
the ``leader`` lease (:mod:`space.store.leases`) and renews it every third of its length.

A leader stops leading on its own before anyone else can start: it counts its lease from the
moment it *asked* for the last renewal, on its own monotonic clock, and cancels the singletons
once 80 % of that has passed without a renewal. A follower can take the lease only after the
database's clock says it expired, which is later. A leader that shuts down cleanly releases the
lease, so the next one starts at once; one that dies is replaced after at most one lease length
plus one try interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from space.errors import SpaceError
from space.store import Store

log = structlog.get_logger("space.controller.leader")

LEADER = "leader"
#: The share of the lease after which a leader that could not renew stops leading.
SAFETY = 0.8


class Leadership:
    """Runs ``lead`` while this controller holds the lease, cancels it the moment it may not."""

    def __init__(self, store: Store, holder: str, lead: Callable[[], Coroutine[Any, Any, None]], *,
                 lease_seconds: float = 3.0, name: str = LEADER) -> None:
        self.store = store
        self.holder = holder
        self.name = name
        self.lease_seconds = lease_seconds
        self._lead = lead
        #: The fence of the current term, None while following.
        self.fence: int | None = None
        self._valid_until = 0.0
        self._task: asyncio.Task[None] | None = None
        #: Steps down at the safety deadline even while a renewal hangs on the database.
        self._watchdog: asyncio.TimerHandle | None = None
        self.terms = 0

    def is_leader(self) -> bool:
        return self.fence is not None and time.monotonic() < self._valid_until

    async def run(self) -> None:
        try:
            while True:
                asked = time.monotonic()
                try:
                    fence = await self.store.acquire_lease(self.name, self.holder, self.lease_seconds)
                except SpaceError as exc:
                    log.warning("leader.renew_failed", holder=self.holder, error=str(exc))
                    fence = None if time.monotonic() >= self._valid_until else self.fence
                else:
                    if fence is not None:
                        self._valid_until = asked + self.lease_seconds * SAFETY
                        self._arm_watchdog()
                self._follow_or_lead(fence)
                await asyncio.sleep(self.lease_seconds / 3)
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
            await self._stop_leading()
            with contextlib.suppress(SpaceError, asyncio.CancelledError):
                if self._valid_until:  # it led at some point: the lease may still be its own
                    await self.store.release_lease(self.name, self.holder)

    def _follow_or_lead(self, fence: int | None) -> None:
        if fence is not None and (self.fence != fence or self._task is None or self._task.done()):
            if self.fence is not None and self.fence != fence:
                self._cancel("a new term")  # lapsed and won again: the old term's work is stale
            self.fence = fence
            self.terms += 1
            log.info("leader.elected", holder=self.holder, fence=fence)
            self._task = asyncio.create_task(self._lead(), name=f"leader:{fence}")
        elif fence is None and self.fence is not None:
            self._cancel("lease lost")

    def _cancel(self, why: str) -> None:
        log.warning("leader.stepped_down", holder=self.holder, fence=self.fence, reason=why)
        self.fence = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _arm_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(max(0.0, self._valid_until - time.monotonic()), self._expire)

    def _expire(self) -> None:
        self._watchdog = None
        if self.fence is not None and time.monotonic() >= self._valid_until:
            self._cancel("lease not renewed in time")

    async def _stop_leading(self) -> None:
        task, self._task = self._task, None
        self.fence = None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
