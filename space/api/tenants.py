"""/v1/quota and /v1/tenants/{tenant}/{quota,egress}: a tenant's limits, usage and egress default.

Who may do what (see docs/api.md, "Tenants, quotas and audit"): any key reads its own tenant's
quota and egress default; only the operator (an admin key of the operator tenant) sets quotas or
reads another tenant's; the egress default is set by the operator or the tenant's own admin.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path
from pydantic import BaseModel, ConfigDict, Field

from space.api.auth import Principal, principal
from space.api.fields import Int64, Number
from space.api.state import AppState, app_state
from space.controller.egress import forget_tenant_default
from space.errors import Forbidden
from space.gateway import policy
from space.store.models import TenantQuota
from space.store.quotas import limits_of

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


async def quota_view(st: AppState, tenant: str, row: TenantQuota | None) -> dict[str, Any]:
    usage = await st.store.quota_usage(tenant)
    return {
        "tenant": tenant,
        "limits": limits_of(row),
        "usage": usage.to_dict(),
        "updated_at": row.updated_at.isoformat() if row is not None and row.updated_at else None,
    }


def _require_read(who: Principal, tenant: str) -> None:
    if not who.can_read_tenant(tenant):
        raise Forbidden(f"a key of tenant {who.tenant!r} cannot read tenant {tenant!r}", tenant=tenant)


@router.get("/quota")
async def own_quota(who: Auth, st: St) -> dict[str, Any]:
    return await quota_view(st, who.tenant, await st.store.get_quota(who.tenant))


@router.get("/tenants/{tenant}/quota")
async def get_quota(tenant: Tenant, who: Auth, st: St) -> dict[str, Any]:
    _require_read(who, tenant)
    return await quota_view(st, tenant, await st.store.get_quota(tenant))


@router.put("/tenants/{tenant}/quota")
async def put_quota(tenant: Tenant, body: QuotaBody, who: Auth, st: St) -> dict[str, Any]:
    who.require_operator()
    limits = {name: getattr(body, name) for name in body.model_fields_set}
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
    row = await st.store.set_tenant_egress(tenant, policy.validate(doc))
    forget_tenant_default(tenant)  # this replica's next placement uses it at once
    return {"tenant": tenant, "egress": row.egress or {}}
