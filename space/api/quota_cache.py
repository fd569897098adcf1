"""An early quota test for the create path that costs no database trip for tenants without limits.

The authoritative check is inside the store's insert transaction. This one exists so that a tenant at
its limit is refused *before* a warm sandbox is claimed for it (a claim the insert then refuses would
throw the warm sandbox away: a tenant hammering creates at its limit would drain the pools of every
tenant). Limits are at most ``ttl`` seconds old when used, and read again in the background for the tenants
used lately (:class:`space.controller.fresh.Fresh`), so a tenant without limits (the common case)
pays nothing; a limit changed through another replica is seen here within ``ttl`` (the insert
enforces it at once either way).
"""

from __future__ import annotations

from space.controller.fresh import FreshPerOwner
from space.store import Store
from space.store.quotas import Limits, QuotaDemand, relevant


async def _limits(store: Store, tenant: str) -> Limits | None:
    return (await store.effective_quota(tenant))[0]


class QuotaCache:
    def __init__(self, ttl: float = 5.0, max_entries: int = 10_000) -> None:
        self._limits: FreshPerOwner[Store, str, Limits | None] = FreshPerOwner(
            "quota_limits", _limits, ttl=ttl, max_entries=max_entries)

    async def limits(self, store: Store, tenant: str) -> Limits | None:
        """The limits that hold for ``tenant`` (its own, or the defaults)."""
        return await self._limits.get(store, tenant)

    def invalidate(self, tenant: str) -> None:
        self._limits.forget(tenant)

    def invalidate_all(self) -> None:
        """The defaults changed: every tenant on them is affected."""
        self._limits.clear()

    async def precheck(self, store: Store, tenant: str, demand: QuotaDemand) -> None:
        """QuotaExceeded if ``demand`` would pass one of the tenant's limits now."""
        if relevant(await self.limits(store, tenant), demand):
            await store.check_quota(tenant, demand)
