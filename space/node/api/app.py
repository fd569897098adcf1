"""The node API: how the control plane drives a node (HTTP over a unix socket with a bearer token,
or over TCP with mutual TLS: space.cluster.pki).

It is internal: requests arrive already authorized for a tenant by the control plane, so the node
checks only that the caller is the control plane (holds the node token, or a control-plane
certificate of the cluster CA). Shapes follow the public API (docs/api.md) so the
control plane can pass streams through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal as signal_mod
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import structlog
from fastapi import APIRouter, BackgroundTasks, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect, HTTPConnection

from space import failpoints, ids, paths
from space.errors import (
    InvalidRequest,
    InvalidState,
    KeyUnavailable,
    NotFound,
    PayloadTooLarge,
    RuntimeFailure,
    SpaceError,
    Unauthorized,
)
from space.guest.protocol import MAX_PAYLOAD
from space.kms import KeyRef
from space.node.api.watch_routes import watch_router
from space.node.capacity import node_capacity
from space.node.leaving import Heartbeats
from space.node.network.egress import Egress
from space.node.network.port_proxy import ports_router
from space.node.network.port_websocket import port_websocket_router
from space.node.sandboxes import stats
from space.node.sandboxes.fencing import Fence
from space.node.sandboxes.manager import LocalSandbox, SandboxManager
from space.node.sandboxes.warm import PoolKey, WarmPool, node_memory_mb
from space.node.storage import backup_chain, snapshots
from space.node.storage.artifacts import SealingSpec
from space.node.templates import save as template_save
from space.node.templates.logins import logins_fd
from space.node.templates.store import TemplateStore
from space.web import event_wire, guest_event, install_error_handlers

log = structlog.get_logger("space.node.api")

#: Most bytes of waiting events sent in one write of a command's event stream.
BATCH_BYTES = 512 * 1024
_StreamItem = bytes | SpaceError | None


def _batch(first: bytes, queue: asyncio.Queue[_StreamItem]) -> tuple[bytes, list[_StreamItem]]:
    """``first`` and the encoded events already waiting behind it (up to :data:`BATCH_BYTES`), as
    one write: a fast command's output then costs a write here, and a read in the API's relay, per
    batch instead of per event. Returns the bytes and the item that ended the batch if it is not an
    event (an error or the end, taken off the queue so the caller must handle it: a list of at
    most one)."""
    parts = [first]
    size = len(first)
    after: list[_StreamItem] = []
    while size < BATCH_BYTES and not queue.empty():
        nxt = queue.get_nowait()
        if not isinstance(nxt, bytes):
            after.append(nxt)
            break
        parts.append(nxt)
        size += len(nxt)
    return b"".join(parts) if len(parts) > 1 else first, after


class EgressConfig(BaseModel):
    """What the gateway lets a sandbox do: its tenant, its own egress policy, its tenant's default
    (both must allow), the tenant's ceiling (None: this node's own) and resolved secrets
    (``secrets`` None: keep the ones the node holds)."""

    tenant: str
    policy: dict[str, Any] = Field(default_factory=dict)
    tenant_policy: dict[str, Any] = Field(default_factory=dict)
    ceiling: list[str] | None = Field(None, max_length=256)
    secrets: list[dict[str, Any]] | None = None


class CreateSandbox(BaseModel):
    template: str
    cpu: float = Field(1.0, gt=0, le=64)
    memory_mb: int = Field(512, ge=64, le=262144)
    env: dict[str, str] = Field(default_factory=dict)
    egress: EgressConfig | None = None
    #: The sandbox's disk limit in MiB (None: the node's default; 0 is not a limit).
    disk_mb: int | None = Field(None, ge=16, le=1 << 30)


class AuditAck(BaseModel):
    upto: int = Field(..., ge=0)


class PoolTarget(BaseModel):
    template: str = Field(..., min_length=1, max_length=128)
    cpu: float = Field(..., gt=0, le=64)
    memory_mb: int = Field(..., ge=64, le=262144)
    size: int = Field(..., ge=0)


class PoolTargets(BaseModel):
    targets: list[PoolTarget]


class ClaimRequest(BaseModel):
    template: str
    cpu: float = Field(1.0, gt=0, le=64)
    memory_mb: int = Field(512, ge=64, le=262144)
    env: dict[str, str] = Field(default_factory=dict)
    egress: EgressConfig | None = None
    #: The sandbox's disk limit in MiB (None: the node's default; 0 is not a limit).
    disk_mb: int | None = Field(None, ge=16, le=1 << 30)


class ExecRequest(BaseModel):
    id: str | None = None
    cmd: list[str] | None = None
    shell: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    pty: dict[str, int] | None = None
    stdin: bool = False
    timeout: float | None = Field(None, gt=0)
    buffer_bytes: int | None = Field(None, gt=0, le=64 * 1024 * 1024)


class SignalRequest(BaseModel):
    signal: str | int = "SIGTERM"


class ResizeRequest(BaseModel):
    rows: int = Field(..., gt=0, le=1000)
    cols: int = Field(..., gt=0, le=1000)


class PathRequest(BaseModel):
    path: str
    #: Who owns what is created (default: the sandbox's user).
    user: str | None = None


class MoveRequest(BaseModel):
    src: str
    dst: str


class SnapshotRequest(BaseModel):
    kind: str = "disk"
    stay_paused: bool = False


class SealingModel(BaseModel):
    """How a snapshot is encrypted (issue BYOK): the tenant's key and the shred secret the control
    plane holds for what the snapshot belongs to (base64 of 32 bytes)."""

    key: dict[str, str]
    shred: str = Field(..., min_length=44, max_length=44)

    def spec(self) -> SealingSpec:
        return SealingSpec.from_json(self.model_dump())


def _spec(sealing: SealingModel | None) -> SealingSpec | None:
    return None if sealing is None else sealing.spec()


class RollbackRequest(BaseModel):
    snapshot: str
    #: The sandbox that owns the snapshot (default: this one).
    source: str | None = None
    #: A retried request with the same token is not applied twice.
    token: str | None = None
    #: Where the snapshot is in object storage, when it is not on this node.
    prefix: str | None = Field(None, max_length=512)
    #: The snapshot's tenant: with ``prefix``, its manifest must be sealed for it.
    tenant: str | None = Field(None, min_length=1, max_length=128)
    egress: EgressConfig | None = None
    #: The sandbox's disk limit in MiB, for its new root (None: the one it has).
    disk_mb: int | None = Field(None, ge=16, le=1 << 30)
    #: Its artifacts encrypted (None: they are not, or were not).
    sealing: SealingModel | None = None


class UploadRequest(BaseModel):
    prefix: str = Field(..., min_length=1, max_length=512)
    #: The snapshot's tenant: its manifest is sealed for it.
    tenant: str = Field(..., min_length=1, max_length=128)
    #: Its artifacts encrypted (None: they are not, or were not).
    sealing: SealingModel | None = None


class RebootRequest(BaseModel):
    token: str | None = None


class ForkRequest(BaseModel):
    source: str
    snapshot: str
    egress: EgressConfig | None = None
    #: The fork's disk limit in MiB (None: the source snapshot's).
    disk_mb: int | None = Field(None, ge=16, le=1 << 30)


class ShipRequest(BaseModel):
    snapshot: str
    prefix: str = Field(..., min_length=1, max_length=512)
    #: The snapshot's tenant, and (restore) the sandbox that owns it when it is not this one (a
    #: fork from a shipped snapshot): its manifest must be sealed for exactly them.
    tenant: str = Field(..., min_length=1, max_length=128)
    source: str | None = Field(None, min_length=1, max_length=128)
    token: str | None = None
    egress: EgressConfig | None = None
    #: Suspend only: ``full`` keeps memory (a restore resumes the processes), ``disk`` only the
    #: files (a restore boots afresh).
    kind: Literal["full", "disk"] = "full"
    #: Restore only: the sandbox's disk limit in MiB (None: the snapshot's).
    disk_mb: int | None = Field(None, ge=16, le=1 << 30)
    #: Its artifacts encrypted (None: they are not, or were not).
    sealing: SealingModel | None = None


class BackupConfig(BaseModel):
    tenant: str = Field(..., min_length=1, max_length=128)
    prefix: str = Field(..., min_length=1, max_length=512)
    every: float = Field(60.0, ge=1, le=86400)
    chain_links: int = Field(30, ge=1, le=1000)
    #: Its links encrypted (None: they are not).
    sealing: SealingModel | None = None


class BackupRestoreRequest(BaseModel):
    tenant: str = Field(..., min_length=1, max_length=128)
    prefix: str = Field(..., min_length=1, max_length=512)
    chain: str = Field(..., min_length=1, max_length=64)
    seq: int = Field(..., ge=0, lt=1000)
    token: str | None = None
    egress: EgressConfig | None = None
    disk_mb: int | None = Field(None, ge=16, le=1 << 30)
    #: Its links encrypted (None: they are not, or were not).
    sealing: SealingModel | None = None


class RewrapRequest(BaseModel):
    """A shipped snapshot (``snapshot_id`` at ``prefix``) or backup link (``chain``/``seq`` under
    the backup ``prefix``) whose data key a tenant's key rotation re-wraps under ``key``."""

    tenant: str = Field(..., min_length=1, max_length=128)
    sandbox_id: str = Field(..., min_length=1, max_length=128)
    prefix: str = Field(..., min_length=1, max_length=512)
    snapshot_id: str | None = Field(None, min_length=1, max_length=128)
    chain: str | None = Field(None, min_length=1, max_length=64)
    seq: int | None = Field(None, ge=0, lt=1000)
    key: dict[str, str]


