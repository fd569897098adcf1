"""/v1/sandboxes and /v1/operations."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import structlog
from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from space import failpoints, ids
from space.api import views
from space.api.auth import Principal, principal
from space.api.egress import checked_policy
from space.api.fields import MAX_CPU, MAX_MEMORY_MB, MIN_MEMORY_MB, Bool, Int64, Number
from space.api.state import AppState, app_state
from space.api.templates import resolve_reference
from space.controller import placement
from space.controller.egress import egress_config
from space.errors import Conflict, InvalidRequest, InvalidState, PoolEmpty, QuotaExceeded, SpaceError, Unavailable
from space.lifecycle import Action, State, allowed_actions, require
from space.node.api.client import NodeClient
from space.node.network.port_proxy import PORT_HOST_MAX, PORT_HOST_PATTERN
from space.retention import SnapshotPolicy
from space.store import Operation, Sandbox
from space.store.quotas import QuotaDemand
from space.web import EventStream, sse

log = structlog.get_logger("space.api.sandboxes")

router = APIRouter(prefix="/v1")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]

MAX_ENV = 256
FINISHED = ("succeeded", "failed")


class CreateSandboxBody(BaseModel):
    template: str = Field("base", min_length=1, max_length=128)
    cpu: Number = Field(1.0, gt=0, le=MAX_CPU)
    memory_mb: Annotated[Int64, Field(ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB)] = 512
    env: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    #: Seconds without activity before the sandbox is paused / suspended (None: never).
    idle_pause_s: Annotated[Int64, Field(ge=1, le=365 * 86400)] | None = None
    idle_suspend_s: Annotated[Int64, Field(ge=1, le=365 * 86400)] | None = None
    #: Maximum lifetime in seconds (None: none); the sandbox is deleted when it runs out.
    lifetime_s: Annotated[Int64, Field(ge=1, le=10 * 365 * 86400)] | None = None
    #: Snapshot schedule and retention overrides (see docs/api.md).
    snapshot_policy: dict[str, Any] | None = None
    #: Egress policy ``{"allow": [...], "deny": [...], "default": ...}`` (None: the tenant's default).
    egress: dict[str, Any] | None = None
    #: Secrets the gateway injects into its matching requests (names, resolved by scope).
    secrets: list[str] = Field(default_factory=list, max_length=64)
    #: The middle level of secret scopes.
    project: str = Field("", max_length=128, pattern=r"^([a-zA-Z0-9][a-zA-Z0-9_.-]*)?$")
    #: What the end of ``lifetime_s`` does: delete the sandbox, pause it, or suspend it (with its
    #: memory, or its files only: ``suspend_disk``).
    on_expire: Literal["delete", "pause", "suspend", "suspend_disk"] = "delete"
    #: Whether exec and file calls on a paused or suspended sandbox wake it (else they answer 409).
    auto_resume: Bool = True
    #: Whether its servers answer E2B-style port traffic without its access token (E2B's default).
    public_ports: Bool = False
    #: The ``Host`` its servers see on port traffic, ``${PORT}`` standing for the port (e.g.
    #: ``app.example.com:${PORT}``); default ``localhost:<port>``.
    port_host: str | None = Field(None, min_length=1, max_length=PORT_HOST_MAX, pattern=PORT_HOST_PATTERN)
    #: Start from this snapshot (files, and with a full one the processes) instead of the template.
    snapshot: str | None = Field(None, min_length=1, max_length=64)
    #: MiB the sandbox may write beyond its template (writes past it fail with EDQUOT inside it
    #: alone); default: the operator's, at most the tenant's ``disk_mb`` quota.
    disk_mb: Annotated[Int64, Field(ge=16, le=1 << 30)] | None = None


@router.post("/sandboxes", status_code=202,
             responses={201: {"description": "A warm sandbox was claimed: it is running already",
                                   "content": {"application/json": {"schema": {"type": "object"}}}}})
async def create_sandbox(
    body: CreateSandboxBody,
    who: Auth,
    st: St,
    idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
) -> JSONResponse:
    sb, op, status = await create(st, who, body, idempotency_key)
    return JSONResponse({"sandbox": views.sandbox(sb), "operation": views.operation(op)}, status_code=status)


async def create(st: AppState, who: Principal, body: CreateSandboxBody,
                 idempotency_key: str | None) -> tuple[Sandbox, Operation, int]:
    """Create a sandbox: ``201`` with it running when a warm one was claimed, else ``202`` with the
    operation that boots it (also what an idempotent retry of an accepted create gets)."""
    who.require_write()
    if len(body.env) > MAX_ENV or len(body.metadata) > MAX_ENV:
        raise InvalidRequest(f"at most {MAX_ENV} env vars and metadata entries")
    policy = SnapshotPolicy.from_dict(body.snapshot_policy).to_dict() if body.snapshot_policy else {}
    egress_policy = await checked_policy(st, who.tenant, body.egress)
    bound = list(dict.fromkeys(body.secrets))
    if bound:
        if st.credentials is None:
            raise Unavailable("secrets are not configured on this deployment (no master key)")
        await st.credentials.check_bindable(who, who.tenant, body.project, None, bound)
    if body.snapshot is not None:
        return await _create_from_snapshot(st, who, body, idempotency_key, policy, egress_policy, bound)
    if ":" in body.template:  # name:tag
        body = body.model_copy(update={"template": await resolve_reference(st, body.template)})
    sid = ids.sandbox_id()
    sb = Sandbox(
        id=sid, tenant=who.tenant, template=body.template, state=State.CREATING.value,
        cpu=body.cpu, memory_mb=body.memory_mb, env=body.env, meta=body.metadata,
        disk_mb=await disk_limit(st, who.tenant, body.disk_mb),
        idle_pause_s=body.idle_pause_s, idle_suspend_s=body.idle_suspend_s, snapshot_policy=policy,
        egress=egress_policy, secrets=bound, project=body.project,
        expires_at=(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=body.lifetime_s)) if body.lifetime_s else None,
        expire_action=body.on_expire, auto_resume=body.auto_resume, public_ports=body.public_ports,
        port_host=body.port_host,
    )
    op = Operation(
        id=ids.operation_id(), tenant=who.tenant, kind="sandbox.create", target=sid, status="pending",
        idempotency_key=idempotency_key, request=body.model_dump(),
    )
    # Refused before a warm sandbox is claimed for it (the insert checks again, atomically). A
    # retry of an accepted create goes the cold way, where the insert answers it.
    try:
        await st.quotas.precheck(st.store, who.tenant, QuotaDemand.of([sb]))
        over_quota = False
    except QuotaExceeded:
        if idempotency_key is None:
            raise
        over_quota = True
    # A warm sandbox of the template proves the template is there and ready: try that first.
    warm = None if over_quota else await _create_warm(st, sb, op)
    if warm is not None:
        return warm
    tmpl = await st.store.get_template(body.template)  # 404 for an unknown template
    if tmpl.status == "failed":
        raise InvalidRequest(f"template {body.template!r} failed to build; rebuild it first")
    if tmpl.status == "ready":
        # Placed now, in the same write as the row: the controller goes straight to the node.
        with contextlib.suppress(SpaceError):
            sb.node_id = (await st.nodes.schedule(placement.Request(sb.template, sb.cpu, sb.memory_mb))).node_id
    sb, op, created = await st.store.create_sandbox(sb, op)
    if created:
        st.controller.wake()
    return sb, op, 202


async def disk_limit(st: AppState, tenant: str, asked: int | None) -> int:
    """The disk limit a new sandbox of ``tenant`` gets: ``asked``, else the operator's default
    clamped to the tenant's ceiling. One asked for beyond the ceiling is refused by the quota
    check (429 ``quota_exceeded``, resource ``disk_mb``), atomically with the insert."""
    if asked is not None:
        return asked
    limits = await st.quotas.limits(st.store, tenant)
    ceiling = limits.disk_mb if limits is not None else None
    return st.sandbox_disk_mb if ceiling is None else min(st.sandbox_disk_mb, max(ceiling, 16))


async def _create_from_snapshot(st: AppState, who: Principal, body: CreateSandboxBody, idempotency_key: str | None,
                                policy: dict[str, Any], egress_policy: dict[str, Any],
                                bound: list[str]) -> tuple[Sandbox, Operation, int]:
    """A sandbox from any ready snapshot of the tenant, retained or not, whether its sandbox still
    exists or not: a fork of that snapshot (one code path), recorded as a ``sandbox.fork``
    operation on the snapshot's sandbox. The snapshot fixes template, cpu, memory and env (its
    processes have them already); the request's other fields apply as to any create."""
    from space.api.snapshots import live_snapshot  # the snapshot routes import the lifecycle ones

    snap = await live_snapshot(st, str(body.snapshot), who.tenant)
    if snap.status != "ready" or not snap.restorable:
        raise Conflict(f"snapshot {snap.id} is {snap.status} and cannot be used"
                       + (f": {snap.error}" if snap.error else ""), snapshot_status=snap.status)
    if snap.node_id is None and snap.object_key is None:
        raise Conflict(f"snapshot {snap.id} is neither on a node nor in object storage", snapshot_status=snap.status)
    src = await st.store.get_sandbox(snap.sandbox_id)  # rows outlive their sandbox
    given = body.model_fields_set
    disk = (body.disk_mb if body.disk_mb is not None
            else src.disk_mb if src.disk_mb is not None else await disk_limit(st, who.tenant, None))
    for field, want in (("template", snap.template), ("cpu", src.cpu), ("memory_mb", src.memory_mb)):
        if field in given and getattr(body, field) != want:
            raise InvalidRequest(f"a sandbox from snapshot {snap.id} has its {field} ({want}); leave {field} out",
                                 field=field)
    if body.env:
        raise InvalidRequest(f"a sandbox from snapshot {snap.id} keeps the snapshot's env; leave env out",
                             field="env")
    sb = Sandbox(
        id=ids.sandbox_id(), tenant=who.tenant, template=snap.template, template_digest=snap.template_digest,
        state=State.CREATING.value, cpu=src.cpu, memory_mb=src.memory_mb, env=dict(src.env or {}),
        meta=body.metadata, parent_id=src.id, source_snapshot=snap.id, disk_mb=disk,
        idle_pause_s=body.idle_pause_s, idle_suspend_s=body.idle_suspend_s, snapshot_policy=policy,
        egress=egress_policy, secrets=bound, project=body.project,
        expires_at=(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=body.lifetime_s)) if body.lifetime_s else None,
        expire_action=body.on_expire, auto_resume=body.auto_resume, public_ports=body.public_ports,
        port_host=body.port_host,
    )
    op = Operation(id=ids.operation_id(), tenant=who.tenant, kind="sandbox.fork", target=src.id, status="pending",
                   idempotency_key=idempotency_key,
                   request={"snapshot": snap.id, "sandbox_ids": [sb.id], "take_snapshot": False,
                            "from_snapshot": True})
    rows, op, created = await st.store.create_sandboxes([sb], op)
    if created:
        st.controller.wake()
    return rows[0], op, 202


