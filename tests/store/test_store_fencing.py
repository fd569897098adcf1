"""Fenced writes (space.store.fencing): a controller's handler writes only while it holds the
operation's lease.

- under its own live lease a fenced write goes through
- once another controller has claimed the operation, a fenced write of the old holder is refused
  with LeaseLost and changes nothing: the new attempt's compare-and-set still finds ``creating``
  (the race that failed a create as "deleted while being created")
- a finished operation fences off every further write of its handler
- work started outside the fence (a size filled in after the operation answered) writes freely
- on PostgreSQL, no claim takes the operation while a fenced write is in flight: the new
  attempt sees that write rather than racing it
"""

from __future__ import annotations

import asyncio

import pytest

from space.errors import LeaseLost
from space.lifecycle import State
from space.store import Store, fencing
from space.store.models import Sandbox, utcnow
from space.store.sandboxes import _move
from tests.store.storekit import expire_lease, new_op, new_sandbox, on_two_pools

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _several_controllers(store: Store) -> None:
    if store.dialect != "postgresql":
        pytest.skip("SQLite serves one controller: its writes are not fenced")


async def _creating(store: Store) -> tuple[str, str]:
    sb, op, _ = await store.create_sandbox(new_sandbox(), new_op())
    return sb.id, op.id


async def test_a_write_under_a_live_lease_goes_through(store: Store) -> None:
    sid, op_id = await _creating(store)
    assert (await store.claim_operation("ctl-a", 30)) is not None
    with fencing.fenced(op_id, "ctl-a"):
        sb = await store.set_sandbox_state(sid, State.RUNNING, expect=[State.CREATING], node_id="n1")
        await store.set_operation_progress(op_id, {"message": "made"})
    assert sb.state == State.RUNNING
    assert (await store.get_operation(op_id)).progress == {"message": "made"}


async def test_the_old_holders_write_after_a_takeover_is_refused_and_changes_nothing(store: Store) -> None:
    sid, op_id = await _creating(store)
    assert (await store.claim_operation("ctl-a", 30)) is not None
    await expire_lease(store, op_id)
    assert (await store.claim_operation("ctl-b", 30)) is not None
    with fencing.fenced(op_id, "ctl-a"), pytest.raises(LeaseLost) as caught:
        await store.set_sandbox_state(sid, State.RUNNING, expect=[State.CREATING], node_id="n1")
    assert caught.value.details["lease_owner"] == "ctl-b"
    assert "ctl-a" in caught.value.message
    sb = await store.get_sandbox(sid)
    assert (sb.state, sb.node_id) == (State.CREATING, None)
    # The new holder's own compare-and-set is what moves it.
    with fencing.fenced(op_id, "ctl-b"):
        assert (await store.set_sandbox_state(sid, State.RUNNING, expect=[State.CREATING])).state == State.RUNNING


async def test_a_finished_operation_fences_off_its_handler(store: Store) -> None:
    sid, op_id = await _creating(store)
    assert (await store.claim_operation("ctl-a", 30)) is not None
    await store.finish_operation(op_id, "failed", error_code="internal", error_message="x", owner="ctl-a")
    with fencing.fenced(op_id, "ctl-a"), pytest.raises(LeaseLost):
        await store.update_sandbox(sid, node_id="n1")
    with fencing.fenced("op-missing", "ctl-a"), pytest.raises(LeaseLost):
        await store.update_sandbox(sid, node_id="n1")
    assert (await store.get_sandbox(sid)).node_id is None


async def test_work_started_outside_the_fence_writes_freely(store: Store) -> None:
    sid, op_id = await _creating(store)
    assert (await store.claim_operation("ctl-a", 30)) is not None
    await store.finish_operation(op_id, "succeeded", owner="ctl-a")
    with fencing.fenced(op_id, "ctl-a"):
        assert fencing.current() == fencing.Fence(op_id, "ctl-a")
        later = asyncio.create_task(store.update_sandbox(sid, node_id="n1"), context=fencing.unfenced_context())
        assert (await later).node_id == "n1"
    assert fencing.current() is None


async def test_no_claim_while_a_fenced_write_is_in_flight(store: Store) -> None:
    """The old holder's transaction has passed its fence check (its lease lapsed a moment ago, but
    nobody had claimed the operation yet). Until it commits, claims pass the operation over (its row
    is locked); the claim after the commit takes it, and the new attempt reads what was written."""
    sid, op_id = await _creating(store)
    assert (await store.claim_operation("ctl-a", 30)) is not None
    await expire_lease(store, op_id)  # lapsed, but still ctl-a's until somebody claims it
    checked, release = asyncio.Event(), asyncio.Event()

    async def old_holder(st: Store, _: str) -> None:
        with fencing.fenced(op_id, "ctl-a"):
            async with st._tx() as s:  # set_sandbox_state's transaction, held open after its check
                checked.set()
                await release.wait()
                row = await s.get(Sandbox, sid, with_for_update=True)
                assert row is not None
                _move(row, State.RUNNING, None, utcnow(), {})

    async def new_holder(st: Store, _: str) -> None:
        await checked.wait()
        try:
            assert await st.claim_operation("ctl-b", 30) is None
        finally:
            release.set()

    await on_two_pools(store, lambda st, name: (old_holder if name == "ctl-0" else new_holder)(st, name), 2)
    got = await store.claim_operation("ctl-b", 30)
    assert got is not None and got.lease_owner == "ctl-b"
    assert (await store.get_sandbox(sid)).state == State.RUNNING
