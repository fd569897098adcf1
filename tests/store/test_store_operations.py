"""Operations: claiming with leases, renewal, progress, finishing, and logs.

- claim takes the oldest pending operation; filters by kind and id; None when nothing is claimable
- a held lease is never taken; an expired one is (attempts counts the claims)
- concurrent claimers never get the same operation
- renew only by the holder while running; finish releases the lease and can require the holder
- logs: sequence numbers from 1, paging with after/limit, concurrent appenders never collide
"""

from __future__ import annotations

import anyio
import pytest

from space.errors import Conflict, InvalidRequest, NotFound
from space.store import Operation, Store
from tests.store.storekit import expire_lease, new_op

pytestmark = pytest.mark.anyio


async def _ops(store: Store, n: int, kind: str = "sandbox.create") -> list[Operation]:
    return [(await store.create_operation(new_op(kind=kind, target=f"s{i}")))[0] for i in range(n)]


async def test_claim_oldest_pending_then_none(store: Store) -> None:
    first, second = await _ops(store, 2)
    got = await store.claim_operation("ctl-a", 30)
    assert got is not None and got.id == first.id
    assert (got.status, got.lease_owner, got.attempts) == ("running", "ctl-a", 1)
    assert got.lease_expires_at is not None and got.lease_expires_at > got.updated_at
    got2 = await store.claim_operation("ctl-b", 30)
    assert got2 is not None and got2.id == second.id
    assert await store.claim_operation("ctl-c", 30) is None  # both leases are held


async def test_claim_filters(store: Store) -> None:
    [create] = await _ops(store, 1)
    [delete] = await _ops(store, 1, kind="sandbox.delete")
    got = await store.claim_operation("c", 30, kinds=["sandbox.delete"])
    assert got is not None and got.id == delete.id
    assert await store.claim_operation("c", 30, kinds=["template.build"]) is None
    assert await store.claim_operation("c", 30, op_id=delete.id) is None  # held
    got = await store.claim_operation("c", 30, op_id=create.id)
    assert got is not None and got.id == create.id
    assert await store.claim_operation("c", 30, op_id="op-missing") is None


async def test_expired_lease_is_reclaimed(store: Store) -> None:
    [op] = await _ops(store, 1)
    held = await store.claim_operation("crashed", 30)
    assert held is not None
    assert await store.claim_operation("rescuer", 30) is None
    await expire_lease(store, op.id)
    taken = await store.claim_operation("rescuer", 30)
    assert taken is not None and taken.id == op.id
    assert (taken.lease_owner, taken.attempts) == ("rescuer", 2)
    # the crashed controller comes back: it can neither renew nor finish as the holder
    assert not await store.renew_lease(op.id, "crashed", 30)
    with pytest.raises(Conflict):
        await store.finish_operation(op.id, "succeeded", owner="crashed")
    assert await store.renew_lease(op.id, "rescuer", 60)


async def test_concurrent_claimers_never_share(store: Store) -> None:
    ops = await _ops(store, 12)
    claimed: list[tuple[str, str]] = []
    replica = await Store.open(store.url)  # a second controller process, in effect

    async def claimer(st: Store, name: str) -> None:
        while (op := await st.claim_operation(name, 30)) is not None:
            claimed.append((op.id, name))

    try:
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(claimer, store if i % 2 else replica, f"ctl-{i}")
    finally:
        await replica.close()
    ids = [op_id for op_id, _ in claimed]
    assert sorted(ids) == sorted(op.id for op in ops)  # each exactly once
    running = await store.find_operations(status=["running"])
    assert {(op.id, op.lease_owner) for op in running} == set(claimed)
    assert all(op.attempts == 1 for op in running)


async def test_progress_and_finish(store: Store) -> None:
    [op] = await _ops(store, 1)
    claimed = await store.claim_operation("ctl", 30)
    assert claimed is not None
    await store.set_operation_progress(op.id, {"message": "pulling", "percent": 40})
    assert (await store.get_operation(op.id)).progress == {"message": "pulling", "percent": 40}
    done = await store.finish_operation(op.id, "succeeded", result={"sandbox_id": "s0"}, owner="ctl")
    assert (done.status, done.result, done.lease_expires_at) == ("succeeded", {"sandbox_id": "s0"}, None)
    assert done.finished_at is not None
    assert await store.claim_operation("ctl", 30) is None  # finished work is never claimed again
    assert not await store.renew_lease(op.id, "ctl", 30)

    [op2] = await _ops(store, 1)
    failed = await store.finish_operation(op2.id, "failed", error_code="runtime_error", error_message="x")
    assert (failed.status, failed.error_code, failed.error_message) == ("failed", "runtime_error", "x")
    assert [o.id for o in await store.find_operations(status=["succeeded", "failed"])] == [op.id, op2.id]
    assert [o.id for o in await store.find_operations(target="s0")] == [op.id, op2.id]

    with pytest.raises(InvalidRequest):
        await store.finish_operation(op.id, "running")
    with pytest.raises(NotFound):
        await store.finish_operation("op-missing", "failed")
    with pytest.raises(NotFound):
        await store.set_operation_progress("op-missing", {})


async def test_logs_append_and_page(store: Store) -> None:
    [op] = await _ops(store, 1)
    assert await store.append_operation_logs(op.id, []) == 0
    assert await store.append_operation_logs(op.id, ["one", "two"]) == 2
    assert await store.append_operation_logs(op.id, ["three"]) == 3
    logs = await store.get_operation_logs(op.id)
    assert [(entry.seq, entry.line) for entry in logs] == [(1, "one"), (2, "two"), (3, "three")]
    assert all(entry.at.tzinfo is not None for entry in logs)
    assert [entry.seq for entry in await store.get_operation_logs(op.id, after=1, limit=1)] == [2]
    assert await store.get_operation_logs(op.id, after=3) == []
    with pytest.raises(NotFound):
        await store.append_operation_logs("op-missing", ["x"])


async def test_concurrent_log_appenders(store: Store) -> None:
    [op] = await _ops(store, 1)
    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(store.append_operation_logs, op.id, [f"w{i}-a", f"w{i}-b"])
    logs = await store.get_operation_logs(op.id)
    assert [entry.seq for entry in logs] == list(range(1, 21))
    assert sorted(entry.line for entry in logs) == sorted(f"w{i}-{x}" for i in range(10) for x in "ab")
    # each append's lines stay adjacent
    for i in range(0, 20, 2):
        assert logs[i].line[:-1] == logs[i + 1].line[:-1]
