"""Per-tenant quotas: what counts against a limit, and the test a create must pass.

A tenant's limits are its ``tenant_quotas`` row once the operator set them (``quota_set``); a
tenant whose limits were never set gets the defaults, the row of tenant :data:`DEFAULTS` (``space
serve --default-quota``, ``PUT /v1/quota/defaults``). A NULL column is unlimited, and so is every
limit of a tenant that has none set while no defaults exist.

What is counted (the same on every path and dialect):

- ``sandboxes``, ``cpu``, ``memory_mb``: the tenant's sandboxes from their create until their
  delete is accepted, i.e. in every state but ``terminating`` and ``terminated``. A suspended
  sandbox counts (a restore puts it back on a node without asking again), and so does a failed one
  (it is the tenant's to delete). ``cpu`` and ``memory_mb`` are the sums of their sizes.
- ``disk_mb``: not a sum but a ceiling: the largest disk limit one of the tenant's sandboxes may be
  created with (a sandbox's disk limit is what its root may write; see docs/notes/quotas.md).
- ``storage_mb``: the sizes of the tenant's snapshots that exist (``creating`` or ``ready``), in
  MiB; a snapshot whose size is not measured yet counts 0 until it is. Only snapshots a client asks
  for (``manual``, and the one a fork takes) are refused when the tenant is at its limit: a suspend,
  a scheduled snapshot or a crash recovery is never refused for storage, but counts.

The check runs inside the write transaction that inserts the rows, after the idempotency lookup (a
retried create is answered, not refused). On PostgreSQL it locks the tenant's quota row
(``FOR UPDATE``), so two creates of one tenant are serialized only when it has limits; SQLite writers
are serialized anyway (``BEGIN IMMEDIATE``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import BindParameter, Select, String, bindparam, func, or_, select

from space.errors import QuotaExceeded
from space.lifecycle import State
from space.store.models import Sandbox, Snapshot, TenantQuota

#: Limit columns summed over the tenant's sandboxes and snapshots, in the order they are checked.
RESOURCES = ("sandboxes", "cpu", "memory_mb", "storage_mb")
#: Every limit a tenant's row (or the defaults) holds: the sums, and the per-sandbox disk ceiling.
LIMIT_FIELDS = (*RESOURCES, "disk_mb")
#: The ``tenant_quotas`` row of the defaults: a name no tenant can have (tenant names start with a
#: letter or a digit).
DEFAULTS = "*"
#: A sandbox without a disk limit of its own asks for this much (more than any ceiling).
UNBOUNDED_DISK = 1 << 62
#: Sandbox states that no longer count.
RELEASED = (State.TERMINATING, State.TERMINATED)
#: Snapshot statuses that count towards storage.
STORED = ("creating", "ready")
#: Snapshot origins refused when the tenant's storage is used up.
STORAGE_CHECKED_ORIGINS = frozenset({"manual", "fork"})

MIB = 1024 * 1024
_EPSILON = 1e-9  # CPU sizes are floats: 0.1 + 0.2 must fit a limit of 0.3


@dataclasses.dataclass(frozen=True)
class QuotaDemand:
    """What a write adds: sandboxes and their sizes, and whether it takes a snapshot."""

    sandboxes: int = 0
    cpu: float = 0.0
    memory_mb: int = 0
    storage: bool = False
    #: The largest disk limit among the sandboxes (MiB).
    disk_mb: int = 0

    @classmethod
    def of(cls, sandboxes: Iterable[Sandbox], *, storage: bool = False) -> QuotaDemand:
        rows = list(sandboxes)
        return cls(sandboxes=len(rows), cpu=sum(float(r.cpu) for r in rows),
                   memory_mb=sum(int(r.memory_mb) for r in rows), storage=storage,
                   disk_mb=max((UNBOUNDED_DISK if r.disk_mb is None else int(r.disk_mb) for r in rows), default=0))

    @property
    def empty(self) -> bool:
        return not (self.sandboxes or self.cpu or self.memory_mb or self.storage)


@dataclasses.dataclass(frozen=True)
class QuotaUsage:
    sandboxes: int = 0
    cpu: float = 0.0
    memory_mb: int = 0
    storage_mb: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"sandboxes": self.sandboxes, "cpu": round(self.cpu, 3), "memory_mb": self.memory_mb,
                "storage_mb": round(self.storage_mb, 2)}


class Limits(NamedTuple):
    """A tenant's limits (None: unlimited)."""

    sandboxes: int | None
    cpu: float | None
    memory_mb: int | None
    storage_mb: int | None
    disk_mb: int | None = None

    @classmethod
    def of(cls, row: TenantQuota | Any | None) -> Limits | None:
        """From a TenantQuota row (None stays None)."""
        if row is None:
            return None
        return cls(*(getattr(row, name) for name in LIMIT_FIELDS))

    def to_dict(self) -> dict[str, Any]:
        return dict(self._asdict())


def effective(rows: Iterable[Sequence[Any]], tenant: str) -> tuple[Limits | None, str]:
    """The limits that hold for ``tenant`` from result rows of :data:`LIMITS` (its own row and the
    defaults' row, either may be missing) and where they come from: ``tenant`` (set for it),
    ``default``, or ``none`` (nothing set anywhere: unlimited)."""
    own = default = None
    for row in rows:
        if row[0] == tenant:
            own = row
        elif row[0] == DEFAULTS:
            default = row
    if own is not None and own[1]:
        return Limits(*own[2:]), "tenant"
    if default is not None:
        return Limits(*default[2:]), "default"
    return None, "none"


