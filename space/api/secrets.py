"""/v1/secrets: credentials the egress gateway injects; values go in and never come out."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from space.api.auth import Principal, principal
from space.api.egress import push as push_egress
from space.api.fields import Int64
from space.api.state import AppState, app_state
from space.credentials import CredentialManager
from space.errors import SpaceError, Unavailable
from space.lifecycle import State

log = structlog.get_logger("space.api.secrets")

router = APIRouter(prefix="/v1/secrets")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]


class SetSecret(BaseModel):
    # Types only: the manager validates (400 with the field named), so the rules live in one place.
    model_config = ConfigDict(extra="forbid")

    value: str
    hosts: list[str]
    header: str | None = None
    format: str | None = None
    scope: str | None = None
    expires_at: dt.datetime | None = None
    ttl_seconds: Int64 | None = None
    rate_limit: Int64 | None = None


def _manager(st: AppState) -> CredentialManager:
    if st.credentials is None:
        raise Unavailable("this server has no credential manager configured")
    return st.credentials


@contextlib.contextmanager
def _audited_by_manager(request: Request) -> Iterator[None]:
    """The credential manager records the call (with the scope, secret id and outcome) whether it
    succeeds or refuses: the audit middleware's generic record of it would be a second row."""
    try:
        yield
    except SpaceError:
        request.state.audited = True
        raise
    request.state.audited = True


@router.put("/{name}", responses={201: {"description": "The secret was created",
                                         "content": {"application/json": {"schema": {"type": "object"}}}}})
async def set_secret(name: str, body: SetSecret, who: Auth, st: St, request: Request) -> JSONResponse:
    with _audited_by_manager(request):
        secret, created = await _manager(st).set(
            who, name, body.value, hosts=body.hosts, header=body.header, format=body.format, scope=body.scope,
            expires_at=body.expires_at, ttl_seconds=body.ttl_seconds, rate_limit=body.rate_limit,
        )
    await _repush(st, who.tenant, name)
    return JSONResponse(secret, status_code=201 if created else 200)


@router.get("")
async def list_secrets(who: Auth, st: St, scope: Annotated[str | None, Query()] = None) -> dict[str, Any]:
    return {"secrets": await _manager(st).list(who, scope)}


@router.delete("/{name}", status_code=204)
async def delete_secret(name: str, who: Auth, st: St, request: Request,
                        scope: Annotated[str | None, Query()] = None) -> Response:
    with _audited_by_manager(request):
        await _manager(st).delete(who, name, scope)
    await _repush(st, who.tenant, name)
    return Response(status_code=204)


async def _repush(st: AppState, tenant: str, name: str) -> None:
    """A secret set, rotated or deleted reaches the gateways of the running sandboxes bound to it
    at once (their next request carries the new value, or none)."""
    for sb in await st.store.list_sandboxes(tenant=tenant, states=[State.RUNNING, State.PAUSED]):
        if name in (sb.secrets or []):
            try:
                await push_egress(st, sb, with_secrets=True)
            except SpaceError as exc:  # it gets them at its next placement; say so in the log
                log.warning("secret.repush_failed", sandbox=sb.id, secret=name, error=str(exc))
