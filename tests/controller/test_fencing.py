"""A controller works on an operation only while it holds the operation's lease.

- the lease taken over by another controller: the handler is cancelled where it stands, and
  neither its result nor its failure is recorded; the new holder's outcome stands
- the database out of reach for longer than the lease: the handler is cancelled before another
  controller could have taken the operation over
- a controller that lost the lease cannot record a result (``finish_operation`` checks the owner)

The handler is a test's own (the seam: ``Controller._handlers``); the store is real.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest

from space.controller import Controller, NodeRegistry
from space.errors import LeaseLost, Unavailable
from space.store import Operation, Store
from tests.store.storekit import expire_lease, new_op
from tests.waiting import until

pytestmark = pytest.mark.anyio

LEASE = 1.5


class Probe:
    """A handler that starts, then waits for ``release``; records whether it was cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False
        self.cancelled_at: dt.datetime | None = None
        self.finished = False

    async def __call__(self, op: Operation) -> dict[str, Any]:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            self.cancelled_at = dt.datetime.now(dt.UTC)
            raise
        self.finished = True
        return {"by": "first"}


async def _start(store: Store, probe: Probe) -> tuple[Controller, NodeRegistry, Operation, asyncio.Task[None]]:
    nodes = NodeRegistry(store)
    ctl = Controller(store, nodes, lease_seconds=LEASE, reconcile_every=3600, policy_every=3600)
    ctl._handlers["test.probe"] = probe
    op, _ = await store.create_operation(new_op(kind="test.probe", target="sb-fence"))
    task = asyncio.create_task(ctl.run())
    async with asyncio.timeout(10):
        await probe.started.wait()
    return ctl, nodes, op, task


async def _stop(nodes: NodeRegistry, task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await nodes.aclose()


async def test_a_taken_over_operation_is_cancelled_and_its_outcome_never_recorded(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = Probe()
    ctl, nodes, op, task = await _start(store, probe)
    try:
        # The first controller stalls (as a long GC pause or a partition would make it): its
        # renewal waits, and it claims nothing more (else it would take its own op back).
        stalled = asyncio.Event()
        entered = asyncio.Event()
        renew = ctl.store.renew_lease

        async def stalled_renew(*args: Any, **kw: Any) -> bool:
            entered.set()
            await stalled.wait()
            return await renew(*args, **kw)

        async def claims_nothing() -> bool:
            return False

        monkeypatch.setattr(ctl.store, "renew_lease", stalled_renew)
        monkeypatch.setattr(ctl, "_claim_some", claims_nothing)
        # Once its renewals stall (a renewal already under way would otherwise extend the lease
        # right after it is expired below), its lease runs out and another controller takes over.
        async with asyncio.timeout(10):
            await entered.wait()
        await expire_lease(store, op.id)
        rescued = await store.claim_operation("ctl-rescuer", 30)
        assert rescued is not None and rescued.id == op.id
        stalled.set()  # it wakes up: its renewal finds the lease gone
        await until(lambda: probe.cancelled, 10, "the handler to be cancelled")
        assert not probe.finished
        row = await store.get_operation(op.id)
        assert (row.status, row.lease_owner, row.result) == ("running", "ctl-rescuer", None)
        await store.finish_operation(op.id, "succeeded", result={"by": "rescuer"}, owner="ctl-rescuer")
        # The first controller comes back to life: it cannot record anything any more.
        with pytest.raises(LeaseLost):
            await store.finish_operation(op.id, "succeeded", result={"by": "first"}, owner=ctl.owner)
        assert (await store.get_operation(op.id)).result == {"by": "rescuer"}
    finally:
        await _stop(nodes, task)


async def test_a_controller_cut_off_from_the_database_stops_before_its_lease_could_expire(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = Probe()
    ctl, nodes, op, task = await _start(store, probe)
    try:
        async def unreachable(*args: Any, **kw: Any) -> bool:
            raise Unavailable("database unavailable: connection refused")

        monkeypatch.setattr(ctl.store, "renew_lease", unreachable)
        await until(lambda: probe.cancelled, 10, "the handler to be cancelled")
        assert not probe.finished
        row = await store.get_operation(op.id)
        assert (row.status, row.lease_owner) == ("running", ctl.owner)  # left for a later claim
        # It stopped while the lease it last renewed still ran: nobody else could hold it yet.
        assert row.lease_expires_at is not None and probe.cancelled_at is not None
        assert probe.cancelled_at < row.lease_expires_at
    finally:
        await _stop(nodes, task)