async def _create_warm(st: AppState, sb: Sandbox, op: Operation) -> tuple[Sandbox, Operation, int] | None:
    """Claim a warm sandbox for the request and record it as running: one node call and one
    commit. None when no node has one ready (the caller creates it cold).

    The sandbox takes the warm one's id. A crash between the claim and the commit leaves a
    claimed sandbox without a row, which reconcile removes after its grace period.
    """
    req = placement.Request(sb.template, sb.cpu, sb.memory_mb)
    claim = {"template": sb.template, "cpu": sb.cpu, "memory_mb": sb.memory_mb, "env": sb.env,
             "disk_mb": sb.disk_mb,
             # Secrets are resolved for the id the sandbox gets, once it has it (below).
             "egress": await egress_config(st.store, st.credentials, sb, with_secrets=False)}
    for node_row in placement.warm_candidates(placement.fresh(await st.nodes.placeable_rows()), req):
        node = await st.nodes.client(node_row.id)
        t0 = time.perf_counter()
        try:
            info = await node.call("POST", "/v1/pool/claim", json_body=claim, timeout=10)
        except PoolEmpty:
            continue
        except SpaceError as exc:
            log.warning("warm.claim_failed", node=node_row.id, error=str(exc))
            continue
        await failpoints.hit("api.after_warm_claim")
        sb.id = op.target = str(info["id"])
        if sb.secrets:
            try:
                await node.call("PUT", f"/v1/sandboxes/{sb.id}/egress",
                                json_body=await egress_config(st.store, st.credentials, sb), timeout=10)
            except BaseException:
                await _release(node, sb.id)
                raise
        sb.node_id, sb.instance_id = node_row.id, info.get("instance_id")
        sb.template_digest = info.get("template_digest")
        sb.state = State.RUNNING
        sb.last_active_at = dt.datetime.now(dt.UTC)
        op.status = "succeeded"
        op.finished_at = sb.last_active_at
        op.result = {"sandbox_id": sb.id, "node_id": node_row.id, "warm": True,
                     "timings": {"claim_ms": round((time.perf_counter() - t0) * 1000, 2)}}
        try:
            row, op, created = await st.store.create_sandbox(sb, op)
        except BaseException:
            await _release(node, sb.id)
            raise
        if not created:  # an idempotent retry: the earlier request's sandbox stands
            await _release(node, sb.id)
            return row, op, 202
        log.info("sandbox.created", sandbox=row.id, node=node_row.id, warm=True)
        return row, op, 201
    return None


