"""An early quota test for the create path that costs no database trip for tenants without limits.

The authoritative check is inside the store's insert transaction. This one exists so that a tenant at
its limit is refused *before* a warm sandbox is claimed for it (a claim the insert then refuses would
throw the warm sandbox away: a tenant hammering creates at its limit would drain the pools of every
tenant). Limits are cached per tenant for ``ttl`` seconds, so a tenant without limits (the common
case) pays nothing; a limit changed through another replica is seen here within ``ttl`` (the insert
enforces it at once either way).
"""

from __future__ import annotations

import time

from space.store import Store
from space.store.quotas import Limits, QuotaDemand, relevant


class QuotaCache:
    def __init__(self, ttl: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._rows: dict[str, tuple[float, Limits | None]] = {}

    async def limits(self, store: Store, tenant: str) -> Limits | None:
        """The limits that hold for ``tenant`` (its own, or the defaults)."""
        hit = self._rows.get(tenant)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        row, _ = await store.effective_quota(tenant)
        if len(self._rows) >= self.max_entries:
            self._rows.clear()
        self._rows[tenant] = (time.monotonic() + self.ttl, row)
        return row

    def invalidate(self, tenant: str) -> None:
        self._rows.pop(tenant, None)

    def invalidate_all(self) -> None:
        """The defaults changed: every tenant on them is affected."""
        self._rows.clear()

    async def precheck(self, store: Store, tenant: str, demand: QuotaDemand) -> None:
        """QuotaExceeded if ``demand`` would pass one of the tenant's limits now."""
        if relevant(await self.limits(store, tenant), demand):
            await store.check_quota(tenant, demand)