class KeyCheckRequest(BaseModel):
    """A key a tenant is about to use: does this node's provider make a data key under it?"""

    tenant: str = Field(..., min_length=1, max_length=128)
    key: dict[str, str]


class RegistryLogin(BaseModel):
    username: str = Field(..., min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f:]+$")
    password: str = Field(..., min_length=1, max_length=4096, pattern=r"^[^\x00-\x1f\x7f]+$")


#: Logins by registry (``host[:port]``), for the images a build or an inspection pulls.
RegistryLogins = Annotated[dict[Annotated[str, Field(max_length=261)], RegistryLogin], Field(max_length=16)]


class EnsureTemplate(BaseModel):
    spec: dict[str, Any]
    force: bool = False
    registry_auth: RegistryLogins = Field(default_factory=dict)


class InspectImage(BaseModel):
    image: str = Field(..., min_length=1, max_length=1024)
    auth: RegistryLogins = Field(default_factory=dict)


class SaveTemplate(BaseModel):
    name: str
    sandbox_id: str
    snapshot: str


def sandbox_view(sb: LocalSandbox) -> dict[str, Any]:
    return {
        "id": sb.id,
        "status": sb.status,
        "template": sb.template,
        "template_digest": sb.template_digest,
        "instance_id": sb.instance_id,
        "cpu": sb.cpu,
        "memory_mb": sb.memory_mb,
        "disk_mb": sb.disk_mb,
        "created_at": sb.created_at,
        "timings": sb.timings,
        "death": sb.death,
        "source_snapshot": sb.source_snapshot,
        "claimed_at": sb.claimed_at,
    }


