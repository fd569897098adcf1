"""Lifecycle actions on a sandbox: pause, resume, suspend, restore, rollback, fork; its events.

Each action is checked against the state machine here (409 naming the state and the allowed
actions), recorded as an operation, and carried out by the controller (pause and resume by this
replica's, at once: :data:`CARRIED_OUT_HERE`). Actions that have an
in-between state (suspending, restoring) enter it at once, so that the sandbox's state tells the
truth while the work runs.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from space import ids
from space.api import views
from space.api.auth import Principal, principal
from space.api.fields import Bool, Cursor, Int64
from space.api.state import AppState, app_state
from space.errors import Conflict, InvalidRequest, InvalidState
from space.lifecycle import ACTION_TARGET, Action, State, require
from space.store import Operation, Sandbox, Snapshot, new_snapshot

router = APIRouter(prefix="/v1/sandboxes")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]
IdemKey = Annotated[str | None, Header(max_length=256)]

MAX_FORKS = 16

#: Operations a millisecond's work on the node (the freezer): the replica that accepts one claims
#: it in the same write and carries it out itself, unless another operation on the sandbox is
#: queued ahead of it (then the controllers do, in order). Through the queue the claim alone took
#: longer than the pause (issue 18: 55 ms a pause, 14 of them waiting to be claimed).
CARRIED_OUT_HERE = frozenset({"sandbox.pause", "sandbox.resume"})
#: How long the request waits for such an operation; it answers with the operation as it stands.
HERE_WAIT = 10.0


class RestoreBody(BaseModel):
    #: Place the restored sandbox on this node (admin only); default: the scheduler picks.
    node: str | None = Field(None, max_length=64)


class RollbackBody(BaseModel):
    snapshot: str = Field(..., min_length=1, max_length=64)


class ForkBody(BaseModel):
    snapshot: str | None = Field(None, min_length=1, max_length=64)
    count: Annotated[Int64, Field(ge=1, le=MAX_FORKS)] = 1
    metadata: dict[str, str] = Field(default_factory=dict)


async def start_action(
    st: AppState,
    who: Principal,
    sandbox_id: str,
    action: Action,
    kind: str,
    request: dict[str, Any],
    idempotency_key: str | None,
    snapshot: Snapshot | None = None,
) -> JSONResponse:
    who.require_write()
    sb, op = await enqueue_action(st, who.tenant, sandbox_id, action, kind, request, idempotency_key, snapshot)
    return JSONResponse({"sandbox": views.sandbox(sb), "operation": views.operation(op)}, status_code=202)


async def enqueue_action(
    st: AppState,
    tenant: str,
    sandbox_id: str,
    action: Action,
    kind: str,
    request: dict[str, Any],
    idempotency_key: str | None = None,
    snapshot: Snapshot | None = None,
) -> tuple[Sandbox, Operation]:
    """Check ``action`` against the state, record the operation (and the snapshot row it makes,
    if any) and, for actions with an in-between state, enter it."""
    sb = await st.store.get_sandbox(sandbox_id, tenant=tenant)
    require(sb.state, action)
    op = Operation(id=ids.operation_id(), tenant=tenant, kind=kind, target=sandbox_id, status="pending",
                   idempotency_key=idempotency_key, request={**request, "from_state": str(sb.state)})
    target = ACTION_TARGET[action]
    move_to = target if target in (State.SUSPENDING, State.RESTORING) else None
    here = kind in CARRIED_OUT_HERE
    # The operation, its snapshot row and the in-between state are one write: no state is ever
    # left without the operation that finishes it.
    sb, op, created = await st.store.start_operation(
        op, move_to=move_to, expect=[sb.state], snapshot=snapshot,
        claim_for=(st.controller.owner, st.controller.lease_seconds) if here else None)
    if created and op.status == "running" and op.lease_owner == st.controller.owner:
        op = await st.controller.carry_out_here(op, wait=HERE_WAIT)
        if op.status in ("succeeded", "failed"):
            sb = await st.store.get_sandbox(sandbox_id)
    elif created:
        st.controller.wake()
    return sb, op


@router.post("/{sandbox_id}/pause", status_code=202)
async def pause(sandbox_id: str, who: Auth, st: St, idempotency_key: IdemKey = None) -> JSONResponse:
    return await start_action(st, who, sandbox_id, Action.PAUSE, "sandbox.pause", {}, idempotency_key)


@router.post("/{sandbox_id}/resume", status_code=202)
async def resume(sandbox_id: str, who: Auth, st: St, idempotency_key: IdemKey = None) -> JSONResponse:
    return await start_action(st, who, sandbox_id, Action.RESUME, "sandbox.resume", {}, idempotency_key)


class SuspendBody(BaseModel):
    #: False keeps only the files (a disk snapshot): smaller and faster, and a restore boots the
    #: sandbox afresh instead of resuming its processes.
    memory: Bool = True


@router.post("/{sandbox_id}/suspend", status_code=202)
async def suspend(sandbox_id: str, who: Auth, st: St, body: SuspendBody | None = None,
                  idempotency_key: IdemKey = None) -> JSONResponse:
    who.require_write()
    sb, op = await start_suspend(st, who.tenant, sandbox_id, memory=body.memory if body else True,
                                 idempotency_key=idempotency_key)
    return JSONResponse({"sandbox": views.sandbox(sb), "operation": views.operation(op)}, status_code=202)


async def start_suspend(st: AppState, tenant: str, sandbox_id: str, *, memory: bool = True,
                        idempotency_key: str | None = None) -> tuple[Sandbox, Operation]:
    sb = await st.store.get_sandbox(sandbox_id, tenant=tenant)
    require(sb.state, Action.SUSPEND)
    snap = new_snapshot(sb, "full" if memory else "disk", "suspend")
    return await enqueue_action(st, tenant, sandbox_id, Action.SUSPEND, "sandbox.suspend",
                                {"snapshot": snap.id, "memory": memory}, idempotency_key, snapshot=snap)


@router.post("/{sandbox_id}/restore", status_code=202)
async def restore(sandbox_id: str, who: Auth, st: St, body: RestoreBody | None = None,
                  idempotency_key: IdemKey = None) -> JSONResponse:
    node = body.node if body is not None else None
    if node is not None:
        who.require_operator()
        await st.store.get_node(node)  # 404 for an unknown node
    sb = await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    return await start_action(st, who, sandbox_id, Action.RESTORE, "sandbox.restore",
                              {"snapshot": sb.snapshot_id, "node": node}, idempotency_key)


@router.post("/{sandbox_id}/rollback", status_code=202)
async def rollback(sandbox_id: str, body: RollbackBody, who: Auth, st: St,
                   idempotency_key: IdemKey = None) -> JSONResponse:
    from space.api.snapshots import live_snapshot  # the snapshot routes import this module

    sb = await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    snap = await live_snapshot(st, body.snapshot, who.tenant)
    if snap.sandbox_id != sandbox_id:
        raise InvalidRequest(f"snapshot {snap.id} belongs to sandbox {snap.sandbox_id}, not {sandbox_id}; "
                             "fork it to get a sandbox from it")
    _check_usable(snap)
    if snap.node_id != sb.node_id and snap.object_key is None:
        raise Conflict(f"snapshot {snap.id} is not on the node that runs {sandbox_id} nor in object storage")
    return await start_action(st, who, sandbox_id, Action.ROLLBACK, "sandbox.rollback", {"snapshot": snap.id},
                              idempotency_key)


@router.post("/{sandbox_id}/fork", status_code=202)
async def fork(sandbox_id: str, who: Auth, st: St, body: ForkBody | None = None,
               idempotency_key: IdemKey = None) -> JSONResponse:
    """``count`` new sandboxes from one snapshot (default: a full checkpoint taken now)."""
    rows, snap_id, op = await fork_sandbox(st, who, sandbox_id, body or ForkBody.model_validate({}),
                                           idempotency_key)
    return JSONResponse({"sandboxes": [views.sandbox(r) for r in rows], "snapshot": snap_id,
                         "operation": views.operation(op)}, status_code=202)


async def fork_sandbox(st: AppState, who: Principal, sandbox_id: str, body: ForkBody,
                       idempotency_key: str | None) -> tuple[list[Sandbox], str, Operation]:
    """Record ``body.count`` forks of a sandbox and the operation that boots them."""
    who.require_write()
    src = await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    require(src.state, Action.FORK)
    new_snap: Snapshot | None = None
    if body.snapshot is not None:
        from space.api.snapshots import live_snapshot

        snap = await live_snapshot(st, body.snapshot, who.tenant)
        if snap.sandbox_id != sandbox_id:
            raise InvalidRequest(f"snapshot {snap.id} belongs to sandbox {snap.sandbox_id}, not {sandbox_id}")
        _check_usable(snap)
        snap_id = snap.id
    elif src.state == State.SUSPENDED:
        if src.snapshot_id is None:
            raise InvalidState(f"sandbox {sandbox_id} is suspended without a snapshot", state=str(src.state),
                               allowed=[])
        snap_id = src.snapshot_id
    else:
        new_snap = new_snapshot(src, "full", "fork")
        snap_id = new_snap.id
    forks = [
        Sandbox(id=ids.sandbox_id(), tenant=who.tenant, template=src.template, state=State.CREATING.value,
                cpu=src.cpu, memory_mb=src.memory_mb, env=src.env, meta=body.metadata or src.meta,
                disk_mb=src.disk_mb if src.disk_mb is not None else st.sandbox_disk_mb,
                template_digest=src.template_digest, parent_id=sandbox_id, source_snapshot=snap_id,
                idle_pause_s=src.idle_pause_s, idle_suspend_s=src.idle_suspend_s,
                snapshot_policy=src.snapshot_policy, expire_action=src.expire_action,
                auto_resume=src.auto_resume, public_ports=src.public_ports,
                # A fork keeps its parent's egress policy and secret bindings (sandbox-scoped
                # secrets stay the parent's own).
                egress=dict(src.egress or {}), secrets=list(src.secrets or []), project=src.project)
        for _ in range(body.count)
    ]
    op = Operation(id=ids.operation_id(), tenant=who.tenant, kind="sandbox.fork", target=sandbox_id,
                   status="pending", idempotency_key=idempotency_key,
                   request={"snapshot": snap_id, "sandbox_ids": [f.id for f in forks],
                            "take_snapshot": new_snap is not None})
    rows, op, created = await st.store.create_sandboxes(forks, op, new_snap)
    if created:
        st.controller.wake()
    return rows, snap_id, op


@router.get("/{sandbox_id}/events")
async def events(sandbox_id: str, who: Auth, st: St, after: Cursor = 0) -> dict[str, Any]:
    await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    rows = await st.store.list_events(sandbox_id, after=after)
    return {"events": [views.event(e) for e in rows]}


def _check_usable(snap: Snapshot) -> None:
    if snap.status != "ready" or not snap.restorable:
        raise Conflict(f"snapshot {snap.id} is {snap.status} and cannot be used"
                       + (f": {snap.error}" if snap.error else ""), snapshot_status=snap.status)