async def _release(node: NodeClient, sandbox_id: str) -> None:
    with contextlib.suppress(SpaceError):
        await asyncio.shield(node.call("DELETE", f"/v1/sandboxes/{sandbox_id}"))


@router.get("/sandboxes")
async def list_sandboxes(who: Auth, st: St, state: str | None = None) -> dict[str, Any]:
    if state is not None:
        try:
            states = [State(state).value]
        except ValueError:
            raise InvalidRequest(f"unknown state {state!r}") from None
    else:
        states = [s.value for s in State if s != State.TERMINATED]
    rows = await st.store.list_sandboxes(tenant=who.tenant, states=states)
    return {"sandboxes": [views.sandbox(sb) for sb in rows]}


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, who: Auth, st: St) -> dict[str, Any]:
    return views.sandbox(await st.store.get_sandbox(sandbox_id, tenant=who.tenant))


class UpdateSandboxBody(BaseModel):
    """Fields left out stay as they are; ``null`` turns a policy off."""

    idle_pause_s: Annotated[Int64, Field(ge=1, le=365 * 86400)] | None = None
    idle_suspend_s: Annotated[Int64, Field(ge=1, le=365 * 86400)] | None = None
    #: Seconds from now until the sandbox is deleted (``null``: no maximum lifetime).
    lifetime_s: Annotated[Int64, Field(ge=1, le=10 * 365 * 86400)] | None = None
    snapshot_policy: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    on_expire: Literal["delete", "pause", "suspend", "suspend_disk"] | None = None
    auto_resume: Bool | None = None


