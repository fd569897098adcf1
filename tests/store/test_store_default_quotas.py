"""Default quotas and the per-sandbox disk ceiling in the store (SQLite and PostgreSQL).

- defaults: a tenant whose limits were never set gets the row of ``quotas.DEFAULTS``; an egress
  default alone does not set them; once the operator sets any limit the tenant has its own (the
  others unlimited), the defaults no longer apply; seed_quota sets limits only where none were set
- enforcement: the defaults hold on the SQLite fast path, the transactional path (an idempotency
  key) and for forks (create_sandboxes), also for concurrent creates of a tenant on the defaults
- disk_mb: a sandbox whose disk limit is above its tenant's ceiling, or that has none, is refused
  (429 ``quota_exceeded``, resource ``disk_mb``)
"""

from __future__ import annotations

import asyncio

import pytest

from space.errors import QuotaExceeded
from space.store import Store
from space.store.quotas import DEFAULTS, QuotaDemand
from tests.store.storekit import new_op, new_sandbox

pytestmark = pytest.mark.anyio


async def test_a_tenant_without_limits_gets_the_defaults(store: Store) -> None:
    assert await store.effective_quota("acme") == (None, "none")
    await store.put_quota(DEFAULTS, {"sandboxes": 2, "disk_mb": 1024})
    limits, source = await store.effective_quota("acme")
    assert source == "default" and limits is not None
    assert (limits.sandboxes, limits.cpu, limits.disk_mb) == (2, None, 1024)
    await store.set_tenant_egress("acme", {"default": "deny"})  # not a quota
    assert (await store.effective_quota("acme"))[1] == "default"
    for _ in range(2):
        await store.create_sandbox(new_sandbox(disk_mb=512), new_op())
    with pytest.raises(QuotaExceeded) as exc:
        await store.create_sandbox(new_sandbox(disk_mb=512), new_op())
    assert exc.value.details["resource"] == "sandboxes" and exc.value.details["limit"] == 2
    with pytest.raises(QuotaExceeded):  # the transactional path too
        await store.create_sandbox(new_sandbox(disk_mb=512), new_op(key="k1"))
    with pytest.raises(QuotaExceeded):
        await store.check_quota("acme", QuotaDemand(sandboxes=1, cpu=1.0, memory_mb=512, disk_mb=512))
    # Limits of its own (here: one, the others unlimited) replace the defaults entirely.
    await store.put_quota("acme", {"sandboxes": 5})
    limits, source = await store.effective_quota("acme")
    assert source == "tenant" and limits is not None and (limits.sandboxes, limits.disk_mb) == (5, None)
    await store.create_sandbox(new_sandbox(disk_mb=None), new_op())
    # The defaults still hold for every other tenant, and forks ask for all their sandboxes.
    await store.create_sandbox(new_sandbox("globex", disk_mb=64), new_op("globex"))
    with pytest.raises(QuotaExceeded):
        await store.create_sandboxes([new_sandbox("globex", disk_mb=64), new_sandbox("globex", disk_mb=64)],
                                     new_op("globex", kind="sandbox.fork"))


async def test_the_disk_ceiling(store: Store) -> None:
    await store.put_quota("acme", {"disk_mb": 1000})
    await store.create_sandbox(new_sandbox(disk_mb=1000), new_op())
    for disk in (1001, None):  # above the ceiling, or no limit at all
        with pytest.raises(QuotaExceeded) as exc:
            await store.create_sandbox(new_sandbox(disk_mb=disk), new_op())
        assert exc.value.details["resource"] == "disk_mb" and exc.value.details["limit"] == 1000
        with pytest.raises(QuotaExceeded):
            await store.create_sandbox(new_sandbox(disk_mb=disk), new_op(key=f"disk-{disk}"))


async def test_seed_sets_only_unset_limits(store: Store) -> None:
    assert await store.seed_quota(DEFAULTS, {"sandboxes": 3})
    assert not await store.seed_quota(DEFAULTS, {"sandboxes": 9})
    assert (await store.effective_quota("anyone"))[0].sandboxes == 3  # type: ignore[union-attr]
    await store.set_tenant_egress("ops", {"default": "deny"})
    assert await store.seed_quota("ops", {})  # an egress row is not a quota: now explicitly unlimited
    assert await store.effective_quota("ops") == ((None, None, None, None, None), "tenant")
    await store.create_sandbox(new_sandbox("ops"), new_op("ops"))
    await store.create_sandbox(new_sandbox("ops"), new_op("ops"))


async def test_concurrent_creates_on_the_defaults_admit_the_limit(store: Store) -> None:
    await store.put_quota(DEFAULTS, {"sandboxes": 3})

    async def one(i: int) -> bool:
        try:
            await store.create_sandbox(new_sandbox("burst", disk_mb=64), new_op("burst", key=f"burst-{i}"))
        except QuotaExceeded:
            return False
        return True

    results = await asyncio.gather(*(one(i) for i in range(8)))
    assert sum(results) == 3
    assert (await store.quota_usage("burst")).sandboxes == 3
