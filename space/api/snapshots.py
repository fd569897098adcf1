"""/v1/sandboxes/{id}/snapshots and /v1/snapshots/{id}."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from space import ids
from space.api import views
from space.api.auth import Principal, principal
from space.api.lifecycle import enqueue_action
from space.api.state import AppState, app_state
from space.errors import Conflict, InvalidRequest, NotFound
from space.lifecycle import Action
from space.store import Operation, Snapshot, new_snapshot

router = APIRouter(prefix="/v1")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]
IdemKey = Annotated[str | None, Header(max_length=256)]


class SnapshotBody(BaseModel):
    #: "disk": the files, taken without pausing. "full": memory and files, consistent.
    kind: str = Field("disk", pattern="^(disk|full)$")


@router.get("/sandboxes/{sandbox_id}/snapshots")
async def list_snapshots(sandbox_id: str, who: Auth, st: St) -> dict[str, Any]:
    await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    rows = await st.store.list_snapshots(sandbox_id=sandbox_id, tenant=who.tenant,
                                         statuses=["creating", "ready", "failed"])
    return {"snapshots": [views.snapshot(s) for s in rows]}


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=202)
async def create_snapshot(sandbox_id: str, who: Auth, st: St, body: SnapshotBody | None = None,
                          idempotency_key: IdemKey = None) -> JSONResponse:
    kind = body.kind if body is not None else "disk"
    who.require_write()
    sb = await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    snap = new_snapshot(sb, kind, "manual")
    sb, op = await enqueue_action(st, who.tenant, sandbox_id, Action.SNAPSHOT, "snapshot.create",
                                  {"snapshot": snap.id, "kind": kind}, idempotency_key, snapshot=snap)
    # An idempotent replay answers with the snapshot of the first request.
    snap = await st.store.get_snapshot(str(op.request["snapshot"]))
    return JSONResponse({"sandbox": views.sandbox(sb), "snapshot": views.snapshot(snap),
                         "operation": views.operation(op)}, status_code=202)


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
    if await st.store.snapshot_in_use(snapshot_id):
        raise Conflict(f"snapshot {snapshot_id} is in use (a fork, a restore, or a suspended sandbox's state)")
    op = Operation(id=ids.operation_id(), tenant=who.tenant, kind="snapshot.delete", target=sandbox_id,
                   status="pending", idempotency_key=idempotency_key, request={"snapshot": snapshot_id})
    op, created = await st.store.create_operation(op)
    if created:
        st.controller.wake()
    return JSONResponse({"snapshot": views.snapshot(snap), "operation": views.operation(op)}, status_code=202)
