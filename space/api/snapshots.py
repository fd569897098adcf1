"""/v1/sandboxes/{id}/snapshots and /v1/snapshots: a sandbox's snapshots, and the tenant's (retained
snapshots outlive their sandbox and are reached by id alone)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from space import ids
from space.api import views
from space.api.auth import Principal, principal
from space.api.fields import Bool
from space.api.lifecycle import enqueue_action
from space.api.state import AppState, app_state
from space.errors import Conflict, InvalidRequest, NotFound, Unavailable
from space.lifecycle import Action
from space.store import Operation, Sandbox, Snapshot, new_snapshot

router = APIRouter(prefix="/v1")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]
IdemKey = Annotated[str | None, Header(max_length=256)]


#: A snapshot's name: what E2B's SDK and people pass (``my-app``, ``team/my-app:v2``).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/@-]*$"


class SnapshotBody(BaseModel):
    #: "disk": the files, taken without pausing. "full": memory and files, consistent.
    kind: str = Field("disk", pattern="^(disk|full)$")
    #: Keep it when the sandbox is deleted: it is uploaded to object storage as it is taken.
    retain: Bool = False
    name: str | None = Field(None, min_length=1, max_length=128, pattern=NAME_PATTERN)


@router.get("/snapshots")
async def list_all_snapshots(who: Auth, st: St, sandbox_id: str | None = None, name: str | None = None,
                             retained: bool | None = None) -> dict[str, Any]:
    """The tenant's snapshots, those of deleted sandboxes included (retained ones outlive them)."""
    rows = await st.store.list_snapshots(tenant=who.tenant, sandbox_id=sandbox_id, name=name, retain=retained,
                                         statuses=["creating", "ready", "failed"])
    return {"snapshots": [views.snapshot(s) for s in rows]}


@router.get("/sandboxes/{sandbox_id}/snapshots")
async def list_snapshots(sandbox_id: str, who: Auth, st: St) -> dict[str, Any]:
    await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    rows = await st.store.list_snapshots(sandbox_id=sandbox_id, tenant=who.tenant,
                                         statuses=["creating", "ready", "failed"])
    return {"snapshots": [views.snapshot(s) for s in rows]}


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=202)
async def create_snapshot(sandbox_id: str, who: Auth, st: St, body: SnapshotBody | None = None,
                          idempotency_key: IdemKey = None) -> JSONResponse:
    body = body or SnapshotBody.model_validate({})
    sb, snap, op = await start_snapshot(st, who, sandbox_id, body.kind, retain=body.retain, name=body.name,
                                        idempotency_key=idempotency_key)
    return JSONResponse({"sandbox": views.sandbox(sb), "snapshot": views.snapshot(snap),
                         "operation": views.operation(op)}, status_code=202)


async def start_snapshot(st: AppState, who: Principal, sandbox_id: str, kind: str, *, retain: bool = False,
                         name: str | None = None,
                         idempotency_key: str | None = None) -> tuple[Sandbox, Snapshot, Operation]:
    """Record a manual snapshot of a sandbox and the operation that takes it (and, retained,
    uploads it: it is ``restorable`` only once that is done)."""
    who.require_write()
    if retain and st.controller.lifecycle.objects is None:
        raise Unavailable("a retained snapshot is kept in object storage, and this deployment has none "
                          "configured (--object-store-url)")
    sb = await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    snap = new_snapshot(sb, kind, "manual")
    snap.retain, snap.name = retain, name
    sb, op = await enqueue_action(st, who.tenant, sandbox_id, Action.SNAPSHOT, "snapshot.create",
                                  {"snapshot": snap.id, "kind": kind, "retain": retain}, idempotency_key,
                                  snapshot=snap)
    # An idempotent replay answers with the snapshot of the first request.
    snap = await st.store.get_snapshot(str(op.request["snapshot"]))
    return sb, snap, op


async def live_snapshot(st: AppState, snapshot_id: str, tenant: str) -> Snapshot:
    """A snapshot that exists (a deleted one is NotFound, like a missing one)."""
    snap = await st.store.get_snapshot(snapshot_id, tenant=tenant)
    if snap.status == "deleted":
        raise NotFound(f"snapshot {snapshot_id} was deleted" + (f" ({snap.error})" if snap.error else ""))
    return snap


@router.get("/snapshots/{snapshot_id}")
async def get_snapshot(snapshot_id: str, who: Auth, st: St) -> dict[str, Any]:
    return views.snapshot(await live_snapshot(st, snapshot_id, who.tenant))


@router.delete("/sandboxes/{sandbox_id}/snapshots/{snapshot_id}", status_code=202)
async def delete_snapshot(sandbox_id: str, snapshot_id: str, who: Auth, st: St,
                          idempotency_key: IdemKey = None) -> JSONResponse:
    who.require_write()
    snap = await live_snapshot(st, snapshot_id, who.tenant)
    if snap.sandbox_id != sandbox_id:
        raise InvalidRequest(f"snapshot {snapshot_id} belongs to sandbox {snap.sandbox_id}")
    op = await start_delete(st, who, snap, idempotency_key)
    return JSONResponse({"snapshot": views.snapshot(snap), "operation": views.operation(op)}, status_code=202)


@router.delete("/snapshots/{snapshot_id}", status_code=202)
async def delete_any_snapshot(snapshot_id: str, who: Auth, st: St, idempotency_key: IdemKey = None) -> JSONResponse:
    """Delete a snapshot by its id alone: the way to a retained snapshot whose sandbox is gone."""
    who.require_write()
    snap = await live_snapshot(st, snapshot_id, who.tenant)
    op = await start_delete(st, who, snap, idempotency_key)
    return JSONResponse({"snapshot": views.snapshot(snap), "operation": views.operation(op)}, status_code=202)


async def start_delete(st: AppState, who: Principal, snap: Snapshot, idempotency_key: str | None) -> Operation:
    """Record the operation that removes a snapshot: its node copy, its objects, then its row."""
    who.require_write()
    if await st.store.snapshot_in_use(snap.id):
        raise Conflict(f"snapshot {snap.id} is in use (a fork, a restore, or a suspended sandbox's state)")
    op = Operation(id=ids.operation_id(), tenant=who.tenant, kind="snapshot.delete", target=snap.sandbox_id,
                   status="pending", idempotency_key=idempotency_key, request={"snapshot": snap.id})
    op, created = await st.store.create_operation(op)
    if created:
        st.controller.wake()
    return op
