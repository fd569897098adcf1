"""/v1/quota, /v1/quota/defaults and /v1/tenants/{tenant}/{quota,egress,egress-ceiling,backup}: a
tenant's limits, usage, egress default, egress ceiling and continuous-backup interval, and the
default limits of every tenant whose own were never set.

Who may do what (see docs/api.md, "Tenants, quotas and audit"): any key reads its own tenant's
quota, egress default and ceiling, and the defaults; only the operator (an admin key of the operator
tenant) sets quotas, defaults and ceilings or reads another tenant's; the egress default is set by
the operator or the tenant's own admin, inside the tenant's ceiling; so is the backup interval.
"""

from __future__ import annotations

from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Body, Depends, Path
from pydantic import BaseModel, ConfigDict, Field

from space import egress_policy, retention
from space.api.auth import Principal, principal
from space.api.egress import ON_NODE, ceiling_for, checked_policy, push
from space.api.fields import Int64, Number
from space.api.state import AppState, app_state
from space.controller.egress import forget_tenant_default
from space.errors import Forbidden, InvalidRequest, SpaceError
from space.store.models import TenantQuota
from space.store.quotas import DEFAULTS, limits_of

log = structlog.get_logger("space.api.tenants")

router = APIRouter(prefix="/v1")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]
Tenant = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")]


class QuotaBody(BaseModel):
    """Limits to change; a field left out stays as it is, ``null`` makes it unlimited."""

    model_config = ConfigDict(extra="forbid")  # a misspelt limit must not pass as "no change"
    sandboxes: Annotated[Int64, Field(ge=0)] | None = None
    cpu: Number | None = Field(None, ge=0)
    memory_mb: Annotated[Int64, Field(ge=0)] | None = None
    storage_mb: Annotated[Int64, Field(ge=0)] | None = None
    #: The largest disk limit one of its sandboxes may have.
    disk_mb: Annotated[Int64, Field(ge=0)] | None = None


async def quota_view(st: AppState, tenant: str, row: TenantQuota | None) -> dict[str, Any]:
    usage = await st.store.quota_usage(tenant)
    limits, source = await st.store.effective_quota(tenant)
    return {
        "tenant": tenant,
        "limits": limits_of(limits),
        #: ``tenant``: set for it; ``default``: the defaults (it never had limits of its own).
        "source": source,
        "usage": usage.to_dict(),
        "updated_at": row.updated_at.isoformat() if row is not None and row.quota_set and row.updated_at else None,
    }


def defaults_view(limits: dict[str, Any], row: TenantQuota | None) -> dict[str, Any]:
    return {"limits": limits, "updated_at": row.updated_at.isoformat() if row is not None and row.updated_at else None}


def _limits_of(body: QuotaBody) -> dict[str, Any]:
    return {name: getattr(body, name) for name in body.model_fields_set}


def _require_read(who: Principal, tenant: str) -> None:
    if not who.can_read_tenant(tenant):
        raise Forbidden(f"a key of tenant {who.tenant!r} cannot read tenant {tenant!r}", tenant=tenant)


@router.get("/quota")
async def own_quota(who: Auth, st: St) -> dict[str, Any]:
    return await quota_view(st, who.tenant, await st.store.get_quota(who.tenant))


@router.get("/quota/defaults")
async def get_defaults(who: Auth, st: St) -> dict[str, Any]:
    """The limits of every tenant whose own limits were never set."""
    row = await st.store.get_quota(DEFAULTS)
    return defaults_view(limits_of(await _defaults(st)), row)


@router.put("/quota/defaults")
async def put_defaults(body: QuotaBody, who: Auth, st: St) -> dict[str, Any]:
    """Change the defaults (operator): a field left out stays, ``null`` makes it unlimited."""
    who.require_operator()
    limits = _limits_of(body)
    row = await st.store.put_quota(DEFAULTS, limits) if limits else await st.store.get_quota(DEFAULTS)
    st.quotas.invalidate_all()
    return defaults_view(limits_of(await _defaults(st)), row)


async def _defaults(st: AppState) -> Any:
    limits, source = await st.store.effective_quota(DEFAULTS)
    return limits if source == "tenant" else None


@router.get("/tenants/{tenant}/quota")
async def get_quota(tenant: Tenant, who: Auth, st: St) -> dict[str, Any]:
    _require_read(who, tenant)
    return await quota_view(st, tenant, await st.store.get_quota(tenant))


@router.put("/tenants/{tenant}/quota")
async def put_quota(tenant: Tenant, body: QuotaBody, who: Auth, st: St) -> dict[str, Any]:
    who.require_operator()
    limits = _limits_of(body)
    row = await st.store.put_quota(tenant, limits) if limits else await st.store.get_quota(tenant)
    st.quotas.invalidate(tenant)
    return await quota_view(st, tenant, row)


