"""Operations: claiming with leases, renewal, progress, finishing, and logs.

- claim takes the oldest pending operation; filters by kind and id; None when nothing is claimable
- a held lease is never taken; an expired one is (attempts counts the claims)
- concurrent claimers never get the same operation
- one target's operations run one at a time, in the order they were accepted, across replicas
- renew only by the holder while running; finish releases the lease and can require the holder
- logs: sequence numbers from 1, paging with after/limit, concurrent appenders never collide
"""

from __future__ import annotations

import datetime as dt

import anyio
import pytest

from space.errors import Conflict, InvalidRequest, NotFound
from space.store import Operation, Store
from space.store import base as store_base
from space.store import operations as store_operations
from tests.store.storekit import expire_lease, new_op, on_two_pools

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
    delete, _ = await store.create_operation(new_op(kind="sandbox.delete", target="other"))
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

    async def claimer(st: Store, name: str) -> None:
        while (op := await st.claim_operation(name, 30)) is not None:
            claimed.append((op.id, name))

    await on_two_pools(store, claimer, 4)
    ids = [op_id for op_id, _ in claimed]
    assert sorted(ids) == sorted(op.id for op in ops)  # each exactly once
    running = await store.find_operations(status=["running"])
    assert {(op.id, op.lease_owner) for op in running} == set(claimed)
    assert all(op.attempts == 1 for op in running)


async def test_one_target_runs_one_operation_at_a_time_in_order(store: Store) -> None:
    pause, _ = await store.create_operation(new_op(kind="sandbox.pause", target="sb-x"))
    resume, _ = await store.create_operation(new_op(kind="sandbox.resume", target="sb-x"))
    other, _ = await store.create_operation(new_op(kind="sandbox.pause", target="sb-y"))
    first = await store.claim_operation("ctl-a", 30)
    assert first is not None and first.id == pause.id
    # The resume waits for the pause; other targets are not held up behind it.
    second = await store.claim_operation("ctl-b", 30)
    assert second is not None and second.id == other.id
    assert await store.claim_operation("ctl-b", 30) is None
    assert await store.claim_operation("ctl-b", 30, op_id=resume.id) is None
    await store.finish_operation(pause.id, "succeeded", owner="ctl-a")
    third = await store.claim_operation("ctl-b", 30)
    assert third is not None and third.id == resume.id


async def test_an_abandoned_operation_keeps_its_place_in_line(store: Store) -> None:
    """A controller died holding the pause: the resume behind it waits until someone has taken
    the pause over and finished it, never running first."""
    pause, _ = await store.create_operation(new_op(kind="sandbox.pause", target="sb-x"))
    resume, _ = await store.create_operation(new_op(kind="sandbox.resume", target="sb-x"))
    assert (await store.claim_operation("crashed", 30)) is not None
    await expire_lease(store, pause.id)
    rescued = await store.claim_operation("rescuer", 30)
    assert rescued is not None and rescued.id == pause.id  # the expired one first, not the resume
    assert await store.claim_operation("rescuer", 30) is None
    await store.finish_operation(pause.id, "succeeded", owner="rescuer")
    nxt = await store.claim_operation("rescuer", 30)
    assert nxt is not None and nxt.id == resume.id


async def test_a_running_operation_holds_its_target_against_an_earlier_late_one(store: Store) -> None:
    """Two replicas accepted requests for one sandbox at once and the earlier one committed
    last: the later was claimed already, so the earlier waits for it instead of running beside."""
    early = new_op(kind="sandbox.pause", target="sb-x")
    late, _ = await store.create_operation(new_op(kind="snapshot.create", target="sb-x"))
    claimed = await store.claim_operation("ctl-a", 30)
    assert claimed is not None and claimed.id == late.id
    assert late.created_at is not None
    early.created_at = late.created_at - dt.timedelta(seconds=1)
    await store.create_operation(early)
    assert await store.claim_operation("ctl-b", 30) is None
    await store.finish_operation(late.id, "succeeded", owner="ctl-a")
    got = await store.claim_operation("ctl-b", 30)
    assert got is not None and got.id == early.id


async def test_concurrent_claimers_keep_each_target_serial(store: Store) -> None:
    """Four claimers on two connections pools, three targets with five operations each: at no
    moment do two operations of one target run, and each target's run in acceptance order."""
    targets = ("sb-a", "sb-b", "sb-c")
    accepted: dict[str, list[str]] = {t: [] for t in targets}
    for _ in range(5):
        for t in targets:
            op, _ = await store.create_operation(new_op(kind="sandbox.pause", target=t))
            accepted[t].append(op.id)
    running: dict[str, str] = {}
    order: dict[str, list[str]] = {t: [] for t in targets}
    overlaps: list[tuple[str, str, str]] = []

    total = sum(len(ids) for ids in accepted.values())
    finished: list[str] = []
    progress = [anyio.Event()]  # set (and replaced) whenever an operation finishes

    async def claimer(st: Store, name: str) -> None:
        while len(finished) < total:
            seen = progress[0]  # taken first: a finish during the claim below has set it
            op = await st.claim_operation(name, 30)
            if op is None:
                # Everything claimable is held up behind a running one: wait until one finishes.
                with anyio.fail_after(30):
                    await seen.wait()
                continue
            if op.target in running:
                overlaps.append((op.target, running[op.target], op.id))
            running[op.target] = op.id
            order[op.target].append(op.id)
            await st.get_operation(op.id)  # the work: a round trip, during which others claim
            del running[op.target]
            await st.finish_operation(op.id, "succeeded", owner=name)
            finished.append(op.id)
            progress[0].set()
            progress[0] = anyio.Event()

    await on_two_pools(store, claimer, 4)
    assert overlaps == []
    assert order == accepted


async def test_a_controller_whose_clock_runs_ahead_takes_no_live_lease(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Leases are judged by the database's clock: a controller on a machine whose clock is a
    minute ahead neither steals a held lease nor hands out one that is already over."""
    if store.dialect != "postgresql":
        pytest.skip("SQLite serves one machine: there is one clock")
    [op] = await _ops(store, 1)
    held = await store.claim_operation("ctl-a", 30)
    assert held is not None
    real = store_base.utcnow
    monkeypatch.setattr(store_base, "utcnow", lambda: real() + dt.timedelta(seconds=60))
    monkeypatch.setattr(store_operations, "utcnow", lambda: real() + dt.timedelta(seconds=60))
    assert await store.claim_operation("ctl-ahead", 30) is None
    assert await store.renew_lease(op.id, "ctl-a", 30)
    row = await store.get_operation(op.id)
    assert row.lease_expires_at is not None
    assert row.lease_expires_at < real() + dt.timedelta(seconds=31)  # not the fast clock's time


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


async def test_acceptance_order_is_the_databases_whatever_a_replicas_clock_says(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two API replicas, the second's clock an hour behind: what the second accepted later still
    runs after what the first accepted (PostgreSQL stamps acceptance with its own clock)."""
    if store.dialect != "postgresql":
        pytest.skip("SQLite: one machine, one clock")
    first, _ = await store.create_operation(new_op(kind="sandbox.pause", target="sb-order"))
    real = store_operations.utcnow
    monkeypatch.setattr(store_operations, "utcnow", lambda: real() - dt.timedelta(hours=1))
    second, _ = await store.create_operation(new_op(kind="sandbox.resume", target="sb-order"))
    monkeypatch.setattr(store_operations, "utcnow", real)
    assert second.created_at > first.created_at
    claimed = await store.claim_operation("ctl-a", 30)
    assert claimed is not None and claimed.id == first.id
    assert await store.claim_operation("ctl-b", 30) is None  # the second waits for the first
