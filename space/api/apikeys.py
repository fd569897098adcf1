"""/v1/apikeys (admin keys): a tenant's admin manages its own tenant's keys; the operator (an admin
key of the operator tenant) manages every tenant's."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from space.api import views
from space.api.auth import ROLES, Principal, principal
from space.api.state import AppState, app_state
from space.errors import InvalidRequest, NotFound
from space.keyforms import e2b_spelling

router = APIRouter(prefix="/v1/apikeys")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]


class CreateKey(BaseModel):
    tenant: str = Field(..., min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
    role: str = "member"
    name: str = Field("", max_length=128)


@router.post("", status_code=201)
async def create_key(body: CreateKey, who: Auth, st: St) -> JSONResponse:
    who.require_manage(body.tenant)
    if body.role not in ROLES:
        raise InvalidRequest(f"role must be one of {', '.join(ROLES)}")
    row, key = await st.store.create_api_key(body.tenant, body.role, body.name)
    # The same key as E2B's SDKs want it spelled (space.keyforms): either authenticates.
    return JSONResponse({**views.apikey(row), "key": key, "e2b_key": e2b_spelling(key)}, status_code=201)


@router.get("")
async def list_keys(
    who: Auth, st: St, tenant: Annotated[str | None, Query(max_length=64)] = None
) -> dict[str, Any]:
    """The caller's tenant's keys; the operator's call lists every tenant's (or ``?tenant=``'s)."""
    if tenant is None:
        who.require_admin()
        scope = None if who.is_operator else who.tenant
    else:
        who.require_manage(tenant)
        scope = tenant
    return {"apikeys": [views.apikey(k) for k in await st.store.list_api_keys(scope)]}


@router.delete("/{key_id}", status_code=204)
async def delete_key(key_id: str, who: Auth, st: St) -> Response:
    who.require_admin()
    if not who.is_operator:
        # Another tenant's key is not found, like any other tenant's resource.
        own = {k.id for k in await st.store.list_api_keys(who.tenant, include_revoked=True)}
        if key_id not in own:
            raise NotFound(f"api key {key_id} not found")
    await st.store.revoke_api_key(key_id)
    st.keys.clear()
    return Response(status_code=204)