@router.patch("/sandboxes/{sandbox_id}")
async def update_sandbox(sandbox_id: str, body: UpdateSandboxBody, who: Auth, st: St) -> dict[str, Any]:
    """Change a sandbox's policies (idleness, lifetime, snapshots) or metadata; they apply at the
    controller's next tick."""
    who.require_write()
    sb = await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    if sb.state in (State.TERMINATING, State.TERMINATED):
        raise InvalidState(f"cannot change a sandbox that is {sb.state}", state=str(sb.state),
                           allowed=allowed_actions(State(sb.state)))
    given = body.model_fields_set
    changes: dict[str, Any] = {k: getattr(body, k) for k in ("idle_pause_s", "idle_suspend_s") if k in given}
    if "lifetime_s" in given:
        changes["expires_at"] = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=body.lifetime_s)
                                 if body.lifetime_s else None)
    if "snapshot_policy" in given:
        changes["snapshot_policy"] = (SnapshotPolicy.from_dict(body.snapshot_policy).to_dict()
                                      if body.snapshot_policy else {})
    for name, column in (("on_expire", "expire_action"), ("auto_resume", "auto_resume")):
        if name in given and getattr(body, name) is not None:
            changes[column] = getattr(body, name)
    if "metadata" in given:
        if body.metadata is not None and len(body.metadata) > MAX_ENV:
            raise InvalidRequest(f"at most {MAX_ENV} metadata entries")
        changes["meta"] = body.metadata or {}
    if changes:
        sb = await st.store.update_sandbox(sandbox_id, **changes)
    return views.sandbox(sb)


