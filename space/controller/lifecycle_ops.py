"""Operation handlers for the stateful lifecycle: pause, resume, snapshots, suspend, restore,
rollback, fork and crash recovery.

Every handler is idempotent (a crashed controller's operation is run again by the next claim): it
reads the rows, skips what is already done and asks the node, whose calls are idempotent too.
State changes go through :func:`space.lifecycle.transition` inside the store (``expect`` guards).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import structlog

from space.controller.egress import egress_config
from space.controller.nodes import NodeRegistry
from space.controller.prefixes import object_prefix, retained_prefix, sandbox_prefix
from space.controller.sealing import Sealer
from space.errors import Conflict, InvalidState, NotFound, ObjectTampered, SnapshotCorrupt, SpaceError, Unavailable
from space.lifecycle import State
from space.node.api.client import NodeClient
from space.objstore import ObjectStore
from space.store import Operation, Sandbox, Snapshot, Store, fencing
from space.store.models import AuditRecord

if TYPE_CHECKING:
    from space.controller.backups import BackupSync
    from space.credentials.manager import CredentialManager

log = structlog.get_logger("space.controller.lifecycle")

#: Node calls that move memory images and file system deltas get long deadlines.
LONG = 3600.0
#: Forks of one request booted at the same time.
FORK_PARALLEL = 4


class LifecycleOps:
    def __init__(self, store: Store, nodes: NodeRegistry, objects: ObjectStore | None) -> None:
        self.store = store
        self.nodes = nodes
        self.objects = objects
        #: What every request that ships or fetches a snapshot says of its encryption.
        self.sealer = Sealer(store)
        #: Resolves the secrets a sandbox's gateway entry carries (None: no secrets configured).
        self.credentials: CredentialManager | None = None
        self._background: set[asyncio.Task[None]] = set()
        #: Node copies of just-suspended sandboxes being removed; a restore waits for its own.
        self._evictions: dict[str, asyncio.Task[None]] = {}
        #: Continuous backup (set by the controller): with it on, scheduled full checkpoints are
        #: uploaded too, so that a lost node's sandboxes come back with their memory.
        self.backups: BackupSync | None = None

    async def egress(self, sb: Sandbox) -> dict[str, Any]:
        return await egress_config(self.store, self.credentials, sb)

    def handlers(self) -> dict[str, Any]:
        return {
            "sandbox.pause": self.pause,
            "sandbox.resume": self.resume,
            "snapshot.create": self.create_snapshot,
            "snapshot.delete": self.delete_snapshot,
            "sandbox.suspend": self.suspend,
            "sandbox.restore": self.restore,
            "sandbox.rollback": self.rollback,
            "sandbox.recover": self.recover,
            "sandbox.fork": self.fork,
        }

    async def _node_of(self, sb: Sandbox) -> NodeClient:
        if sb.node_id is None:
            raise InvalidState(f"sandbox {sb.id} is on no node", state=str(sb.state), allowed=[])
        return await self.nodes.client(sb.node_id)

    async def event(self, sb: Sandbox, what: str, message: str, **data: Any) -> None:
        await self.store.add_event(sb.id, sb.tenant, what, message, data)
        log.info("sandbox.event", sandbox=sb.id, what=what, message=message)

    async def moved(self, sb: Sandbox, state: State, *, expect: list[State], event: tuple[str, str, dict[str, Any]],
                    **fields: Any) -> Sandbox:
        """The sandbox's new state and the event that says so, in one write."""
        moved = await self.store.set_sandbox_state(sb.id, state, expect=expect, event=event, **fields)
        log.info("sandbox.event", sandbox=sb.id, what=event[0], message=event[1])
        return moved

    # -- pause / resume ------------------------------------------------------------------------

    async def pause(self, op: Operation) -> dict[str, Any]:
        sb = await self.store.get_sandbox(op.target)
        if sb.state != State.PAUSED:
            if sb.state != State.RUNNING:
                raise InvalidState(f"cannot pause a sandbox that is {sb.state}", state=str(sb.state), allowed=[])
            node = await self._node_of(sb)
            await node.call("POST", f"/v1/sandboxes/{sb.id}/pause")
            why = "idle" if op.request.get("idle") else op.request.get("reason") or "request"
            # A pause for a timeout ends that timeout in the same write (policies keep it until then).
            ended = {"expires_at": None} if why == "timeout" else {}
            sb = await self.moved(sb, State.PAUSED, expect=[State.RUNNING],
                                  event=("paused", f"paused ({why})", {"reason": why}), **ended)
        return {"sandbox_id": sb.id, "state": str(sb.state)}

    async def resume(self, op: Operation) -> dict[str, Any]:
        sb = await self.store.get_sandbox(op.target)
        if sb.state != State.RUNNING:
            if sb.state != State.PAUSED:
                raise InvalidState(f"cannot resume a sandbox that is {sb.state}", state=str(sb.state), allowed=[])
            node = await self._node_of(sb)
            await node.call("POST", f"/v1/sandboxes/{sb.id}/resume")
            sb = await self.moved(sb, State.RUNNING, expect=[State.PAUSED], last_active_at=_now(),
                                  event=("resumed", "resumed" + (" by a call that needed it" if op.request.get("wake")
                                                                 else ""), {}))
        else:
            await self.store.touch_sandbox(sb.id, _now())
        return {"sandbox_id": sb.id, "state": str(sb.state)}

    # -- snapshots -----------------------------------------------------------------------------

    async def _take(self, sb: Sandbox, snap: Snapshot) -> Snapshot:
        """Take ``snap`` on the sandbox's node and record it ready (idempotent). A retained one is
        uploaded first: it is ready only once it can outlive the node's copy."""
        if snap.status == "ready":
            return snap
        if sb.state not in (State.RUNNING, State.PAUSED):
            raise InvalidState(f"cannot snapshot a sandbox that is {sb.state}", state=str(sb.state), allowed=[])
        node = await self._node_of(sb)
        info = await node.call("PUT", f"/v1/sandboxes/{sb.id}/snapshots/{snap.id}",
                               json_body={"kind": snap.kind}, timeout=LONG)
        fields: dict[str, Any] = {"meta": {k: info.get(k) for k in ("freeze_ms", "took_ms", "image_bytes")}}
        key = None
        if snap.retain:
            key = retained_prefix(snap)
        elif (snap.kind == "full" and snap.origin == "schedule" and self.backups is not None
              and await self.backups.interval(sb) is not None):
            key = object_prefix(sb, snap.id)  # the memory half of the continuous backup
        if key is not None:
            res = await node.call("POST", f"/v1/sandboxes/{sb.id}/snapshots/{snap.id}/upload",
                                  json_body={"prefix": key, "tenant": snap.tenant,
                                             "sealing": await self.sealer.for_snapshot(snap, key)}, timeout=LONG)
            fields["object_key"] = key
            fields["meta"].update(uploaded_bytes=res.get("bytes"))
        snap = await self.store.update_snapshot(snap.id, status="ready", restorable=True, node_id=sb.node_id,
                                                **fields)
        if key is not None and not snap.retain:
            await self.store.record_backup(sb.id, None, {"memory_at": snap.created_at.isoformat(),
                                                         "memory_snapshot": snap.id})
        # Its size needs a walk of the tree: filled in after the operation answers.
        self._spawn(self._fill_size(node, sb.id, snap.id))
        return snap

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        # It outlives the operation: its writes are not fenced by the operation's lease.
        task = asyncio.create_task(work, context=fencing.unfenced_context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _evict(self, node: NodeClient, sandbox_id: str) -> None:
        try:
            await self._remove_copy(node, sandbox_id)
        except SpaceError as exc:
            log.warning("sandbox.evict_failed", sandbox=sandbox_id, error=str(exc))
        finally:
            self._evictions.pop(sandbox_id, None)

    async def _remove_copy(self, node: NodeClient, sandbox_id: str) -> None:
        """Remove a node's stale copy of a sandbox and record that it is gone."""
        with contextlib.suppress(NotFound):  # gone already
            await node.call("DELETE", f"/v1/sandboxes/{sandbox_id}", timeout=LONG)
        await self.store.clear_eviction(sandbox_id, node.node_id)

    async def finish_eviction(self, sb: Sandbox) -> str | None:
        """Before a restore: the suspend's old copy is gone. It was being removed by this process
        (waited for), or by another controller that may have crashed (the row still names its
        node: removed here). Returns a node still holding a copy it could not reach: the restore
        goes elsewhere (reconcile removes that copy when the node is back)."""
        pending = self._evictions.get(sb.id)
        if pending is not None:
            await asyncio.shield(pending)
        sb = await self.store.get_sandbox(sb.id)
        if sb.evict_node is None:
            return None
        try:
            await self._remove_copy(await self.nodes.client(sb.evict_node), sb.id)
        except Unavailable as exc:
            log.warning("sandbox.evict_deferred", sandbox=sb.id, node=sb.evict_node, error=str(exc))
            return sb.evict_node
        return None

    async def _fill_size(self, node: NodeClient, sandbox_id: str, snap_id: str) -> None:
        try:
            res = await node.call("GET", f"/v1/sandboxes/{sandbox_id}/snapshots/{snap_id}/size", timeout=LONG)
            if res.get("size_bytes") is not None:
                await self.store.update_snapshot(snap_id, size_bytes=int(res["size_bytes"]))
        except SpaceError as exc:
            log.info("snapshot.size_unknown", snapshot=snap_id, error=str(exc))

    async def create_snapshot(self, op: Operation) -> dict[str, Any]:
        snap = await self.store.get_snapshot(op.request["snapshot"])
        sb = await self.store.get_sandbox(op.target)
        snap = await self._take(sb, snap)
        return {"snapshot": snap.id, "kind": snap.kind}

    async def delete_snapshot(self, op: Operation) -> dict[str, Any]:
        snap = await self.store.get_snapshot(op.request["snapshot"])
        await self.remove_snapshot(snap)
        return {"snapshot": snap.id}

    async def remove_snapshot(self, snap: Snapshot) -> None:
        if snap.status == "deleted":
            return
        if snap.node_id is not None:
            with contextlib.suppress(NotFound):
                node = await self.nodes.client(snap.node_id)
                await node.call("DELETE", f"/v1/sandboxes/{snap.sandbox_id}/snapshots/{snap.id}")
        if snap.object_key is not None and snap.object_key == retained_prefix(snap):
            # Its keys go first: whatever of it survives below (a failure, a copy of the bucket)
            # cannot be decrypted any more.
            await self.store.destroy_shred(snapshot_id=snap.id)
        if snap.object_key is not None and self.objects is not None:
            await self.objects.delete_prefix(snap.object_key + "/")
        await self.store.delete_snapshot_row(snap.id)

    # -- suspend / restore ---------------------------------------------------------------------

    async def suspend(self, op: Operation) -> dict[str, Any]:
        sb = await self.store.get_sandbox(op.target)
        snap_id = str(op.request["snapshot"])
        if sb.state == State.SUSPENDED:
            return {"sandbox_id": sb.id, "snapshot": snap_id}
        if sb.state != State.SUSPENDING:
            raise Conflict(f"sandbox {sb.id} is {sb.state}, not suspending", state=str(sb.state))
        node = await self._node_of(sb)
        prefix = object_prefix(sb, snap_id)
        res = await node.call("POST", f"/v1/sandboxes/{sb.id}/suspend",
                              json_body={"snapshot": snap_id, "prefix": prefix, "tenant": sb.tenant,
                                         "kind": "full" if op.request.get("memory", True) else "disk",
                                         "sealing": await self.sealer.for_sandbox(sb)},
                              timeout=LONG)
        # Restorable only now: every artifact and the manifest are in object storage.
        await self.store.update_snapshot(snap_id, status="ready", restorable=True, object_key=prefix,
                                         node_id=None, size_bytes=res.get("bytes"),
                                         meta={"uploaded_bytes": res.get("bytes"), "artifacts": res.get("artifacts")})
        await self.carry_snapshots(sb, node, keep=snap_id, why="suspended")
        old_node = sb.node_id
        # The row names the node that holds the old copy until its removal is confirmed: a restore
        # claimed by another controller (this one may crash right after) removes it first.
        sb = await self.store.set_sandbox_state(sb.id, State.SUSPENDED, expect=[State.SUSPENDING],
                                                node_id=None, instance_id=None, snapshot_id=snap_id,
                                                evict_node=old_node)
        await self.event(sb, "suspended", f"suspended to object storage as snapshot {snap_id} "
                         f"({(res.get('bytes') or 0) / 1e6:.1f} MB uploaded)", snapshot=snap_id, node=old_node,
                         reason="idle" if op.request.get("idle") else "request")
        # Only now may the node's copy go. It is not waited for (removing a runtime instance takes
        # over a second); if it fails, reconcile removes the copy: nobody wants it any more.
        self._evictions[sb.id] = asyncio.create_task(self._evict(node, sb.id), context=fencing.unfenced_context())
        return {"sandbox_id": sb.id, "snapshot": snap_id, "uploaded_bytes": res.get("bytes")}

    async def carry_snapshots(self, sb: Sandbox, node: NodeClient, *, keep: str, why: str) -> None:
        """Before the sandbox's copy on ``node`` goes (a suspend, a move): the user's own snapshots
        there travel with the sandbox (uploaded); the schedule's stay behind (``keep``, the
        snapshot just taken, is newer than all of them). Idempotent."""
        for other in await self.store.list_snapshots(sandbox_id=sb.id, node_id=node.node_id,
                                                     statuses=["creating", "ready"]):
            if other.id == keep:
                continue
            if other.object_key is not None:
                # Already in object storage (retained, or an earlier suspend's): only the node's
                # copy goes, with the eviction.
                await self.store.update_snapshot(other.id, node_id=None)
                continue
            if other.origin == "manual" and other.status == "ready":
                key = object_prefix(sb, other.id)
                await node.call("POST", f"/v1/sandboxes/{sb.id}/snapshots/{other.id}/upload",
                                json_body={"prefix": key, "tenant": other.tenant,
                                           "sealing": await self.sealer.for_snapshot(other, key)}, timeout=LONG)
                await self.store.update_snapshot(other.id, object_key=key, node_id=None)
            else:
                await self.store.update_snapshot(other.id, status="deleted", restorable=False, node_id=None,
                                                 error=f"evicted from its node when the sandbox was {why}")

    async def suspend_failed(self, op: Operation, exc: SpaceError) -> None:
        """Put the sandbox back as it was: a failed suspend loses nothing."""
        snap_id = op.request.get("snapshot")
        if snap_id:
            with contextlib.suppress(SpaceError):
                await self.store.update_snapshot(str(snap_id), status="failed", restorable=False, error=exc.message)
        sb = await self.store.get_sandbox(op.target)
        if sb.state != State.SUSPENDING:
            return
        back = State.PAUSED  # the suspend froze it; paused is the truth unless it resumes
        if op.request.get("from_state") == State.RUNNING.value:
            with contextlib.suppress(SpaceError):
                node = await self._node_of(sb)
                await node.call("POST", f"/v1/sandboxes/{sb.id}/resume")
                back = State.RUNNING
        sb = await self.store.set_sandbox_state(sb.id, back, expect=[State.SUSPENDING])
        await self.event(sb, "suspend_failed", f"suspend failed, the sandbox is {back.value} again: {exc.message}")

    async def restore(self, op: Operation) -> dict[str, Any]:
        sb = await self.store.get_sandbox(op.target)
        if sb.state == State.RUNNING:
            return {"sandbox_id": sb.id, "node_id": sb.node_id}
        if sb.state != State.RESTORING:
            raise Conflict(f"sandbox {sb.id} is {sb.state}, not restoring", state=str(sb.state))
        snap_id = sb.snapshot_id or op.request.get("snapshot")
        if not snap_id:
            raise SnapshotCorrupt(f"sandbox {sb.id} has no snapshot to restore from")
        snap = await self.store.get_snapshot(str(snap_id))
        if not snap.restorable or snap.object_key is None:
            raise SnapshotCorrupt(f"snapshot {snap.id} was never completely uploaded; it cannot be restored",
                                  snapshot_id=snap.id)
        # The old copy must be gone before a new one arrives, on its node at least.
        stale = await self.finish_eviction(sb)
        if sb.node_id is not None:
            node = await self.nodes.client(sb.node_id)
        elif op.request.get("node"):
            node = await self.nodes.client(str(op.request["node"]))
        else:
            node = await self.nodes.schedule(exclude=stale)
        if stale is not None and node.node_id == stale:
            raise Unavailable(f"node {stale} still holds sandbox {sb.id}'s old copy and cannot be reached")
        # Placement is recorded first, so that a retry goes to the same node.
        sb = await self.store.update_sandbox(sb.id, node_id=node.node_id)
        info = await node.call("POST", f"/v1/sandboxes/{sb.id}/restore",
                               json_body={"snapshot": snap.id, "prefix": snap.object_key, "token": op.id,
                                          "disk_mb": sb.disk_mb, "tenant": snap.tenant, "source": snap.sandbox_id,
                                          "egress": await self.egress(sb),
                                          "sealing": await self.sealer.for_snapshot(snap)},
                               timeout=LONG)
        await self.store.update_snapshot(snap.id, node_id=node.node_id)
        sb = await self.store.set_sandbox_state(sb.id, State.RUNNING, expect=[State.RESTORING],
                                                instance_id=info.get("instance_id"), snapshot_id=None)
        await self.store.touch_sandbox(sb.id, _now())
        await self.event(sb, "restored", f"restored from snapshot {snap.id} on node {node.node_id}",
                         snapshot=snap.id, node=node.node_id, timings=info.get("timings"))
        return {"sandbox_id": sb.id, "node_id": node.node_id, "timings": info.get("timings", {})}

    async def restore_failed(self, op: Operation, exc: SpaceError) -> None:
        """A restore that fails leaves the sandbox suspended, with the reason."""
        sb = await self.store.get_sandbox(op.target)
        if sb.state != State.RESTORING:
            return
        sb = await self.store.set_sandbox_state(sb.id, State.SUSPENDED, expect=[State.RESTORING], node_id=None,
                                                error_code=exc.code, error_message=exc.message)
        await self.event(sb, "restore_failed", f"restore failed, the sandbox stays suspended: {exc.message}")

    # -- rollback and crash recovery -----------------------------------------------------------

    async def rollback(self, op: Operation) -> dict[str, Any]:
        sb = await self.store.get_sandbox(op.target)
        snap = await self.store.get_snapshot(str(op.request["snapshot"]))
        if sb.state == State.RUNNING and op.attempts > 1:
            return {"sandbox_id": sb.id, "snapshot": snap.id}
        if sb.state != State.RESTORING:
            raise Conflict(f"sandbox {sb.id} is {sb.state}, not restoring", state=str(sb.state))
        info = await self._reset(sb, snap, op)
        sb = await self.store.set_sandbox_state(sb.id, State.RUNNING, expect=[State.RESTORING],
                                                instance_id=info.get("instance_id"))
        what = "files and processes" if snap.kind == "full" else "files (processes started afresh)"
        await self.event(sb, "rolled_back", f"rolled back to {snap.kind} snapshot {snap.id}: {what}",
                         snapshot=snap.id, snapshot_kind=snap.kind)
        return {"sandbox_id": sb.id, "snapshot": snap.id, "timings": info.get("timings", {})}

    async def _reset(self, sb: Sandbox, snap: Snapshot, op: Operation) -> dict[str, Any]:
        node = await self._node_of(sb)
        remote = snap.node_id != sb.node_id
        if remote and snap.object_key is None:
            raise Conflict(f"snapshot {snap.id} is neither on node {sb.node_id} nor in object storage")
        result: dict[str, Any] = await node.call(
            "POST", f"/v1/sandboxes/{sb.id}/rollback",
            json_body={"snapshot": snap.id, "source": snap.sandbox_id, "token": op.id,
                       "prefix": snap.object_key if remote else None, "disk_mb": sb.disk_mb, "tenant": snap.tenant,
                       "egress": await self.egress(sb) if remote else None,
                       "sealing": await self.sealer.for_snapshot(snap) if remote else None}, timeout=LONG)
        if remote:
            await self.store.update_snapshot(snap.id, node_id=sb.node_id)  # now on this node too
        return result

    async def rollback_failed(self, op: Operation, exc: SpaceError) -> None:
        sb = await self.store.get_sandbox(op.target)
        if sb.state != State.RESTORING:
            return
        back = op.request.get("from_state")
        if isinstance(exc, ObjectTampered) and back in (State.RUNNING.value, State.PAUSED.value):
            # Refused while its manifest was verified, before the node touched the sandbox: it
            # runs on as it was, and a rollback after the bucket is repaired can still be made.
            sb = await self.store.set_sandbox_state(sb.id, State(back), expect=[State.RESTORING],
                                                    error_code=exc.code, error_message=exc.message)
            await self.event(sb, "rollback_failed", f"rollback refused, the sandbox is {back} as before: "
                             f"{exc.message}")
            return
        await self.store.set_sandbox_state(sb.id, State.FAILED, expect=[State.RESTORING],
                                           error_code=exc.code, error_message=exc.message)

    def _sandboxes_of(self, op: Operation) -> list[str]:
        if op.kind == "sandbox.fork":
            return [str(s) for s in op.request.get("sandbox_ids") or []]
        return [op.target] if op.kind.startswith("sandbox.") else []

    async def key_refused(self, op: Operation, exc: SpaceError) -> None:
        """A tenant's key refused (:class:`KeyUnavailable`): an event naming it on every sandbox the
        operation was for. Nothing was restored and no other key was tried."""
        key, provider = str(exc.details.get("key") or ""), str(exc.details.get("provider") or "")
        for sid in self._sandboxes_of(op):
            with contextlib.suppress(NotFound):
                sb = await self.store.get_sandbox(sid)
                await self.event(sb, "key_unavailable", f"{provider} key {key} refused: {exc.message}",
                                 key=key, provider=provider, operation=op.id, kind=op.kind)
        log.warning("kms.key_unavailable", key=key, provider=provider, operation=op.id, kind=op.kind)

    async def tampered(self, op: Operation, exc: SpaceError) -> None:
        """Object storage held something this deployment did not write (:class:`ObjectTampered`):
        an event on every sandbox the operation was for, and an audit record for the operator."""
        key = str(exc.details.get("key") or "")
        reason = str(exc.details.get("reason") or "")
        sandboxes = self._sandboxes_of(op)
        for sid in sandboxes:
            with contextlib.suppress(NotFound):
                sb = await self.store.get_sandbox(sid)
                await self.event(sb, "object_tampered", f"refused what object storage holds at {key}: {exc.message}",
                                 key=key, reason=reason, operation=op.id)
        await self.store.record_audit([AuditRecord(
            tenant=op.tenant, actor="system", action="objstore.tampered", target=key, result=exc.code,
            status=exc.status, details={"reason": reason, "operation": op.id, "kind": op.kind, "sandboxes": sandboxes,
                                        "message": exc.message})])
        log.error("objstore.tampered", key=key, reason=reason, operation=op.id, kind=op.kind)

    async def recover(self, op: Operation) -> dict[str, Any]:
        """A sandbox whose runtime died comes back from its latest full checkpoint (processes and
        all), else from its latest disk snapshot, else from its current files; the event says which."""
        sb = await self.store.get_sandbox(op.target)
        if sb.state == State.RUNNING and op.attempts > 1:
            return {"sandbox_id": sb.id}
        if sb.state != State.RESTORING:
            raise Conflict(f"sandbox {sb.id} is {sb.state}, not restoring", state=str(sb.state))
        cause = str(op.request.get("cause") or "exited")
        full = await self.store.latest_snapshot(sb.id, kind="full", node_id=sb.node_id)
        disk = await self.store.latest_snapshot(sb.id, kind="disk", node_id=sb.node_id)
        snap = full or disk
        if snap is not None:
            info = await self._reset(sb, snap, op)
            if snap.kind == "full":
                how = (f"restored from its full checkpoint {snap.id} of {snap.created_at:%Y-%m-%d %H:%M:%S} UTC "
                       "(memory and files; work after it is lost)")
            else:
                how = (f"booted from its disk snapshot {snap.id} of {snap.created_at:%Y-%m-%d %H:%M:%S} UTC: "
                       "no full checkpoint, so its processes were restarted")
        else:
            node = await self._node_of(sb)
            info = await node.call("POST", f"/v1/sandboxes/{sb.id}/reboot", json_body={"token": op.id},
                                   timeout=LONG)
            how = "booted from its current files: it had no snapshot, so its processes were restarted"
        sb = await self.store.set_sandbox_state(sb.id, State.RUNNING, expect=[State.RESTORING],
                                                instance_id=info.get("instance_id"))
        await self.event(sb, "recovered", f"its runtime died ({cause}); {how}", cause=cause,
                         snapshot=snap.id if snap else None, snapshot_kind=snap.kind if snap else None)
        return {"sandbox_id": sb.id, "snapshot": snap.id if snap else None}

    # -- fork ----------------------------------------------------------------------------------

    async def fork(self, op: Operation) -> dict[str, Any]:
        """Forks of a sandbox, and sandboxes created from a snapshot (``request["from_snapshot"]``:
        the target is the snapshot's sandbox, which may be gone): one path."""
        src = await self.store.get_sandbox(op.target)
        snap = await self.store.get_snapshot(str(op.request["snapshot"]))
        if snap.status != "ready":
            if not op.request.get("take_snapshot"):
                raise Conflict(f"snapshot {snap.id} is {snap.status} and cannot be used", snapshot_status=snap.status)
            snap = await self._take(src, snap)
        wanted = list(op.request.get("sandbox_ids") or [])
        # The forks boot side by side (a restore mostly waits on the runtime); a few at a time.
        slots = asyncio.Semaphore(FORK_PARALLEL)

        async def one(fid: str) -> str | None:
            async with slots:
                return await self._fork_one(op, src, snap, fid)

        results = await asyncio.gather(*(one(fid) for fid in wanted))
        done = [fid for fid in results if fid is not None]
        await self.event(src, "forked_into", f"forked into {len(done)} sandbox(es) from snapshot {snap.id}",
                         sandboxes=done, snapshot=snap.id)
        return {"sandbox_ids": done, "snapshot": snap.id}

    async def _fork_one(self, op: Operation, src: Sandbox, snap: Snapshot, fid: str) -> str | None:
        """Boot one fork (idempotent); its id once running, None if it was deleted meanwhile."""
        f = await self.store.get_sandbox(fid)
        if f.state != State.CREATING:
            return fid if f.state == State.RUNNING else None
        node: NodeClient | None = None
        info: dict[str, Any] | None = None
        if snap.node_id is not None and snap.object_key is not None and f.node_id is None \
                and await self._cordoned(snap.node_id):
            # Its node takes nothing new: the uploaded copy serves, on a node that does.
            log.info("fork.node_cordoned", fork=fid, snapshot=snap.id, node=snap.node_id)
        elif snap.node_id is not None:
            try:
                node = await self.nodes.client(snap.node_id)
                await self.store.update_sandbox(fid, node_id=node.node_id)
                info = await node.call("POST", f"/v1/sandboxes/{fid}/fork",
                                       json_body={"source": snap.sandbox_id, "snapshot": snap.id,
                                                  "disk_mb": f.disk_mb, "egress": await self.egress(f)},
                                       timeout=LONG)
            except NotFound as exc:
                if snap.object_key is None:
                    raise
                # The node's copy went with its sandbox (deleted meanwhile): the uploaded one serves.
                log.info("fork.node_copy_gone", fork=fid, snapshot=snap.id, error=str(exc))
        if info is None:
            if snap.object_key is None:
                raise SnapshotCorrupt(f"snapshot {snap.id} is neither on a node nor in object storage",
                                      snapshot_id=snap.id)
            if node is None:
                node = await (self.nodes.client(f.node_id) if f.node_id else self.nodes.schedule())
                await self.store.update_sandbox(fid, node_id=node.node_id)
            info = await node.call("POST", f"/v1/sandboxes/{fid}/restore",
                                   json_body={"snapshot": snap.id, "prefix": snap.object_key, "token": op.id,
                                              "disk_mb": f.disk_mb, "tenant": snap.tenant, "source": snap.sandbox_id,
                                              "egress": await self.egress(f),
                                              "sealing": await self.sealer.for_snapshot(snap)},
                                   timeout=LONG)
        try:
            await self.moved(f, State.RUNNING, expect=[State.CREATING], instance_id=info.get("instance_id"),
                             template_digest=info.get("template_digest"), last_active_at=_now(),
                             event=("forked", f"forked from sandbox {src.id} at {snap.kind} snapshot {snap.id}",
                                    {"parent": src.id, "snapshot": snap.id}))
        except InvalidState:
            return None  # deleted while forking: the delete removes it from the node
        return fid

    async def _cordoned(self, node_id: str) -> bool:
        try:
            return (await self.store.get_node(node_id)).cordoned
        except NotFound:
            return False

    async def fork_failed(self, op: Operation, exc: SpaceError) -> None:
        snap_id = op.request.get("snapshot")
        if op.request.get("take_snapshot") and snap_id:
            with contextlib.suppress(SpaceError):
                snap = await self.store.get_snapshot(str(snap_id))
                if snap.status == "creating":
                    await self.store.update_snapshot(snap.id, status="failed", error=exc.message)
        for fid in op.request.get("sandbox_ids") or []:
            with contextlib.suppress(SpaceError):
                await self.store.set_sandbox_state(fid, State.FAILED, expect=[State.CREATING],
                                                   error_code=exc.code, error_message=exc.message)

    async def snapshot_failed(self, op: Operation, exc: SpaceError) -> None:
        with contextlib.suppress(SpaceError):
            snap = await self.store.update_snapshot(str(op.request["snapshot"]), status="failed", restorable=False,
                                                    error=exc.message)
            if snap.retain and self.objects is not None:
                await self.objects.delete_prefix(retained_prefix(snap) + "/")  # a partial upload

    def failure_handlers(self) -> dict[str, Any]:
        return {
            "sandbox.suspend": self.suspend_failed,
            "sandbox.restore": self.restore_failed,
            "sandbox.rollback": self.rollback_failed,
            "sandbox.recover": self.rollback_failed,
            "sandbox.fork": self.fork_failed,
            "snapshot.create": self.snapshot_failed,
        }

    # -- delete --------------------------------------------------------------------------------

    async def forget_artifacts(self, sb: Sandbox) -> None:
        """A deleted sandbox's snapshots go with it (its forks are independent copies by then),
        except the retained ones: their uploaded copy stays, only the node's (gone with the
        sandbox's directory) is forgotten. The sandbox's shred secret is destroyed first: from then
        on nothing it stored (snapshots, backups) can be decrypted, whatever copy of it survives."""
        await self.store.destroy_shred(sandbox_id=sb.id)
        for snap in await self.store.list_snapshots(sandbox_id=sb.id, statuses=["creating", "ready", "failed"]):
            if snap.retain and snap.status != "failed":
                if snap.node_id is not None:
                    await self.store.update_snapshot(snap.id, node_id=None)
                continue
            if await self.store.snapshot_in_use(snap.id):
                continue
            if snap.retain:
                await self.store.destroy_shred(snapshot_id=snap.id)
                if self.objects is not None:
                    await self.objects.delete_prefix(retained_prefix(snap) + "/")  # what a failed upload left
            await self.store.delete_snapshot_row(snap.id)
        if self.objects is not None:
            await self.objects.delete_prefix(sandbox_prefix(sb))


def _now() -> Any:
    import datetime as dt

    return dt.datetime.now(dt.UTC)
