"""start_operation: an operation, the snapshot it makes and the in-between state it enters are one
write. A state that moved meanwhile refuses all of it (nothing is left half-done); a repeated
idempotency key returns the first operation and changes nothing."""

from __future__ import annotations

import pytest

from space.errors import InvalidState
from space.lifecycle import State
from space.store import Store
from tests.store.storekit import new_op, new_sandbox, new_snapshot

pytestmark = pytest.mark.anyio


async def running(store: Store) -> str:
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    await store.set_sandbox_state(sb.id, State.RUNNING)
    return sb.id


async def test_moves_the_state_and_records_the_operation_and_snapshot_together(store: Store) -> None:
    sid = await running(store)
    snap = new_snapshot(sid, kind="full", origin="suspend")
    op = new_op(kind="sandbox.suspend", target=sid)
    sb, got, created = await store.start_operation(op, move_to=State.SUSPENDING, expect=[State.RUNNING],
                                                   snapshot=snap)
    assert created and sb.state == State.SUSPENDING and got.request["snapshot"] == snap.id
    assert (await store.get_sandbox(sid)).state == State.SUSPENDING
    assert (await store.get_snapshot(snap.id)).status == "creating"
    assert [o.id for o in await store.find_operations(target=sid, kind="sandbox.suspend")] == [op.id]


async def test_a_state_that_moved_meanwhile_refuses_everything(store: Store) -> None:
    sid = await running(store)
    await store.set_sandbox_state(sid, State.PAUSED)
    snap = new_snapshot(sid, kind="full", origin="suspend")
    op = new_op(kind="sandbox.suspend", target=sid)
    with pytest.raises(InvalidState) as ei:
        await store.start_operation(op, move_to=State.SUSPENDING, expect=[State.RUNNING], snapshot=snap)
    assert ei.value.details["state"] == "paused"
    assert await store.find_operations(target=sid, kind="sandbox.suspend") == []
    assert await store.list_snapshots(sandbox_id=sid) == []
    assert (await store.get_sandbox(sid)).state == State.PAUSED


async def test_a_transition_the_machine_forbids_is_refused(store: Store) -> None:
    sid = await running(store)
    with pytest.raises(InvalidState):
        await store.start_operation(new_op(kind="sandbox.restore", target=sid), move_to=State.SUSPENDED)
    assert await store.find_operations(target=sid, kind="sandbox.restore") == []


async def test_a_repeated_idempotency_key_returns_the_first_operation(store: Store) -> None:
    sid = await running(store)
    first = new_op(kind="sandbox.suspend", target=sid, key="k1")
    _, got1, created1 = await store.start_operation(first, move_to=State.SUSPENDING, expect=[State.RUNNING])
    again = new_op(kind="sandbox.suspend", target=sid, key="k1")
    sb, got2, created2 = await store.start_operation(again, move_to=State.SUSPENDING, expect=[State.RUNNING])
    assert (created1, created2) == (True, False) and got2.id == got1.id and sb.state == State.SUSPENDING


async def test_without_a_state_change_it_only_records(store: Store) -> None:
    sid = await running(store)
    sb, op, created = await store.start_operation(new_op(kind="sandbox.pause", target=sid))
    assert created and sb.state == State.RUNNING and op.status == "pending"


async def test_claim_for_claims_the_operation_in_the_same_write_when_nothing_is_ahead(store: Store) -> None:
    sb, create, _ = await store.create_sandbox(new_sandbox(), new_op())
    await store.set_sandbox_state(sb.id, State.RUNNING)
    await store.finish_operation(create.id, "succeeded")
    op = new_op(kind="sandbox.pause", target=sb.id)
    _, got, created = await store.start_operation(op, expect=[State.RUNNING], claim_for=("api-1", 30.0))
    assert created and (got.status, got.lease_owner, got.attempts) == ("running", "api-1", 1)
    stored = await store.get_operation(op.id)
    assert (stored.status, stored.lease_owner) == ("running", "api-1") and stored.lease_expires_at is not None
    # No controller takes it from under its holder while the lease lives.
    assert await store.claim_operation("ctl-2", 30.0) is None


async def test_claim_for_leaves_it_queued_behind_an_operation_ahead_on_the_sandbox(store: Store) -> None:
    sb, create, _ = await store.create_sandbox(new_sandbox(), new_op())  # the create is still pending
    await store.set_sandbox_state(sb.id, State.RUNNING)
    op = new_op(kind="sandbox.pause", target=sb.id)
    _, got, created = await store.start_operation(op, expect=[State.RUNNING], claim_for=("api-1", 30.0))
    assert created and got.status == "pending" and got.lease_owner is None
    # The controllers take them in order: the create first.
    first = await store.claim_operation("ctl-2", 30.0)
    assert first is not None and first.id == create.id