@router.delete("/sandboxes/{sandbox_id}", status_code=202)
async def delete_sandbox(
    sandbox_id: str,
    who: Auth,
    st: St,
    idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
) -> JSONResponse:
    sb, op = await delete(st, who, sandbox_id, idempotency_key)
    return JSONResponse({"sandbox": views.sandbox(sb), "operation": views.operation(op)}, status_code=202)


async def delete(st: AppState, who: Principal, sandbox_id: str,
                 idempotency_key: str | None = None) -> tuple[Sandbox, Operation]:
    """Start deleting a sandbox; deleting twice answers the delete already under way."""
    who.require_write()
    sb = await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    existing = await st.store.find_operations(target=sandbox_id, kind="sandbox.delete",
                                              status=["pending", "running"])
    if existing:
        return sb, existing[0]
    require(sb.state, Action.DELETE)
    op = Operation(
        id=ids.operation_id(), tenant=who.tenant, kind="sandbox.delete", target=sandbox_id, status="pending",
        idempotency_key=idempotency_key, request={},
    )
    try:
        sb, op, created = await st.store.start_operation(op, move_to=State.TERMINATING, expect=[sb.state])
    except InvalidState:
        # A concurrent delete won the race: answer with its operation, as a repeated delete does.
        existing = await st.store.find_operations(target=sandbox_id, kind="sandbox.delete",
                                                  status=["pending", "running"])
        if not existing:
            raise
        sb, op, created = await st.store.get_sandbox(sandbox_id), existing[0], False
    if created:
        st.controller.wake()
    return sb, op


@router.get("/operations/{op_id}")
async def get_operation(
    op_id: str, who: Auth, st: St, wait: Annotated[float, Query(ge=0, le=60)] = 0
) -> dict[str, Any]:
    op = await st.store.get_operation(op_id, tenant=who.tenant)
    if op.status in FINISHED or wait <= 0:
        return views.operation(op)
    deadline = time.monotonic() + wait
    # Woken at once when this replica's controller finishes it; polled for other replicas' work.
    done = st.controller.watch(op_id)
    try:
        while op.status not in FINISHED:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=min(left, 0.2))
            op = await st.store.get_operation(op_id)
    finally:
        st.controller.unwatch(op_id, done)
    return views.operation(op)


@router.get("/operations/{op_id}/logs", response_class=EventStream)
async def operation_logs(
    op_id: str,
    who: Auth,
    st: St,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    await st.store.get_operation(op_id, tenant=who.tenant)  # 404 for another tenant's operation
    start = int(last_event_id) if last_event_id and last_event_id.isdigit() else 0

    async def stream() -> AsyncIterator[bytes]:
        after = start
        while True:
            lines = await st.store.get_operation_logs(op_id, after=after)
            for ln in lines:
                after = ln.seq
                yield sse("log", {"seq": ln.seq, "line": ln.line}, ln.seq)
            if lines:
                continue
            op = await st.store.get_operation(op_id)
            if op.status in FINISHED:
                # Lines written just before it finished are read on the next turn, then the end.
                if not await st.store.get_operation_logs(op_id, after=after):
                    yield sse("end", views.operation(op))
                    return
                continue
            await asyncio.sleep(0.2)

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"cache-control": "no-store"})
