"""/v1/apikeys (admin only)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from space.api import views
from space.api.auth import ROLES, Principal, principal
from space.api.state import AppState, app_state
from space.errors import InvalidRequest

router = APIRouter(prefix="/v1/apikeys")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]


class CreateKey(BaseModel):
    tenant: str = Field(..., min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
    role: str = "member"
    name: str = Field("", max_length=128)


@router.post("", status_code=201)
async def create_key(body: CreateKey, who: Auth, st: St) -> JSONResponse:
    who.require_admin()
    if body.role not in ROLES:
        raise InvalidRequest(f"role must be one of {', '.join(ROLES)}")
    row, key = await st.store.create_api_key(body.tenant, body.role, body.name)
    return JSONResponse({**views.apikey(row), "key": key}, status_code=201)


@router.get("")
async def list_keys(who: Auth, st: St) -> dict[str, Any]:
    who.require_admin()
    return {"apikeys": [views.apikey(k) for k in await st.store.list_api_keys()]}


@router.delete("/{key_id}", status_code=204)
async def delete_key(key_id: str, who: Auth, st: St) -> Response:
    who.require_admin()
    await st.store.revoke_api_key(key_id)
    st.keys.clear()
    return Response(status_code=204)