def snapshot_view(snap: snapshots.LocalSnapshot, size: int | None = None) -> dict[str, Any]:
    return {**snap.public(), "size_bytes": size}


def create_node_app(
    *,
    node_id: str,
    token: str | None,
    manager: SandboxManager,
    templates: TemplateStore,
    max_upload_bytes: int,
    sse_keepalive: float = 15.0,
    warm: WarmPool | None = None,
    fence: Fence | None = None,
    leaving: Heartbeats | None = None,
) -> FastAPI:
    app = FastAPI(title="SPACE node API", version="1", docs_url=None, redoc_url=None)
    install_error_handlers(app)

    if failpoints.configured("node.partitioned"):
        # A test's stand-in for a network partition: while it holds, nothing reaches this node's
        # API, so no heartbeat renews its lease. Installed only when configured: no hot-path cost.
        @app.middleware("http")
        async def partition(request: Request, call_next: Any) -> Any:
            if failpoints.active("node.partitioned"):
                return JSONResponse({"error": {"code": "unavailable", "message": "partitioned (failpoint)"}},
                                    status_code=503)
            return await call_next(request)

    async def auth(request: HTTPConnection) -> None:  # a request or a WebSocket handshake
        if token is None:
            # Served over mutual TLS: the handshake admitted only control-plane certificates of
            # the cluster CA, and there is no token for anyone to steal.
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise Unauthorized("missing or wrong node token")

    r = APIRouter(prefix="/v1", dependencies=[Depends(auth)])

    @r.get("/node")
    async def node_info(hb: int | None = None, ack: int | None = None) -> dict[str, Any]:
        # The control plane's heartbeat: it renews this node's fencing lease (fencing.py).
        if fence is not None:
            fence.heartbeat(hb, ack)
        usage = await manager.pool.usage()
        owned = manager.list()
        return {
            # Set while ``space node leave`` waits for this node's sandboxes to move away: the
            # control plane drains it.
            "leaving": leaving.report(len(owned)) if leaving is not None else None,
            "id": node_id,
            "sandboxes": len(owned),
            "templates": [t.name for t in await templates.list()],
            "template_downloads": templates.downloads,
            "pool": usage,
            # Capacity, for placement: what the owned sandboxes may use against what there is.
            # The agent's cgroup limits (a pod's, a slice's), not the host's totals.
            "cpus": node_capacity().cpus,
            "memory_mb": warm.memory_mb if warm is not None else node_memory_mb(),
            "committed_cpu": round(sum(sb.cpu for sb in owned), 3),
            "committed_memory_mb": sum(sb.memory_mb for sb in owned),
            "loadavg": os.getloadavg()[0],
            "warm": warm.status() if warm is not None else [],
            "network": manager.egress is not None,
            # Sandboxes whose secrets this agent lost in a restart: the control plane pushes them.
            "egress_missing": (manager.egress.missing_secrets([sb.id for sb in owned])
                               if manager.egress is not None else []),
            # What of each sandbox's disk is durable in object storage, and as of when.
            "backups": manager.backups.status(),
            # The lease, and the sandboxes frozen because it ran out: the control plane releases
            # those it still places here and has this node discard the others.
            "fence": fence.status() if fence is not None else {"lease": None, "fenced": []},
        }

    @r.post("/sandboxes/{sandbox_id}/unfence")
    async def unfence(sandbox_id: str) -> dict[str, Any]:
        return sandbox_view(await manager.unfence(sandbox_id))

    async def _egress(sandbox_id: str, cfg: EgressConfig | None) -> None:
        if cfg is not None:
            await manager.set_egress(sandbox_id, tenant=cfg.tenant, policy=cfg.policy,
                                     tenant_policy=cfg.tenant_policy, ceiling=cfg.ceiling, secrets=cfg.secrets)

    @r.put("/sandboxes/{sandbox_id}/egress")
    async def set_egress(sandbox_id: str, body: EgressConfig) -> dict[str, Any]:
        manager.get(sandbox_id)
        await _egress(sandbox_id, body)
        return {"ok": True}

    def _gateway() -> Egress:
        if manager.egress is None:
            raise NotFound("this node runs sandboxes without network")
        return manager.egress

    @r.get("/egress/audit")
    async def egress_audit(after: int = 0, limit: int = 1000) -> dict[str, Any]:
        return await _gateway().gateway.client.call("audit", after=after, limit=min(limit, 5000))

    @r.post("/egress/audit/ack")
    async def egress_audit_ack(body: AuditAck) -> dict[str, Any]:
        return await _gateway().gateway.client.call("ack", upto=body.upto)

    # -- warm pool -------------------------------------------------------------------------

    def _warm() -> WarmPool:
        if warm is None:
            raise NotFound("this node keeps no warm pool")
        return warm

    @r.get("/pool")
    async def pool_status() -> dict[str, Any]:
        return {"pools": _warm().status()}

    @r.put("/pool")
    async def set_pool(body: PoolTargets) -> dict[str, Any]:
        return {"pools": _warm().set_targets([t.model_dump() for t in body.targets])}

    @r.post("/pool/claim")
    async def claim(body: ClaimRequest, after: BackgroundTasks) -> dict[str, Any]:
        sb = _warm().claim(PoolKey(body.template, body.cpu, body.memory_mb), body.env)
        if body.disk_mb is not None and body.disk_mb != sb.disk_mb:  # warm ones have the node's default
            await manager.set_disk_limit(sb.id, body.disk_mb)
        await _egress(sb.id, body.egress)
        if sb.env:  # before the answer: the owner's first call may need it (a claim without env pays nothing)
            await manager.publish_env(sb)
        # The claimed one was the pool's thawed head: it only needs its full CPU weight. The next
        # head is thawed once the answer is on its way (a waking sentry burns ~20 ms of CPU).
        after.add_task(manager.activate, sb.id)
        after.add_task(_warm().heat)
        return sandbox_view(sb)

    # -- templates -------------------------------------------------------------------------

    @r.get("/templates")
    async def list_templates() -> dict[str, Any]:
        return {"templates": [_template_view(t) for t in await templates.list()]}

    @r.post("/images/inspect")
    async def inspect_image(body: InspectImage) -> dict[str, Any]:
        """What an image reference names now, pinned by digest, with its config's template defaults
        (the root helper asks the registry; only the operator's registries are asked)."""
        with logins_fd({k: v.model_dump() for k, v in body.auth.items()}) as fds:
            return await templates.pool.priv.call("image.inspect", {"image": body.image}, fds=fds, timeout=150)

    @r.post("/templates/ensure")
    async def ensure_template(body: EnsureTemplate) -> StreamingResponse:
        """Builds or fetches a template; streams NDJSON progress lines, then the result line."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def progress(line: str) -> None:
            await queue.put(json.dumps({"log": line}).encode() + b"\n")

        async def work() -> None:
            try:
                info = await templates.ensure(body.spec, on_progress=progress, force=body.force,
                                              registry_auth={k: v.model_dump() for k, v in body.registry_auth.items()})
                await queue.put(json.dumps({"template": _template_view(info)}).encode() + b"\n")
            except SpaceError as exc:
                await queue.put(json.dumps(exc.to_wire()).encode() + b"\n")
            except Exception as exc:  # the stream is already 200: report in-band
                log.exception("template.ensure_failed")
                await queue.put(json.dumps({"error": {"code": "internal", "message": repr(exc)}}).encode() + b"\n")
            finally:
                await queue.put(None)

        async def body_iter() -> AsyncIterator[bytes]:
            task = asyncio.create_task(work())
            try:
                while (item := await queue.get()) is not None:
                    yield item
            finally:
                if not task.done():
                    # A dropped caller must not abandon a half-built template: let it finish.
                    await asyncio.shield(task)

        return StreamingResponse(body_iter(), media_type="application/x-ndjson")

    @r.post("/templates/save")
    async def save_template(body: SaveTemplate) -> dict[str, Any]:
        """A sandbox's snapshot as template ``name``, published to object storage (idempotent)."""
        info = await template_save.save_snapshot(templates, body.name, body.sandbox_id, body.snapshot)
        return {**_template_view(info), "spec": info.spec}

    # -- sandboxes -------------------------------------------------------------------------

    @r.get("/sandboxes")
    async def list_sandboxes() -> dict[str, Any]:
        return {"sandboxes": [sandbox_view(sb) for sb in manager.list()]}

    @r.put("/sandboxes/{sandbox_id}")
    async def create_sandbox(sandbox_id: str, body: CreateSandbox) -> dict[str, Any]:
        await _egress(sandbox_id, body.egress)
        sb = await manager.create(
            sandbox_id, template=body.template, cpu=body.cpu, memory_mb=body.memory_mb, env=body.env,
            disk_mb=body.disk_mb if body.disk_mb is not None else manager.default_disk_mb,
        )
        await _egress(sandbox_id, body.egress)  # again: a retry may have replaced a failed attempt
        return sandbox_view(sb)

    @r.get("/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str) -> dict[str, Any]:
        return sandbox_view(manager.get(sandbox_id))

    @r.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def delete_sandbox(sandbox_id: str, reason: Literal["moved"] | None = None) -> Response:
        await manager.delete(sandbox_id, reason=reason)
        return Response(status_code=204)

    # -- lifecycle -------------------------------------------------------------------------

    @r.post("/sandboxes/{sandbox_id}/pause")
    async def pause(sandbox_id: str) -> dict[str, Any]:
        return sandbox_view(await manager.pause(sandbox_id))

    @r.post("/sandboxes/{sandbox_id}/resume")
    async def resume(sandbox_id: str) -> dict[str, Any]:
        return sandbox_view(await manager.resume(sandbox_id))

    @r.get("/sandboxes/{sandbox_id}/snapshots")
    async def list_snapshots(sandbox_id: str) -> dict[str, Any]:
        return {"snapshots": [snapshot_view(s) for s in manager.list_snapshots(sandbox_id)]}

    @r.put("/sandboxes/{sandbox_id}/snapshots/{snap_id}")
    async def take_snapshot(sandbox_id: str, snap_id: str, body: SnapshotRequest) -> dict[str, Any]:
        snap = await manager.take_snapshot(sandbox_id, snap_id, body.kind, stay_paused=body.stay_paused)
        # The size takes a walk of the tree (``btrfs filesystem du``): asked for separately.
        return snapshot_view(snap)

    @r.get("/sandboxes/{sandbox_id}/snapshots/{snap_id}/size")
    async def snapshot_size(sandbox_id: str, snap_id: str) -> dict[str, Any]:
        return {"size_bytes": await manager.snapshot_size(sandbox_id, snap_id)}

    @r.delete("/sandboxes/{sandbox_id}/snapshots/{snap_id}", status_code=204)
    async def delete_snapshot(sandbox_id: str, snap_id: str) -> Response:
        await manager.delete_snapshot(sandbox_id, snap_id)
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/rollback")
    async def rollback(sandbox_id: str, body: RollbackRequest) -> dict[str, Any]:
        owner = body.source or sandbox_id
        await _egress(sandbox_id, body.egress)
        if body.prefix and snapshots.read(manager.pool, owner, body.snapshot) is None:
            if body.tenant is None:
                raise InvalidRequest("a rollback to a snapshot in object storage needs its tenant", field="tenant")
            await manager.fetch_snapshot(owner, body.snapshot, body.prefix, tenant=body.tenant,
                                         sealing=_spec(body.sealing))
        sb = await manager.rollback(sandbox_id, body.snapshot, token=body.token, source=body.source,
                                    disk_mb=body.disk_mb)
        await _egress(sandbox_id, body.egress)
        return sandbox_view(sb)

    @r.post("/sandboxes/{sandbox_id}/snapshots/{snap_id}/upload")
    async def upload_snapshot(sandbox_id: str, snap_id: str, body: UploadRequest) -> dict[str, Any]:
        return await manager.upload_snapshot(sandbox_id, snap_id, body.prefix, tenant=body.tenant,
                                             sealing=_spec(body.sealing))

    @r.post("/sandboxes/{sandbox_id}/reboot")
    async def reboot(sandbox_id: str, body: RebootRequest) -> dict[str, Any]:
        return sandbox_view(await manager.reboot(sandbox_id, token=body.token))

    @r.post("/sandboxes/{sandbox_id}/fork")
    async def fork(sandbox_id: str, body: ForkRequest) -> dict[str, Any]:
        await _egress(sandbox_id, body.egress)
        sb = await manager.fork(sandbox_id, body.source, body.snapshot, disk_mb=body.disk_mb)
        await _egress(sandbox_id, body.egress)
        return sandbox_view(sb)

    @r.post("/sandboxes/{sandbox_id}/suspend")
    async def suspend(sandbox_id: str, body: ShipRequest) -> dict[str, Any]:
        return await manager.suspend(sandbox_id, body.snapshot, body.prefix, kind=body.kind, tenant=body.tenant,
                                     sealing=_spec(body.sealing))

    @r.post("/sandboxes/{sandbox_id}/restore")
    async def restore(sandbox_id: str, body: ShipRequest) -> dict[str, Any]:
        await _egress(sandbox_id, body.egress)
        sb = await manager.restore(sandbox_id, body.snapshot, body.prefix, token=body.token, disk_mb=body.disk_mb,
                                   tenant=body.tenant, owner=body.source, sealing=_spec(body.sealing))
        await _egress(sandbox_id, body.egress)
        return sandbox_view(sb)

    @r.put("/sandboxes/{sandbox_id}/backup")
    async def configure_backup(sandbox_id: str, body: BackupConfig) -> dict[str, Any]:
        """Back the sandbox's disk up continuously under ``prefix`` (a chain of incremental links)."""
        return manager.backups.configure(sandbox_id, body.model_dump())

    @r.delete("/sandboxes/{sandbox_id}/backup")
    async def disable_backup(sandbox_id: str) -> dict[str, Any]:
        """Stop backing the sandbox up (its interval was turned off); shipped links stay."""
        manager.get(sandbox_id)
        await manager.backups.disable(sandbox_id)
        return {"id": sandbox_id, "backup": None}

    @r.post("/sandboxes/{sandbox_id}/backup")
    async def back_up_now(sandbox_id: str) -> dict[str, Any]:
        """Look now (ship a link if the disk changed): before a planned move, and for tests."""
        manager.get(sandbox_id)
        return await manager.backups.back_up(sandbox_id)

    @r.post("/objects/key-check")
    async def key_check(body: KeyCheckRequest) -> dict[str, Any]:
        """Make (and drop) a data key under the tenant's new key: key_unavailable if its KMS
        refuses, before the control plane stores the key."""
        ref = KeyRef.from_json(body.key)
        if manager.data_keys is None:
            raise KeyUnavailable(f"this node has no key providers configured for {ref.provider} key {ref.key_id}",
                                 key=ref.key_id, provider=ref.provider)
        await manager.data_keys.new(ref, {"tenant": body.tenant, "purpose": "key-check"})
        return {"key": ref.to_json(), "usable": True}

    @r.post("/objects/rewrap")
    async def rewrap(body: RewrapRequest) -> dict[str, Any]:
        """Re-wrap one shipped snapshot's data key under the tenant's new key (a rotation)."""
        if body.chain is not None and body.seq is not None and body.snapshot_id is None:
            snapshot_id = backup_chain.link_id(body.chain, body.seq)
            prefix = backup_chain.link_prefix(body.prefix, body.chain, body.seq)
        elif body.snapshot_id is not None and body.chain is None and body.seq is None:
            snapshot_id, prefix = body.snapshot_id, body.prefix
        else:
            raise InvalidRequest("name a snapshot (snapshot_id) or a backup link (chain and seq), not both")
        before = await manager.rewrap(tenant=body.tenant, sandbox_id=body.sandbox_id, snapshot_id=snapshot_id,
                                      prefix=prefix, to=KeyRef.from_json(body.key))
        return {"prefix": prefix, "rewrapped": before is not None,
                "from": None if before is None else before.to_json()}

    @r.post("/sandboxes/{sandbox_id}/restore-backup")
    async def restore_backup(sandbox_id: str, body: BackupRestoreRequest) -> dict[str, Any]:
        """The sandbox on this node from its disk backup (its node was lost): processes restarted."""
        await _egress(sandbox_id, body.egress)
        sb = await manager.restore_backup(sandbox_id, prefix=body.prefix, chain=body.chain, seq=body.seq,
                                          tenant=body.tenant, token=body.token, disk_mb=body.disk_mb,
                                          sealing=_spec(body.sealing))
        await _egress(sandbox_id, body.egress)
        return sandbox_view(sb)

    @r.get("/sandboxes/{sandbox_id}/stats")
    async def sandbox_stats(sandbox_id: str) -> dict[str, Any]:
        sb = manager.get(sandbox_id)
        if sb.status != "running" or sb.instance_id is None:
            raise InvalidState(f"sandbox {sandbox_id} is {sb.status}", state=sb.status, allowed=[])
        return await stats.sample(sb.instance_id, cpu_count=sb.cpu, memory_mb=sb.memory_mb)

    @r.get("/sandboxes/{sandbox_id}/activity")
    async def activity(sandbox_id: str) -> dict[str, Any]:
        return await manager.activity(sandbox_id)

    # -- commands --------------------------------------------------------------------------

    @r.post("/sandboxes/{sandbox_id}/commands", status_code=201)
    async def start_command(sandbox_id: str, body: ExecRequest) -> dict[str, Any]:
        if (body.cmd is None) == (body.shell is None):
            raise InvalidRequest("give exactly one of 'cmd' (argv list) or 'shell' (string)")
        if body.cmd is not None and not body.cmd:
            raise InvalidRequest("'cmd' must not be empty")
        sb = manager.get(sandbox_id)
        conn = await manager.guest(sandbox_id)
        env, workdir = await manager.exec_defaults(sb)
        cid = body.id or ids.command_id()
        args: dict[str, Any] = {
            "cmd": cid,
            "argv": body.cmd,
            "shell": body.shell,
            "env": {**env, **body.env},
            "cwd": body.cwd if body.cwd is not None else workdir,
            "user": body.user if body.user is not None else sb.user,
            "pty": body.pty,
            "stdin": body.stdin,
            # ``timeout`` is the request deadline of GuestConnection.request; the kill timer is this.
            "kill_after": body.timeout,
        }
        if body.buffer_bytes:
            args["buffer_bytes"] = body.buffer_bytes
        res = await conn.request("exec", **args)
        argv = body.cmd if body.cmd is not None else ["/bin/bash", "-lc", body.shell or ""]
        return {"id": cid, "pid": res.get("pid"), "argv": argv, "state": "running",
                "started_at": res.get("started_at")}

    @r.get("/sandboxes/{sandbox_id}/commands")
    async def list_commands(sandbox_id: str) -> dict[str, Any]:
        conn = await manager.guest(sandbox_id)
        res = await conn.request("list")
        return {"commands": res.get("commands", [])}

    @r.get("/sandboxes/{sandbox_id}/commands/{cid}")
    async def get_command(sandbox_id: str, cid: str) -> dict[str, Any]:
        conn = await manager.guest(sandbox_id)
        for c in (await conn.request("list")).get("commands", []):
            if c.get("id") == cid:
                return dict(c)
        raise NotFound(f"command {cid} not found", command_id=cid)

    @r.get("/sandboxes/{sandbox_id}/commands/{cid}/events")
    async def command_events(sandbox_id: str, cid: str, request: Request, after: int = 0) -> StreamingResponse:
        conn = await manager.guest(sandbox_id)
        wire = event_wire(request.headers.get("accept"))
        events = conn.events(cid, after=after)
        # A small queue between the guest and the client: big enough to keep the stream flowing,
        # small enough that a slow client still holds back the guest's acks (backpressure).
        queue: asyncio.Queue[_StreamItem] = asyncio.Queue(maxsize=16)

        exited = False

        async def pump() -> None:
            nonlocal exited
            try:
                async for header, payload in events:
                    exited = exited or header.get("kind") == "exit"
                    await queue.put(guest_event(header, payload, wire))
            except SpaceError as exc:
                await queue.put(exc)
            await queue.put(None)

        def moved() -> bytes | None:
            """The ``moved`` event, if the stream ended because the sandbox left for another node:
            the client reconnects (``Last-Event-ID``) and the control plane routes it there."""
            if manager.departure(sandbox_id) != "moved":
                return None
            return wire.event("moved", {"sandbox_id": sandbox_id, "retry": True,
                                        "message": "the sandbox moved to another node: reconnect to continue"}, None)

        async def stream_error(exc: SpaceError) -> bytes | None:
            """A stream that broke: ``moved`` if the sandbox left for another node, an ``error``
            event if it died, else a plain end (retry)."""
            if (event := moved()) is not None:
                return event
            err = exc
            try:
                await manager.check_alive(manager.get(sandbox_id), settle=3.0)
            except SpaceError as dead:
                err = dead
            return None if err.retryable else wire.event("error", err.to_wire()["error"], None)

        async def stop(task: asyncio.Task[None]) -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await events.aclose()

        task = asyncio.create_task(pump())
        # Wait a moment for the first event so that an unknown command is a clean 404; a command
        # that is quiet for longer gets its 200 and keepalives.
        try:
            first = await asyncio.wait_for(queue.get(), timeout=min(sse_keepalive, 0.5))
        except TimeoutError:
            first = b""
        except BaseException:
            await stop(task)
            raise
        if isinstance(first, SpaceError) and not first.retryable and not isinstance(first, RuntimeFailure):
            await stop(task)
            raise first

        async def body_iter() -> AsyncIterator[bytes]:
            # ``exited`` (set by the pump) is read only once the queue has delivered its end, and
            # the pump queues the exit event before that end.
            item = first
            try:
                while True:
                    if item is None:
                        if not exited and (event := moved()) is not None:
                            yield event
                        return
                    if isinstance(item, SpaceError):
                        last = await stream_error(item)
                        if last:
                            yield last
                        return
                    if item:
                        data, after = _batch(item, queue)
                        yield data
                        if after:
                            item = after[0]
                            continue
                    try:
                        item = await asyncio.wait_for(queue.get(), timeout=sse_keepalive)
                    except TimeoutError:
                        # Quiet commands run for hours: keep proxies and clients from timing out.
                        yield wire.keepalive
                        item = b""
            finally:
                await stop(task)

        return StreamingResponse(body_iter(), media_type=wire.media_type, headers={"cache-control": "no-store"})

    @r.post("/sandboxes/{sandbox_id}/commands/{cid}/stdin", status_code=204)
    async def command_stdin(sandbox_id: str, cid: str, request: Request, eof: bool = False) -> Response:
        conn = await manager.guest(sandbox_id)
        data = await request.body()
        if len(data) > 16 * 1024 * 1024:
            raise PayloadTooLarge("stdin writes are limited to 16 MiB per request")
        chunks = [data[i : i + MAX_PAYLOAD] for i in range(0, len(data), MAX_PAYLOAD)] or [b""]
        for i, chunk in enumerate(chunks):
            await conn.request("stdin", chunk, cmd=cid, eof=eof and i == len(chunks) - 1)
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/commands/{cid}/signal", status_code=204)
    async def command_signal(sandbox_id: str, cid: str, body: SignalRequest) -> Response:
        sig = body.signal
        if isinstance(sig, str):
            name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
            if not hasattr(signal_mod, name):
                raise InvalidRequest(f"unknown signal {sig!r}")
        conn = await manager.guest(sandbox_id)
        await conn.request("signal", cmd=cid, signal=sig)
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/commands/{cid}/resize", status_code=204)
    async def command_resize(sandbox_id: str, cid: str, body: ResizeRequest) -> Response:
        conn = await manager.guest(sandbox_id)
        await conn.request("resize", cmd=cid, rows=body.rows, cols=body.cols)
        return Response(status_code=204)

    # -- files -----------------------------------------------------------------------------

    @r.get("/sandboxes/{sandbox_id}/files")
    async def read_file(sandbox_id: str, path: str) -> StreamingResponse:
        p = paths.normalize(path)
        conn = await manager.guest(sandbox_id)
        stream = conn.stream("fs.read", path=p)
        it = aiter(stream)
        first = await anext(it, None)  # errors (not found, a directory) surface before the 200

        async def body_iter() -> AsyncIterator[bytes]:
            try:
                if first is None:
                    return
                yield first[1]
                async for _, payload in it:
                    yield payload
            finally:
                await stream.aclose()

        return StreamingResponse(body_iter(), media_type="application/octet-stream")

    @r.put("/sandboxes/{sandbox_id}/files")
    async def write_file(sandbox_id: str, path: str, request: Request, user: str | None = None,
                         atomic: bool = True) -> dict[str, Any]:
        """Upload the body to ``path``, owned by ``user`` (default: the sandbox's user): through a
        temporary file renamed into place, or (``atomic=false``, E2B's way) truncated and written."""
        p = paths.normalize(path)
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > max_upload_bytes:
            raise PayloadTooLarge(f"upload larger than the limit of {max_upload_bytes} bytes",
                                  limit=max_upload_bytes)
        conn = await manager.guest(sandbox_id)
        sb = manager.get(sandbox_id)

        async def limited() -> AsyncIterator[bytes]:
            total = 0
            async for chunk in request.stream():
                total += len(chunk)
                if total > max_upload_bytes:
                    raise PayloadTooLarge(f"upload larger than the limit of {max_upload_bytes} bytes",
                                          limit=max_upload_bytes)
                yield chunk

        try:
            res = await conn.upload("fs.write", limited(), path=p, user=user or sb.user, atomic=atomic)
        except ClientDisconnect:
            # The API aborted the upload (over its limit, a bad gzip body): the guest has dropped
            # its temporary file; nobody is left to answer.
            raise InvalidRequest("the upload was aborted by its sender") from None
        return dict(res.get("entry", {}))

    @r.get("/sandboxes/{sandbox_id}/files/list")
    async def list_files(sandbox_id: str, path: str, depth: int = 1) -> dict[str, Any]:
        if not 1 <= depth <= 32:
            raise InvalidRequest("depth must be between 1 and 32")
        conn = await manager.guest(sandbox_id)
        res = await conn.request("fs.list", path=paths.normalize(path), depth=depth)
        return {"entries": res.get("entries", [])}

    @r.get("/sandboxes/{sandbox_id}/files/stat")
    async def stat_file(sandbox_id: str, path: str) -> dict[str, Any]:
        conn = await manager.guest(sandbox_id)
        res = await conn.request("fs.stat", path=paths.normalize(path))
        return dict(res.get("entry", {}))

    @r.post("/sandboxes/{sandbox_id}/files/mkdir")
    async def mkdir(sandbox_id: str, body: PathRequest) -> dict[str, Any]:
        conn = await manager.guest(sandbox_id)
        sb = manager.get(sandbox_id)
        res = await conn.request("fs.mkdir", path=paths.normalize(body.path), parents=True,
                                 user=body.user or sb.user)
        return dict(res.get("entry", {}))

    @r.post("/sandboxes/{sandbox_id}/files/move")
    async def move(sandbox_id: str, body: MoveRequest) -> dict[str, Any]:
        conn = await manager.guest(sandbox_id)
        res = await conn.request("fs.move", src=paths.normalize(body.src), dst=paths.normalize(body.dst))
        return dict(res.get("entry", {}))

    @r.delete("/sandboxes/{sandbox_id}/files", status_code=204)
    async def remove(sandbox_id: str, path: str, recursive: bool = False) -> Response:
        conn = await manager.guest(sandbox_id)
        await conn.request("fs.remove", path=paths.normalize(path), recursive=recursive)
        return Response(status_code=204)

    app.include_router(r)
    app.include_router(watch_router(manager), prefix="/v1", dependencies=[Depends(auth)])
    app.include_router(ports_router(manager), prefix="/v1", dependencies=[Depends(auth)])
    app.include_router(port_websocket_router(manager), prefix="/v1", dependencies=[Depends(auth)])
    return app


def _template_view(t: Any) -> dict[str, Any]:
    return {
        "name": t.name,
        "digest": t.digest,
        "size_bytes": getattr(t, "size_bytes", None),
        "created_at": str(getattr(t, "created_at", "")),
        "spec": getattr(t, "spec", None) or {},
    }
