"""A scheduled snapshot is taken once per slot, even when two controllers tick at the same moment
(an old leader that still thinks it leads, and the new one): the second finds the first's
operation by its slot key. On SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt

import anyio
import pytest

from space.controller import Controller, NodeRegistry
from space.lifecycle import State
from space.store import Store
from tests.store.storekit import new_op, new_sandbox

pytestmark = pytest.mark.anyio


async def test_two_leaders_ticking_at_once_take_one_scheduled_snapshot(store: Store) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(hours=2)
    sb, _, _ = await store.create_sandbox(
        new_sandbox(node_id="node-a", created_at=past, snapshot_policy={"disk_every": "1h", "full_every": 0}),
        new_op())
    await store.set_sandbox_state(sb.id, State.RUNNING, expect=[State.CREATING])
    await store.finish_operation((await store.find_operations(target=sb.id))[0].id, "succeeded")
    other = await Store.open(store.url)
    nodes_a, nodes_b = NodeRegistry(store), NodeRegistry(other)
    try:
        a, b = Controller(store, nodes_a), Controller(other, nodes_b)
        now = dt.datetime.now(dt.UTC)
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.policies.tick, now)
            tg.start_soon(b.policies.tick, now)
        ops = await store.find_operations(target=sb.id, kind="snapshot.create")
        snaps = await store.list_snapshots(sandbox_id=sb.id)
        assert len(ops) == 1, [o.idempotency_key for o in ops]
        assert [s.origin for s in snaps] == ["schedule"]
    finally:
        await nodes_a.aclose()
        await nodes_b.aclose()
        await other.close()