@router.get("/tenants/{tenant}/egress")
async def get_egress(tenant: Tenant, who: Auth, st: St) -> dict[str, Any]:
    _require_read(who, tenant)
    row = await st.store.get_quota(tenant)
    return {"tenant": tenant, "egress": (row.egress if row is not None else None) or {}}


@router.put("/tenants/{tenant}/egress")
async def put_egress(tenant: Tenant, who: Auth, st: St,
                     doc: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Replace the tenant's default egress policy (``{}`` removes it)."""
    who.require_manage(tenant)
    row = await st.store.set_tenant_egress(tenant, await checked_policy(st, tenant, doc))
    forget_tenant_default(tenant)  # this replica's next placement uses it at once
    await push_tenant(st, tenant)
    return {"tenant": tenant, "egress": row.egress or {}}


async def push_tenant(st: AppState, tenant: str) -> None:
    """The tenant's sandboxes on nodes get their egress again: a narrowed default or ceiling bites
    at their next connection (a node that fails to hear it keeps the old one until the next push)."""
    for sb in await st.store.list_sandboxes(tenant=tenant, states=[s.value for s in ON_NODE]):
        try:
            await push(st, sb, with_secrets=False)
        except SpaceError as exc:
            log.warning("egress.push_failed", sandbox=sb.id, tenant=tenant, error=str(exc))


class CeilingBody(BaseModel):
    """The private ranges (CIDRs) the tenant's policies may open, inside the deployment's;
    ``null``: the deployment's ceiling, ``[]``: none."""

    model_config = ConfigDict(extra="forbid")
    private: list[str] | None = Field(..., max_length=egress_policy.MAX_ENTRIES)


def ceiling_view(st: AppState, tenant: str, row: TenantQuota | None) -> dict[str, Any]:
    own = row.egress_ceiling if row is not None else None
    return {"tenant": tenant, "private": own, "effective": [str(n) for n in ceiling_for(st, own)],
            "deployment": [str(n) for n in st.egress_ceiling]}


@router.get("/tenants/{tenant}/egress-ceiling")
async def get_ceiling(tenant: Tenant, who: Auth, st: St) -> dict[str, Any]:
    _require_read(who, tenant)
    return ceiling_view(st, tenant, await st.store.get_quota(tenant))


@router.put("/tenants/{tenant}/egress-ceiling")
async def put_ceiling(tenant: Tenant, body: CeilingBody, who: Auth, st: St) -> dict[str, Any]:
    """The operator opens private ranges to a tenant (never wider than the deployment's). Policies
    that reach outside a narrowed ceiling keep their entries (the policy view lists them under
    ``limits.clipped``); the gateways stop honouring what the ceiling no longer covers at once."""
    who.require_operator()
    nets: list[str] | None = None
    if body.private is not None:
        parsed = egress_policy.parse_ceiling(body.private)
        for net in parsed:
            if not any(net.version == d.version and net.subnet_of(d) for d in st.egress_ceiling):  # type: ignore[arg-type]
                raise InvalidRequest(
                    f"{net} is outside the deployment's egress ceiling "
                    f"({egress_policy.ceiling_text(st.egress_ceiling)}; space serve --egress-private)",
                    entry=str(net), ceiling=[str(d) for d in st.egress_ceiling])
        nets = [str(n) for n in parsed]
    row = await st.store.set_tenant_ceiling(tenant, nets)
    forget_tenant_default(tenant)
    await push_tenant(st, tenant)
    return ceiling_view(st, tenant, row)


class BackupBody(BaseModel):
    """The tenant's continuous-backup interval for its sandboxes whose own policy does not say:
    seconds or a duration (``"45s"``, ``"2m"``; at least 1 s), ``0`` or ``"off"`` for no backup,
    ``null`` or ``"default"`` for the deployment's default."""

    model_config = ConfigDict(extra="forbid")
    every: Number | Annotated[str, Field(max_length=32)] | None


def backup_view(tenant: str, row: TenantQuota | None) -> dict[str, Any]:
    own = row.backup_every if row is not None else None
    return {"tenant": tenant, "every": own, "source": "default" if own is None else "tenant"}


@router.get("/tenants/{tenant}/backup")
async def get_backup(tenant: Tenant, who: Auth, st: St) -> dict[str, Any]:
    _require_read(who, tenant)
    return backup_view(tenant, await st.store.get_quota(tenant))


@router.put("/tenants/{tenant}/backup")
async def put_backup(tenant: Tenant, body: BackupBody, who: Auth, st: St) -> dict[str, Any]:
    """Set the tenant's backup interval; its nodes are told at their next heartbeat (a running
    sandbox's backup starts, retunes or stops within seconds)."""
    who.require_manage(tenant)
    row = await st.store.set_tenant_backup(tenant, retention.parse_backup_every(body.every))
    return backup_view(tenant, row)
