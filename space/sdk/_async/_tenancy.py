"""Tenancy: a tenant's quota, egress default and backup interval, and the audit trail."""

from __future__ import annotations

import builtins
import enum
from collections.abc import AsyncIterator
from urllib.parse import quote

from space.sdk._models import JSON

from ._http import AsyncHTTP


class Unset(enum.Enum):
    """The default of a limit ``quotas.set()`` leaves as it is (``None`` clears a limit)."""

    UNSET = "unset"


UNSET = Unset.UNSET


class AsyncQuotas:
    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def get(self, tenant: str | None = None) -> JSON:
        """``{"tenant", "limits", "source", "usage", "updated_at"}`` of ``tenant`` (default: the
        key's own). ``limits`` and ``usage`` have ``sandboxes``, ``cpu``, ``memory_mb``,
        ``storage_mb`` (``limits`` also ``disk_mb``, the largest disk limit of one sandbox); a
        ``None`` limit is unlimited; ``source`` is ``default`` while the tenant has the defaults."""
        if tenant is None:
            return await self._http.json("GET", "/v1/quota")
        return await self._http.json("GET", f"/v1/tenants/{quote(tenant, safe='')}/quota")

    async def set(
        self,
        tenant: str,
        *,
        sandboxes: int | Unset | None = UNSET,
        cpu: float | Unset | None = UNSET,
        memory_mb: int | Unset | None = UNSET,
        storage_mb: int | Unset | None = UNSET,
        disk_mb: int | Unset | None = UNSET,
    ) -> JSON:
        """Change the limits given (``None``: unlimited); the others stay. Operator keys only."""
        given = {"sandboxes": sandboxes, "cpu": cpu, "memory_mb": memory_mb, "storage_mb": storage_mb,
                 "disk_mb": disk_mb}
        body = {k: v for k, v in given.items() if v is not UNSET}
        return await self._http.json("PUT", f"/v1/tenants/{quote(tenant, safe='')}/quota", json=body)

    async def get_defaults(self) -> JSON:
        """``{"limits", "updated_at"}``: the limits of every tenant whose own were never set."""
        return await self._http.json("GET", "/v1/quota/defaults")

    async def set_defaults(
        self,
        *,
        sandboxes: int | Unset | None = UNSET,
        cpu: float | Unset | None = UNSET,
        memory_mb: int | Unset | None = UNSET,
        storage_mb: int | Unset | None = UNSET,
        disk_mb: int | Unset | None = UNSET,
    ) -> JSON:
        """Change the default limits given (``None``: unlimited); the others stay. Operator keys only."""
        given = {"sandboxes": sandboxes, "cpu": cpu, "memory_mb": memory_mb, "storage_mb": storage_mb,
                 "disk_mb": disk_mb}
        body = {k: v for k, v in given.items() if v is not UNSET}
        return await self._http.json("PUT", "/v1/quota/defaults", json=body)

    async def get_egress(self, tenant: str) -> JSON:
        """The tenant's default egress policy document (``{}``: none)."""
        body = await self._http.json("GET", f"/v1/tenants/{quote(tenant, safe='')}/egress")
        return dict(body.get("egress") or {})

    async def set_egress(self, tenant: str, policy: JSON) -> JSON:
        """Replace the tenant's default egress policy (``{"allow": [...], "deny": [...], "default"}``);
        returns it normalized."""
        body = await self._http.json("PUT", f"/v1/tenants/{quote(tenant, safe='')}/egress", json=policy)
        return dict(body.get("egress") or {})

    async def get_backup(self, tenant: str) -> JSON:
        """``{"tenant", "every", "source"}``: the tenant's continuous-backup interval in seconds
        (``0``: off; ``None`` with ``source`` ``default``: the deployment's default)."""
        return await self._http.json("GET", f"/v1/tenants/{quote(tenant, safe='')}/backup")

    async def set_backup(self, tenant: str, every: float | str | None) -> JSON:
        """Back the tenant's sandboxes up every ``every`` (seconds or ``"45s"``, ``"2m"``; ``0`` or
        ``"off"``: not at all; ``None``: the deployment's default). A sandbox's own policy
        (``snapshot_policy.backup_every``) still wins. Operator or the tenant's admin keys."""
        return await self._http.json("PUT", f"/v1/tenants/{quote(tenant, safe='')}/backup", json={"every": every})

    async def get_key(self, tenant: str) -> JSON:
        """``{"tenant", "provider", "key_id", "source", "encryption"}``: the key the tenant's
        snapshots and backups in object storage are sealed under (``source`` ``default``: the
        deployment's)."""
        return await self._http.json("GET", f"/v1/tenants/{quote(tenant, safe='')}/key")

    async def set_key(self, tenant: str, provider: str | None, key_id: str | None = None) -> JSON:
        """Seal the tenant's snapshots and backups under ``provider``'s key ``key_id`` from now on
        (``"aws-kms"`` and an ARN, or ``"local"``; ``None``: the deployment's), and re-wrap what it
        stored before: the answer's ``operation`` (``tenant.rewrap``, its progress the count).
        Operator or the tenant's admin keys."""
        return await self._http.json("PUT", f"/v1/tenants/{quote(tenant, safe='')}/key",
                                     json={"provider": provider, "key_id": key_id})


class AsyncAudit:
    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def list(
        self,
        *,
        after: int = 0,
        action: str | None = None,
        target: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
    ) -> builtins.list[JSON]:
        """Records with ``id > after``, oldest first (``action`` ending in ``.`` is a prefix).
        Admin keys: a tenant's own records; the operator's, every tenant's unless ``tenant``."""
        params: dict[str, str | int] = {"after": after, "limit": limit}
        for key, value in (("action", action), ("target", target), ("tenant", tenant)):
            if value is not None:
                params[key] = value
        body = await self._http.json("GET", "/v1/audit", params=params)
        return list(body.get("records", []))

    async def iter(
        self,
        *,
        after: int = 0,
        action: str | None = None,
        target: str | None = None,
        tenant: str | None = None,
        page: int = 500,
    ) -> AsyncIterator[JSON]:
        """Every matching record after ``after``, fetched ``page`` at a time."""
        while True:
            records = await self.list(after=after, action=action, target=target, tenant=tenant, limit=page)
            for rec in records:
                yield rec
            if len(records) < page:
                return
            after = int(records[-1]["id"])
