"""Per-tenant quotas in the store (SQLite and PostgreSQL).

- limits: no row is unlimited; put_quota changes only the limits it names, None clears one; the
  tenant's egress default and its limits are independent; bad values are refused
- usage: counts every sandbox but terminating/terminated ones (sizes summed); storage is the size
  of creating/ready snapshots
- enforcement: the create that would pass a limit raises QuotaExceeded naming resource, limit,
  in_use and requested, on the SQLite fast path (no idempotency key) and the transactional path;
  an idempotent retry of an accepted create is answered, not refused; a delete frees the quota
- atomicity: concurrent creates at the limit, through one store and through two stores on the
  same database (two replicas), admit exactly the limit
- forks: create_sandboxes asks for all its sandboxes at once; storage is checked for manual and
  fork snapshots only (a suspend is never refused)
"""

from __future__ import annotations

import asyncio

import anyio
import anyio.to_thread
import pytest

from space.errors import InvalidRequest, QuotaExceeded
from space.lifecycle import State
from space.store import Store
from space.store.quotas import QuotaDemand
from tests.store.storekit import new_op, new_sandbox, new_snapshot

pytestmark = pytest.mark.anyio


async def test_no_quota_is_unlimited(store: Store) -> None:
    assert await store.get_quota("acme") is None
    for _ in range(3):
        await store.create_sandbox(new_sandbox(cpu=64.0, memory_mb=262144), new_op())
    usage = await store.quota_usage("acme")
    assert (usage.sandboxes, usage.cpu, usage.memory_mb, usage.storage_mb) == (3, 192.0, 3 * 262144, 0.0)
    await store.check_quota("acme", QuotaDemand(sandboxes=100, cpu=1e6, memory_mb=10**9, storage=True))


async def test_put_quota_changes_only_what_it_names(store: Store) -> None:
    q = await store.put_quota("acme", {"sandboxes": 2, "cpu": 1.5})
    assert (q.sandboxes, q.cpu, q.memory_mb, q.storage_mb, q.egress) == (2, 1.5, None, None, {})
    q = await store.put_quota("acme", {"memory_mb": 1024})
    assert (q.sandboxes, q.cpu, q.memory_mb) == (2, 1.5, 1024)
    q = await store.put_quota("acme", {"sandboxes": None})
    assert (q.sandboxes, q.cpu, q.memory_mb) == (None, 1.5, 1024)
    q = await store.set_tenant_egress("acme", {"allow": ["pypi.org"]})
    assert (q.egress, q.cpu, q.memory_mb) == ({"allow": ["pypi.org"]}, 1.5, 1024)
    q = await store.put_quota("acme", {"storage_mb": 10})
    assert (q.egress, q.storage_mb) == ({"allow": ["pypi.org"]}, 10)
    fresh = await store.set_tenant_egress("globex", {"default": "deny"})
    assert (fresh.sandboxes, fresh.egress) == (None, {"default": "deny"})
    got = await store.get_quota("acme")
    assert got is not None and (got.cpu, got.storage_mb) == (1.5, 10)
    for bad in ({"sandboxes": -1}, {"memory_mb": 1.5}, {"disks": 3}):
        with pytest.raises(InvalidRequest):
            await store.put_quota("acme", bad)


async def test_usage_counts_until_the_delete_is_accepted(store: Store) -> None:
    ids = []
    for cpu, mem in ((1.0, 512), (0.5, 256), (2.0, 1024), (1.0, 128)):
        sb, _, _ = await store.create_sandbox(new_sandbox(cpu=cpu, memory_mb=mem), new_op())
        ids.append(sb.id)
    await store.create_sandbox(new_sandbox("globex"), new_op("globex"))
    await store.set_sandbox_state(ids[1], State.RUNNING)
    await store.set_sandbox_state(ids[1], State.SUSPENDING)
    await store.set_sandbox_state(ids[1], State.SUSPENDED)  # still the tenant's: counts
    await store.set_sandbox_state(ids[2], State.FAILED)  # still there until deleted: counts
    await store.set_sandbox_state(ids[3], State.TERMINATING)  # being deleted: free
    usage = await store.quota_usage("acme")
    assert (usage.sandboxes, usage.cpu, usage.memory_mb) == (3, 3.5, 1792)
    await store.set_sandbox_state(ids[3], State.TERMINATED)
    assert (await store.quota_usage("acme")).sandboxes == 3


