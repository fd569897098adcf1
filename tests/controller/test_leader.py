"""Leader election: one holder of the ``leader`` lease at a time, on SQLite and PostgreSQL.

- the first to ask holds it; others get None until it expires by the database's clock
- an expired lease passes on with the fence increased (also back to its old holder)
- a release hands it over at once
- concurrent acquirers on two connection pools: exactly one wins
- Leadership runs the singletons only while it holds the lease: two controllers never lead at
  once; the leader's singletons are cancelled when it steps down; a stopped leader is replaced,
  a cleanly stopped one without waiting out its lease
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from sqlalchemy import update

from space.controller.leader import Leadership
from space.errors import Unavailable
from space.store import Store
from space.store import base as store_base
from space.store.models import Lease
from tests.store.storekit import on_two_pools
from tests.waiting import until

pytestmark = pytest.mark.anyio


async def _expire(store: Store, name: str = "leader") -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    async with store._sessionmaker() as s, s.begin():
        await s.execute(update(Lease).where(Lease.name == name).values(expires_at=past))


async def test_one_holder_until_it_expires_then_the_fence_grows(store: Store) -> None:
    assert await store.acquire_lease("leader", "ctl-a", 30) == 1
    assert await store.acquire_lease("leader", "ctl-b", 30) is None
    assert await store.acquire_lease("leader", "ctl-a", 30) == 1  # a renewal keeps the fence
    row = await store.get_lease("leader")
    assert row is not None and (row.holder, row.fence) == ("ctl-a", 1)
    assert row.expires_at > dt.datetime.now(dt.UTC)
    await _expire(store)
    row = await store.get_lease("leader")
    assert row is not None and row.expires_at <= dt.datetime.now(dt.UTC)
    assert await store.acquire_lease("leader", "ctl-b", 30) == 2
    assert await store.acquire_lease("leader", "ctl-a", 30) is None
    await _expire(store)
    # Its old holder gets it back in a new term: whatever it did under fence 1 is stale.
    assert await store.acquire_lease("leader", "ctl-a", 30) == 3
    row = await store.get_lease("leader")
    assert row is not None and (row.holder, row.fence) == ("ctl-a", 3)


async def test_a_clock_running_ahead_does_not_end_a_lease_early(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    if store.dialect != "postgresql":
        pytest.skip("SQLite serves one machine: there is one clock")
    assert await store.acquire_lease("leader", "ctl-a", 30) == 1
    real = store_base.utcnow
    monkeypatch.setattr(store_base, "utcnow", lambda: real() + dt.timedelta(seconds=60))
    assert await store.acquire_lease("leader", "ctl-ahead", 30) is None


async def test_release_hands_it_over_at_once(store: Store) -> None:
    assert await store.acquire_lease("leader", "ctl-a", 30) == 1
    assert not await store.release_lease("leader", "ctl-b")  # not the holder's: nothing happens
    assert await store.acquire_lease("leader", "ctl-b", 30) is None
    assert await store.release_lease("leader", "ctl-a")
    assert await store.acquire_lease("leader", "ctl-b", 30) == 2


async def test_concurrent_acquirers_one_wins(store: Store) -> None:
    won: list[tuple[str, int]] = []

    async def acquirer(st: Store, name: str) -> None:
        fence = await st.acquire_lease("leader", name, 30)
        if fence is not None:
            won.append((name, fence))

    await on_two_pools(store, acquirer, 8)
    assert len(won) == 1 and won[0][1] == 1


class Singletons:
    """What a leader runs: records which holder is leading at every moment."""

    def __init__(self) -> None:
        self.leading: set[str] = set()
        self.overlaps = 0
        self.cancelled: list[str] = []

    def lead(self, holder: str) -> Any:
        async def run() -> None:
            if self.leading:
                self.overlaps += 1
            self.leading.add(holder)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(holder)
                raise
            finally:
                self.leading.discard(holder)
        return run


async def test_two_controllers_never_lead_at_once_and_a_stopped_one_is_replaced(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = Singletons()
    tries: dict[str, int] = {"ctl-a": 0, "ctl-b": 0}
    acquire = store.acquire_lease

    async def counted(name: str, holder: str, seconds: float) -> int | None:
        got = await acquire(name, holder, seconds)
        tries[holder] += 1
        return got

    monkeypatch.setattr(store, "acquire_lease", counted)
    lease = 1.5
    a = Leadership(store, "ctl-a", jobs.lead("ctl-a"), lease_seconds=lease)
    b = Leadership(store, "ctl-b", jobs.lead("ctl-b"), lease_seconds=lease)
    ta = asyncio.create_task(a.run())
    await until(lambda: jobs.leading == {"ctl-a"}, 15, "ctl-a to lead")
    tb = asyncio.create_task(b.run())
    try:
        # Three lease lengths' worth of tries: b keeps trying and failing, a keeps renewing.
        start_a = tries["ctl-a"]
        await until(lambda: tries["ctl-b"] >= 9 and tries["ctl-a"] - start_a >= 9, 30,
                    "nine tries of each controller")
        assert jobs.leading == {"ctl-a"} and not b.is_leader() and b.terms == 0
        # a stops cleanly: it releases the lease and b leads on its next try.
        ta.cancel()
        await asyncio.gather(ta, return_exceptions=True)
        assert jobs.cancelled == ["ctl-a"]
        await until(lambda: jobs.leading == {"ctl-b"}, 15, "ctl-b to lead")
        assert b.fence == 2
    finally:
        tb.cancel()
        await asyncio.gather(ta, tb, return_exceptions=True)
    assert jobs.overlaps == 0


async def test_a_leader_cut_off_from_the_database_steps_down_before_its_lease_expires(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = Singletons()
    a = Leadership(store, "ctl-a", jobs.lead("ctl-a"), lease_seconds=1.5)
    ta = asyncio.create_task(a.run())
    try:
        await until(lambda: jobs.leading == {"ctl-a"}, 15, "ctl-a to lead")

        async def unreachable(*args: Any, **kw: Any) -> int | None:
            raise Unavailable("database unavailable: connection refused")

        monkeypatch.setattr(store, "acquire_lease", unreachable)
        await until(lambda: jobs.cancelled == ["ctl-a"], 15, "ctl-a's singletons to be cancelled")
        stepped_down = dt.datetime.now(dt.UTC)
        row = await store.get_lease("leader")
        # The singletons stopped while the lease still ran: no other controller could lead yet.
        assert row is not None and row.holder == "ctl-a" and stepped_down < row.expires_at
        assert not a.is_leader()
    finally:
        ta.cancel()
        await asyncio.gather(ta, return_exceptions=True)


async def test_a_leader_that_died_is_replaced_after_its_lease(store: Store) -> None:
    """SIGKILL leaves the lease to run out: the follower leads once the database says so."""
    assert await store.acquire_lease("leader", "ctl-dead", 1.5) == 1
    jobs = Singletons()
    b = Leadership(store, "ctl-b", jobs.lead("ctl-b"), lease_seconds=1.5)
    tb = asyncio.create_task(b.run())
    try:
        await until(lambda: jobs.leading == {"ctl-b"}, 15, "ctl-b to lead")
        row = await store.get_lease("leader")
        assert row is not None and (row.holder, row.fence) == ("ctl-b", 2)
    finally:
        tb.cancel()
        await asyncio.gather(tb, return_exceptions=True)
