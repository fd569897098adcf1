"""Stateful lifecycle rows: snapshots, forks, events, activity and the new sandbox columns.

- create_snapshot: alone or with its operation, atomically; idempotent replay; validation
- get/list/update/latest/delete of snapshots; another tenant's snapshot is NotFound
- create_sandboxes: several sandboxes + a snapshot + the op in one transaction; idempotent replay
  returns the sandboxes in the op's order; a failed insert leaves nothing
- snapshot_in_use: active operations naming it, suspended sandboxes holding it
- events: ids ascending, paging with after/limit; touch_sandbox only moves forward
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from space.errors import Conflict, InvalidRequest, NotFound
from space.lifecycle import State
from space.store import Snapshot, Store
from tests.store.storekit import new_op, new_sandbox, new_snapshot

pytestmark = pytest.mark.anyio

T0 = dt.datetime(2025, 12, 1, 12, 0, tzinfo=dt.UTC)


async def test_new_sandbox_columns(store: Store) -> None:
    sb, _, _ = await store.create_sandbox(new_sandbox(idle_pause_s=60), new_op())
    assert (sb.idle_pause_s, sb.idle_suspend_s, sb.expires_at, sb.snapshot_policy) == (60, None, None, {})
    got = await store.get_sandbox(sb.id)
    assert (got.parent_id, got.source_snapshot, got.snapshot_id, got.last_active_at) == (None,) * 4
    up = await store.update_sandbox(
        sb.id, idle_pause_s=None, idle_suspend_s=600, expires_at=T0, snapshot_policy={"disk": "1m"},
        parent_id="sb-p", source_snapshot="snap-1", snapshot_id="snap-2", last_active_at=T0,
    )
    assert up.generation == 2
    got = await store.get_sandbox(sb.id)
    assert (got.idle_pause_s, got.idle_suspend_s, got.expires_at, got.snapshot_policy) == (
        None, 600, T0, {"disk": "1m"})
    assert (got.parent_id, got.source_snapshot, got.snapshot_id, got.last_active_at) == (
        "sb-p", "snap-1", "snap-2", T0)


async def test_touch_sandbox_only_moves_forward(store: Store) -> None:
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    await store.touch_sandbox(sb.id, T0)
    await store.touch_sandbox(sb.id, T0 - dt.timedelta(seconds=5))  # a late report
    got = await store.get_sandbox(sb.id)
    assert got.last_active_at == T0
    assert (got.generation, got.updated_at) == (sb.generation, sb.updated_at)  # not a change
    later = T0 + dt.timedelta(minutes=1)
    await store.touch_sandbox(sb.id, later)
    assert (await store.get_sandbox(sb.id)).last_active_at == later
    await store.touch_sandbox("sb-missing", later)  # ignored
    with pytest.raises(InvalidRequest):
        await store.touch_sandbox(sb.id, dt.datetime(2030, 1, 1))  # naive


async def test_create_get_update_delete_snapshot(store: Store) -> None:
    snap, op, created = await store.create_snapshot(new_snapshot("sb-1", meta={"label": "x"}))
    assert (created, op) == (True, None)
    got = await store.get_snapshot(snap.id)
    assert (got.status, got.restorable, got.node_id, got.object_key, got.meta, got.kind) == (
        "creating", False, None, None, {"label": "x"}, "disk")
    assert got.created_at.tzinfo == dt.UTC

    up = await store.update_snapshot(snap.id, status="ready", node_id="n1", size_bytes=5 * 2**30,
                                     object_key="t/acme/snap", restorable=True, template_digest="d")
    assert up.updated_at >= got.updated_at
    got = await store.get_snapshot(snap.id, tenant="acme")
    assert (got.status, got.node_id, got.size_bytes, got.object_key, got.restorable) == (
        "ready", "n1", 5 * 2**30, "t/acme/snap", True)

    with pytest.raises(InvalidRequest):
        await store.update_snapshot(snap.id, tenant="evil")
    with pytest.raises(InvalidRequest):
        await store.update_snapshot(snap.id, status="gone")
    with pytest.raises(NotFound, match="snapshot snap-missing not found"):
        await store.update_snapshot("snap-missing", status="ready")

    await store.delete_snapshot_row(snap.id)
    assert (await store.get_snapshot(snap.id)).status == "deleted"  # kept for the audit trail


async def test_snapshot_validation_and_duplicates(store: Store) -> None:
    for bad in ({"kind": "memory"}, {"origin": "whim"}, {"status": "done"}):
        with pytest.raises(InvalidRequest):
            await store.create_snapshot(new_snapshot("sb-1", **bad))
    with pytest.raises(InvalidRequest):
        await store.create_snapshot(new_snapshot("sb-1", tenant="acme"), new_op("globex"))
    snap, _, _ = await store.create_snapshot(new_snapshot("sb-1"))
    with pytest.raises(Conflict):
        await store.create_snapshot(new_snapshot("sb-1", id=snap.id))
    assert len(await store.list_snapshots()) == 1


async def test_snapshot_tenant_isolation(store: Store) -> None:
    snap, _, _ = await store.create_snapshot(new_snapshot("sb-1", tenant="acme"))
    assert (await store.get_snapshot(snap.id, tenant="acme")).id == snap.id
    with pytest.raises(NotFound, match=f"snapshot {snap.id} not found"):
        await store.get_snapshot(snap.id, tenant="globex")
    with pytest.raises(NotFound):
        await store.get_snapshot("snap-missing")


async def test_create_snapshot_with_operation_is_idempotent(store: Store) -> None:
    first = new_snapshot("sb-1", kind="full")
    snap, op, created = await store.create_snapshot(first, new_op(kind="sandbox.snapshot", key="k"))
    assert created and op is not None
    assert (op.target, op.request) == ("sb-1", {"snapshot": snap.id})
    again, op2, created2 = await store.create_snapshot(
        new_snapshot("sb-1", kind="full"), new_op(kind="sandbox.snapshot", key="k"))
    assert (created2, again.id, op2 and op2.id) == (False, snap.id, op.id)
    assert len(await store.list_snapshots()) == 1
    assert len(await store.find_operations()) == 1
    with pytest.raises(InvalidRequest):  # the request names another snapshot
        await store.create_snapshot(new_snapshot("sb-1"),
                                    new_op(kind="sandbox.snapshot", request={"snapshot": "snap-x"}))


async def test_list_and_latest_snapshot(store: Store) -> None:
    def at(minutes: int) -> dt.datetime:
        return T0 + dt.timedelta(minutes=minutes)

    specs = [  # (minute, kind, status, restorable, node)
        (0, "disk", "ready", True, None),
        (1, "full", "ready", True, "n1"),
        (2, "disk", "ready", False, "n1"),
        (3, "full", "failed", False, "n1"),
        (4, "disk", "creating", False, "n2"),
    ]
    snaps = []
    for minute, kind, status, restorable, node in specs:
        snap, _, _ = await store.create_snapshot(new_snapshot(
            "sb-1", kind=kind, status=status, restorable=restorable, node_id=node,
            created_at=at(minute)))
        snaps.append(snap.id)
    other, _, _ = await store.create_snapshot(new_snapshot("sb-2", tenant="globex", status="ready",
                                                           restorable=True, created_at=at(9)))

    def ids(rows: list[Snapshot]) -> list[str]:
        return [r.id for r in rows]

    assert ids(await store.list_snapshots(sandbox_id="sb-1")) == snaps
    assert ids(await store.list_snapshots()) == [*snaps, other.id]
    assert ids(await store.list_snapshots(tenant="globex")) == [other.id]
    assert ids(await store.list_snapshots(sandbox_id="sb-1", kinds=["full"])) == [snaps[1], snaps[3]]
    assert ids(await store.list_snapshots(statuses=["creating", "failed"])) == snaps[3:]
    assert ids(await store.list_snapshots(node_id="n1", restorable=False)) == snaps[2:4]
    assert ids(await store.list_snapshots(sandbox_id="sb-1", restorable=True)) == snaps[:2]

    async def latest(**kw: Any) -> str | None:
        snap = await store.latest_snapshot("sb-1", **kw)
        return None if snap is None else snap.id

    assert await latest() == snaps[1]  # ready and restorable, newest first
    assert await latest(kind="disk") == snaps[0]
    assert await latest(restorable=None) == snaps[2]
    assert await latest(restorable=False) == snaps[2]
    assert await latest(kind="full", restorable=None) == snaps[1]  # the failed one never counts
    assert await latest(node_id="n1", kind="disk", restorable=None) == snaps[2]
    assert await latest(node_id="n2", restorable=None) is None  # still creating
    await store.delete_snapshot_row(snaps[1])
    assert await latest() == snaps[0]
    assert await store.latest_snapshot("sb-none") is None


async def test_create_sandboxes_for_a_fork(store: Store) -> None:
    parent, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    snap = new_snapshot(parent.id, kind="full", origin="fork")
    children = [new_sandbox(parent_id=parent.id, source_snapshot=snap.id) for _ in range(3)]
    op = new_op(kind="sandbox.fork", key="fork-1", request={"snapshot": snap.id})
    rows, op_out, created = await store.create_sandboxes(children, op, snapshot=snap)
    want = [c.id for c in children]
    assert created and [r.id for r in rows] == want
    assert op_out.target == parent.id
    assert op_out.request == {"snapshot": snap.id, "sandbox_ids": want}
    stored = await store.get_sandbox(want[1])
    assert (stored.parent_id, stored.source_snapshot, stored.state, stored.snapshot_policy) == (
        parent.id, snap.id, State.CREATING, {})
    assert (await store.get_snapshot(snap.id)).origin == "fork"

    # a replay (other ids, same key) writes nothing and returns the first request's sandboxes
    replay = [new_sandbox(parent_id=parent.id) for _ in range(3)]
    rows2, op2, created2 = await store.create_sandboxes(
        replay, new_op(kind="sandbox.fork", key="fork-1"), snapshot=new_snapshot(parent.id))
    assert (created2, [r.id for r in rows2], op2.id) == (False, want, op_out.id)
    assert len(await store.list_sandboxes()) == 4
    assert len(await store.list_snapshots()) == 1

    # the key of a sandbox.create is not reusable for a fork
    await store.create_sandbox(new_sandbox(), new_op(key="create-1"))
    with pytest.raises(Conflict):
        await store.create_sandboxes([new_sandbox()], new_op(kind="sandbox.create", key="create-1"))


async def test_create_sandboxes_is_atomic(store: Store) -> None:
    existing, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    with pytest.raises(Conflict):  # the second sandbox collides: nothing may remain
        await store.create_sandboxes([new_sandbox(), new_sandbox(id=existing.id)],
                                     new_op(kind="sandbox.fork"), snapshot=new_snapshot(existing.id))
    assert [s.id for s in await store.list_sandboxes()] == [existing.id]
    assert await store.list_snapshots() == []
    assert len(await store.find_operations()) == 1
    with pytest.raises(InvalidRequest):
        await store.create_sandboxes([], new_op(kind="sandbox.fork"))
    with pytest.raises(InvalidRequest):
        await store.create_sandboxes([new_sandbox("globex")], new_op("acme", kind="sandbox.fork"))
    with pytest.raises(InvalidRequest):
        await store.create_sandboxes([new_sandbox()], new_op(kind="sandbox.fork"),
                                     snapshot=new_snapshot("x", tenant="globex"))


async def test_snapshot_in_use(store: Store) -> None:
    a, b, c = (new_snapshot("sb-1") for _ in range(3))
    for snap in (a, b, c):
        await store.create_snapshot(snap)
    assert not await store.snapshot_in_use(a.id)

    restore, _ = await store.create_operation(
        new_op(kind="sandbox.restore", target="sb-1", request={"snapshot": a.id}))
    gc, _ = await store.create_operation(
        new_op(kind="snapshot.upload", target="sb-1", request={"snapshots": [b.id, "snap-z"]}))
    assert await store.snapshot_in_use(a.id)  # pending
    assert await store.snapshot_in_use(b.id)
    claimed = await store.claim_operation("ctl", 30, op_id=restore.id)
    assert claimed is not None and await store.snapshot_in_use(a.id)  # running
    await store.finish_operation(restore.id, "succeeded")
    await store.finish_operation(gc.id, "failed")
    assert not await store.snapshot_in_use(a.id)
    assert not await store.snapshot_in_use(b.id)

    # a suspended sandbox keeps its state in c until it is terminated
    sb, op, _ = await store.create_sandbox(new_sandbox(), new_op())
    await store.finish_operation(op.id, "succeeded")
    await store.set_sandbox_state(sb.id, State.RUNNING)
    await store.set_sandbox_state(sb.id, State.SUSPENDING)
    await store.set_sandbox_state(sb.id, State.SUSPENDED, snapshot_id=c.id)
    assert await store.snapshot_in_use(c.id)
    await store.set_sandbox_state(sb.id, State.TERMINATING)
    assert await store.snapshot_in_use(c.id)
    await store.set_sandbox_state(sb.id, State.TERMINATED)
    assert not await store.snapshot_in_use(c.id)


async def test_events(store: Store) -> None:
    first = await store.add_event("sb-1", "acme", "crash", "runtime exited", {"code": 137})
    await store.add_event("sb-2", "acme", "idle_pause", "idle for 300s")
    second = await store.add_event("sb-1", "acme", "recovered", "restored from snap-1")
    third = await store.add_event("sb-1", "acme", "idle_pause", "idle for 300s")
    assert first.id < second.id < third.id
    assert (first.data, second.data, first.at.tzinfo) == ({"code": 137}, {}, dt.UTC)
    got = await store.list_events("sb-1")
    assert [(e.id, e.kind) for e in got] == [(first.id, "crash"), (second.id, "recovered"),
                                            (third.id, "idle_pause")]
    assert [e.id for e in await store.list_events("sb-1", after=first.id)] == [second.id, third.id]
    assert [e.id for e in await store.list_events("sb-1", limit=1)] == [first.id]
    assert await store.list_events("sb-1", after=third.id) == []
    assert await store.list_events("sb-none") == []