async def test_storage_usage_is_the_stored_snapshots(store: Store) -> None:
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    mib = 1024 * 1024
    for status, size in (("ready", 3 * mib), ("creating", mib), ("creating", None), ("failed", 50 * mib),
                         ("deleted", 70 * mib)):
        await store.create_snapshot(new_snapshot(sb.id, status=status, size_bytes=size))
    await store.create_snapshot(new_snapshot(sb.id, "globex", status="ready", size_bytes=9 * mib))
    assert (await store.quota_usage("acme")).storage_mb == 4.0


async def test_the_create_past_a_limit_is_refused_with_details(store: Store) -> None:
    await store.put_quota("acme", {"sandboxes": 2})
    for _ in range(2):
        await store.create_sandbox(new_sandbox(), new_op())
    for key in (None, "with-key"):  # the SQLite fast path and the transactional one
        with pytest.raises(QuotaExceeded) as info:
            await store.create_sandbox(new_sandbox(), new_op(key=key))
        assert info.value.details == {"resource": "sandboxes", "limit": 2, "in_use": 2, "requested": 1}
        assert info.value.status == 429 and info.value.code == "quota_exceeded"
    assert len(await store.list_sandboxes("acme")) == 2
    # another tenant is not limited by acme's quota
    await store.create_sandbox(new_sandbox("globex"), new_op("globex"))


async def test_cpu_and_memory_limits(store: Store) -> None:
    await store.put_quota("acme", {"cpu": 2.5, "memory_mb": 1024})
    await store.create_sandbox(new_sandbox(cpu=2.0, memory_mb=256), new_op())
    with pytest.raises(QuotaExceeded) as info:
        await store.create_sandbox(new_sandbox(cpu=1.0, memory_mb=256), new_op())
    assert info.value.details == {"resource": "cpu", "limit": 2.5, "in_use": 2, "requested": 1}
    with pytest.raises(QuotaExceeded) as info:
        await store.create_sandbox(new_sandbox(cpu=0.5, memory_mb=1024), new_op(key="k"))
    assert info.value.details == {"resource": "memory_mb", "limit": 1024, "in_use": 256, "requested": 1024}
    await store.create_sandbox(new_sandbox(cpu=0.5, memory_mb=768), new_op())  # exactly at both limits
    usage = await store.quota_usage("acme")
    assert (usage.cpu, usage.memory_mb) == (2.5, 1024)


async def test_an_idempotent_retry_at_the_limit_is_answered(store: Store) -> None:
    await store.put_quota("acme", {"sandboxes": 1})
    sb, op, created = await store.create_sandbox(new_sandbox(), new_op(key="once"))
    again, op2, created2 = await store.create_sandbox(new_sandbox(), new_op(key="once"))
    assert (created, created2, again.id, op2.id) == (True, False, sb.id, op.id)


async def test_a_delete_frees_the_quota(store: Store) -> None:
    await store.put_quota("acme", {"sandboxes": 1, "memory_mb": 512})
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    with pytest.raises(QuotaExceeded):
        await store.create_sandbox(new_sandbox(), new_op())
    await store.set_sandbox_state(sb.id, State.TERMINATING)
    await store.create_sandbox(new_sandbox(), new_op())


async def test_lowering_a_limit_below_usage_refuses_new_creates_only(store: Store) -> None:
    for _ in range(3):
        await store.create_sandbox(new_sandbox(), new_op())
    await store.put_quota("acme", {"sandboxes": 1})
    assert len(await store.list_sandboxes("acme")) == 3
    with pytest.raises(QuotaExceeded) as info:
        await store.check_quota("acme", QuotaDemand(sandboxes=1, cpu=1.0, memory_mb=512))
    assert info.value.details["in_use"] == 3


