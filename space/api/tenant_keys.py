"""/v1/tenants/{tenant}/key: the key-encryption key a tenant's snapshots and backups in object
storage are sealed under (bring your own key).

A tenant without a key of its own uses the deployment's (the local keyring's key named after
it). Setting a key (the operator, or the tenant's own admin; audited as ``key.set``) seals what is
stored from then on under it, and queues ``tenant.rewrap``: the data keys of what was stored before
are re-wrapped under the new key, nothing re-encrypted (its progress on the operation). The old key
must stay usable until that operation succeeds.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from space.api import views
from space.api.auth import Principal, principal
from space.api.state import AppState, app_state
from space.api.tenants import Tenant, _require_read
from space.controller.rotation import start_rewrap
from space.controller.sealing import deployment_key
from space.errors import InvalidRequest, Unavailable
from space.kms import AWS_KMS, LOCAL, KeyRef

router = APIRouter(prefix="/v1")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]


class KeyBody(BaseModel):
    """``{"provider": "aws-kms", "key_id": "arn:aws:kms:…"}``; ``{"provider": null}``: the deployment's."""

    model_config = ConfigDict(extra="forbid")
    provider: Literal["aws-kms", "local"] | None
    key_id: str | None = Field(None, min_length=1, max_length=2048)


async def key_view(st: AppState, tenant: str) -> dict[str, Any]:
    own = await st.store.tenant_key(tenant)
    ref = KeyRef(*own) if own is not None else deployment_key(tenant)
    return {"tenant": tenant, "provider": ref.provider, "key_id": ref.key_id,
            "source": "tenant" if own is not None else "default",
            "encryption": st.controller.lifecycle.sealer.enabled}


async def check_key(st: AppState, tenant: str, ref: KeyRef) -> None:
    """A node makes a data key under ``ref`` before it is stored: a key its KMS refuses (unknown,
    disabled, no grant for the nodes' credentials) is key_unavailable now, not at the next suspend."""
    nodes = await st.nodes.ready_nodes()
    if not nodes:
        raise Unavailable("no ready node to check the key with; try again once a node has joined")
    await nodes[0].call("POST", "/v1/objects/key-check", json_body={"tenant": tenant, "key": ref.to_json()},
                        timeout=30)


@router.get("/tenants/{tenant}/key")
async def get_key(tenant: Tenant, who: Auth, st: St) -> dict[str, Any]:
    _require_read(who, tenant)
    return await key_view(st, tenant)


@router.put("/tenants/{tenant}/key", status_code=202)
async def put_key(tenant: Tenant, body: KeyBody, who: Auth, st: St) -> JSONResponse:
    """Set the tenant's key (once a node made a data key under it); what it stores from now on is
    sealed under it, and the re-wrap of what it stored before is queued (``operation``)."""
    who.require_manage(tenant)
    if body.provider is None:
        ref, own = deployment_key(tenant), None
    else:
        key_id = body.key_id if body.key_id is not None else (tenant if body.provider == LOCAL else None)
        if key_id is None:
            raise InvalidRequest(f"a {AWS_KMS} key needs its key_id (the key's ARN or id)", field="key_id")
        ref = KeyRef(body.provider, key_id)
        own = (ref.provider, ref.key_id)
    await check_key(st, tenant, ref)
    await st.store.set_tenant_key(tenant, *(own or (None, None)))
    op = await start_rewrap(st.store, tenant, ref, actor_tenant=who.tenant)
    st.controller.wake()
    return JSONResponse({**await key_view(st, tenant), "operation": views.operation(op)}, status_code=202)
