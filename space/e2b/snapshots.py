"""E2B's snapshot API over SPACE's retained snapshots.

An E2B snapshot outlives its sandbox and any number of sandboxes start from it: that is a SPACE
snapshot with ``retain`` (uploaded to object storage as it is taken). Ids are SPACE's own
``snap-…``; ``names`` is ``[name]`` when one was given, else ``[id]``. ``Sandbox.create(<id>)`` is
handled by the create route (:func:`space.e2b.control._create`); listing shows the tenant's retained
snapshots that are ready, newest first.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from space.api import snapshots as space_snapshots
from space.e2b.control import (
    Auth,
    E2BError,
    St,
    finish_operation,
    live_sandbox,
    page_cursor,
    page_token,
    short_id,
    wait_running,
)
from space.e2b.edge import json_body
from space.errors import InvalidState, NotFound
from space.lifecycle import State
from space.store import Snapshot

log = structlog.get_logger("space.e2b.snapshots")

router = APIRouter()


class SnapshotRequest(BaseModel):
    """``SandboxSnapshotRequest``: ``memory`` false is a filesystem-only snapshot (E2B's default: full)."""

    model_config = ConfigDict(extra="ignore")
    name: str | None = Field(None, min_length=1, max_length=128, pattern=space_snapshots.NAME_PATTERN)
    memory: bool | None = None


def info_view(snap: Snapshot) -> dict[str, Any]:
    return {"snapshotID": snap.id, "names": [snap.name or snap.id]}


@router.post("/sandboxes/{sandbox_id}/snapshots")
async def create_snapshot(sandbox_id: str, who: Auth, st: St, body: SnapshotRequest | None = None) -> Response:
    """Answers once the snapshot is uploaded: a sandbox can be created from it right away."""
    who.require_write()
    body = body or SnapshotRequest.model_validate({})
    sb = await live_sandbox(st, who, sandbox_id)
    if sb.state == State.CREATING:
        sb = await wait_running(st, sb.id, f"creating sandbox {sb.id}")
    kind = "disk" if body.memory is False else "full"
    try:
        _, snap, op = await space_snapshots.start_snapshot(st, who, sb.id, kind, retain=True, name=body.name)
    except InvalidState as exc:
        raise E2BError(409, f"cannot snapshot sandbox {sandbox_id}: {exc.message}") from None
    await finish_operation(st, op, f"snapshotting sandbox {sb.id}")
    log.info("e2b.snapshot.created", sandbox=sb.id, snapshot=snap.id, kind=kind)
    return json_body(info_view(snap), 201)


@router.get("/snapshots")
async def list_snapshots(
    who: Auth, st: St,
    sandbox_id: Annotated[str | None, Query(alias="sandboxID")] = None,
    name: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> Response:
    if sandbox_id and name:
        raise E2BError(400, "filter by sandboxID or by name, not both")
    rows = await st.store.list_snapshots(tenant=who.tenant, retain=True, statuses=["ready"],
                                         sandbox_id=short_id(sandbox_id) if sandbox_id else None)
    if name:  # the SDK: "by name or ID"
        rows = [s for s in rows if name in (s.name, s.id)]
    rows.sort(key=lambda s: (s.created_at.timestamp(), s.id), reverse=True)
    if next_token:
        cursor = page_cursor(next_token)
        rows = [s for s in rows if (s.created_at.timestamp(), s.id) < cursor]
    page = rows[:limit]
    headers = {"x-next-token": page_token(page[-1].created_at, page[-1].id)} if len(rows) > limit else None
    return Response(json.dumps([info_view(s) for s in page]), media_type="application/json", headers=headers)


@router.delete("/templates/{snapshot_id}")
async def delete_snapshot(snapshot_id: str, who: Auth, st: St) -> Response:
    """204 once its objects are gone (a second delete is then a 404, which the SDK reports as
    False). Only snapshots: SPACE's templates are not deleted through this API."""
    who.require_write()
    try:
        snap = await space_snapshots.live_snapshot(st, snapshot_id, who.tenant)
    except NotFound:
        raise E2BError(404, f"snapshot {snapshot_id} not found") from None
    op = await space_snapshots.start_delete(st, who, snap, None)
    await finish_operation(st, op, f"deleting snapshot {snap.id}")
    return Response(status_code=204)