async def test_concurrent_creates_at_the_limit_admit_exactly_the_limit(store: Store) -> None:
    await store.put_quota("acme", {"sandboxes": 3})
    outcomes: list[str] = []

    async def create(i: int) -> None:
        try:
            # Half with idempotency keys: both write paths race each other.
            await store.create_sandbox(new_sandbox(), new_op(key=f"k{i}" if i % 2 else None))
            outcomes.append("ok")
        except QuotaExceeded:
            outcomes.append("refused")

    async with anyio.create_task_group() as tg:
        for i in range(12):
            tg.start_soon(create, i)
    assert sorted(outcomes) == ["ok"] * 3 + ["refused"] * 9
    assert len(await store.list_sandboxes("acme")) == 3


async def test_two_replicas_racing_at_the_limit_admit_exactly_the_limit(store: Store) -> None:
    """Two Store objects on one database, each on its own event loop and thread, are two API
    replicas: nothing in Python serializes them."""
    await store.put_quota("acme", {"sandboxes": 4, "cpu": 100.0})
    ok: list[int] = []

    async def create(st: Store, i: int) -> None:
        try:
            await st.create_sandbox(new_sandbox(), new_op(key=f"r{i}" if i % 3 == 0 else None))
            ok.append(i)
        except QuotaExceeded:
            pass

    async def other_replica() -> None:
        other = await Store.open(store.url)
        try:
            async with anyio.create_task_group() as tg:
                for i in range(0, 16, 2):
                    tg.start_soon(create, other, i)
        finally:
            await other.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, asyncio.run, other_replica())
        for i in range(1, 16, 2):
            tg.start_soon(create, store, i)
    assert len(ok) == 4
    assert (await store.quota_usage("acme")).sandboxes == 4


async def test_a_fork_asks_for_all_its_sandboxes_at_once(store: Store) -> None:
    await store.put_quota("acme", {"sandboxes": 3})
    src, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    forks = [new_sandbox(parent_id=src.id) for _ in range(3)]
    with pytest.raises(QuotaExceeded) as info:
        await store.create_sandboxes(forks, new_op(kind="sandbox.fork", target=src.id))
    assert info.value.details == {"resource": "sandboxes", "limit": 3, "in_use": 1, "requested": 3}
    rows, _, created = await store.create_sandboxes(forks[:2], new_op(kind="sandbox.fork", target=src.id))
    assert created and len(rows) == 2
    assert (await store.quota_usage("acme")).sandboxes == 3


async def test_storage_is_checked_for_snapshots_a_client_asks_for(store: Store) -> None:
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    await store.set_sandbox_state(sb.id, State.RUNNING)
    await store.create_snapshot(new_snapshot(sb.id, status="ready", size_bytes=2 * 1024 * 1024))
    await store.put_quota("acme", {"storage_mb": 2})
    manual = new_snapshot(sb.id, kind="disk", origin="manual")
    with pytest.raises(QuotaExceeded) as info:
        await store.start_operation(new_op(kind="snapshot.create", target=sb.id), snapshot=manual)
    assert info.value.details == {"resource": "storage_mb", "limit": 2, "in_use": 2.0, "requested": 0}
    fork_snap = new_snapshot(sb.id, kind="full", origin="fork")
    with pytest.raises(QuotaExceeded):
        await store.create_sandboxes([new_sandbox(parent_id=sb.id)], new_op(kind="sandbox.fork", target=sb.id),
                                     fork_snap)
    # A suspend frees compute: storage never refuses it.
    suspend = new_snapshot(sb.id, kind="full", origin="suspend")
    _, _, created = await store.start_operation(new_op(kind="sandbox.suspend", target=sb.id),
                                                move_to=State.SUSPENDING, snapshot=suspend)
    assert created
    await store.put_quota("acme", {"storage_mb": 100})
    await store.start_operation(new_op(kind="snapshot.create", target=sb.id),
                                snapshot=new_snapshot(sb.id, origin="manual"))