def limits_of(limits: Limits | None) -> dict[str, Any]:
    return dict.fromkeys(LIMIT_FIELDS) if limits is None else limits.to_dict()


def relevant(limits: Limits | None, demand: QuotaDemand) -> bool:
    """Whether ``demand`` touches a limit that is set (else there is nothing to count)."""
    if limits is None or demand.empty:
        return False
    if demand.sandboxes and (limits.sandboxes is not None or limits.cpu is not None
                             or limits.memory_mb is not None or limits.disk_mb is not None):
        return True
    return demand.storage and limits.storage_mb is not None


# Built once: these run inside the insert transaction of every create.
_TENANT: BindParameter[str] = bindparam("tenant", type_=String())
#: The tenant's own row and the defaults' row (:func:`effective` picks).
LIMITS: Select[str, bool, int | None, float | None, int | None, int | None, int | None] = select(
    TenantQuota.tenant, TenantQuota.quota_set, TenantQuota.sandboxes, TenantQuota.cpu, TenantQuota.memory_mb,
    TenantQuota.storage_mb, TenantQuota.disk_mb,
).where(or_(TenantQuota.tenant == _TENANT, TenantQuota.tenant == DEFAULTS))
#: Locks the tenant's own row (PostgreSQL), so that two creates of one tenant are serialized;
#: the defaults' row is never locked (creates of different tenants stay parallel).
OWN_LOCKED: Select[str] = select(TenantQuota.tenant).where(TenantQuota.tenant == _TENANT).with_for_update()
SANDBOX_USAGE: Select[int, float, int] = select(
    func.count(Sandbox.id), func.coalesce(func.sum(Sandbox.cpu), 0.0), func.coalesce(func.sum(Sandbox.memory_mb), 0),
).where(Sandbox.tenant == _TENANT, Sandbox.state.not_in(list(RELEASED)))
STORAGE_USAGE: Select[int | None] = select(func.coalesce(func.sum(Snapshot.size_bytes), 0)).where(
    Snapshot.tenant == _TENANT, Snapshot.status.in_(list(STORED))
)

# The same three for the synchronous SQLite writer on the create hot path, as driver SQL: ~25 µs a
# lookup against ~130 µs through the ORM. tests/store/test_store_quotas.py runs every enforcement
# test on both paths.
SQLITE_LIMITS = ("SELECT tenant, quota_set, sandboxes, cpu, memory_mb, storage_mb, disk_mb FROM tenant_quotas "
                 f"WHERE tenant IN (?, '{DEFAULTS}')")
SQLITE_SANDBOX_USAGE = (
    "SELECT count(id), coalesce(sum(cpu), 0.0), coalesce(sum(memory_mb), 0) FROM sandboxes "
    f"WHERE tenant = ? AND state NOT IN ({', '.join(repr(st.value) for st in RELEASED)})"
)
SQLITE_STORAGE_USAGE = (
    "SELECT coalesce(sum(size_bytes), 0) FROM snapshots "
    f"WHERE tenant = ? AND status IN ({', '.join(repr(st) for st in STORED)})"
)


def usage_from(sandbox_row: Any, storage_bytes: Any) -> QuotaUsage:
    count, cpu, memory = sandbox_row if sandbox_row is not None else (0, 0.0, 0)
    return QuotaUsage(sandboxes=int(count or 0), cpu=float(cpu or 0.0), memory_mb=int(memory or 0),
                      storage_mb=int(storage_bytes or 0) / MIB)


def enforce(tenant: str, row: Limits, usage: QuotaUsage, demand: QuotaDemand) -> None:
    """Raise QuotaExceeded naming the first limit ``demand`` would pass."""
    if demand.sandboxes and row.disk_mb is not None and demand.disk_mb > row.disk_mb:
        asked = "no disk limit" if demand.disk_mb >= UNBOUNDED_DISK else f"a disk limit of {demand.disk_mb} MiB"
        raise QuotaExceeded(
            f"tenant {tenant!r} may not have a sandbox with {asked}: its sandboxes' disk limit is at most "
            f"{row.disk_mb} MiB", resource="disk_mb", limit=row.disk_mb, in_use=0,
            requested=demand.disk_mb if demand.disk_mb < UNBOUNDED_DISK else None,
        )
    wants: list[tuple[str, float, float]] = []
    if demand.sandboxes:
        wants += [("sandboxes", usage.sandboxes, demand.sandboxes), ("cpu", usage.cpu, demand.cpu),
                  ("memory_mb", usage.memory_mb, demand.memory_mb)]
    for resource, in_use, requested in wants:
        limit = getattr(row, resource)
        if limit is not None and in_use + requested > limit + _EPSILON:
            raise QuotaExceeded(
                f"tenant {tenant!r} would exceed its {resource} quota: {_num(in_use)} in use + "
                f"{_num(requested)} requested > limit {_num(limit)}",
                resource=resource, limit=limit, in_use=_num(in_use), requested=_num(requested),
            )
    if demand.storage and row.storage_mb is not None and usage.storage_mb >= row.storage_mb:
        raise QuotaExceeded(
            f"tenant {tenant!r} has used up its storage quota: {usage.storage_mb:.1f} MiB of snapshots "
            f"stored, limit {row.storage_mb} MiB; delete snapshots or sandboxes first",
            resource="storage_mb", limit=row.storage_mb, in_use=round(usage.storage_mb, 2), requested=0,
        )


def _num(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(float(value), 3)
