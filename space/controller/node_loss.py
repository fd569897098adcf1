"""Node loss: heartbeats that renew each node's fencing lease, a silent node marked ``unreachable``
and then ``lost``, its sandboxes restored on healthy nodes from what was shipped of them, and the
stale copies of a node that comes back released or discarded.

The order that keeps two copies of a sandbox from ever running at once:

1. Every heartbeat carries ``hb`` (its number) and ``ack`` (the newest one whose answer arrived):
   the node's lease runs from an acknowledged heartbeat's arrival (:mod:`space.node.sandboxes.fencing`),
   this side's wait from the newest answer it received, which is later.
2. A node is ``lost`` only once it has been silent for its lease (as it reported it) plus a margin:
   by then it has frozen its sandboxes itself. A node reporting no lease is never lost by this
   rule (its sandboxes could still run): it stays ``unreachable`` until an operator removes it.
3. Only then is each of its sandboxes placed elsewhere (``sandbox.recover`` with ``lost_node``):
   from its newest uploaded full checkpoint when that is at least as new as its disk backup (memory
   and files), else from the disk backup chain (files; processes restarted). The event names what
   was used and how old each part was.
4. A node that answers again lists its frozen sandboxes: the ones still placed on it are released
   (``unfence``); the others were restored elsewhere, and its copies are discarded (``moved``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import secrets
import time
from typing import Any

import structlog

from space import ids
from space.controller.lifecycle_ops import LONG, LifecycleOps
from space.controller.nodes import NodeRegistry
from space.errors import Conflict, InvalidState, NotFound, SpaceError
from space.lifecycle import State
from space.node.api.client import NodeClient
from space.store import Node, Operation, Sandbox, Store

log = structlog.get_logger("space.controller.node_loss")

#: Added to a node's lease before it is lost: heartbeat spacing, the node's fencing tick, clocks.
LOST_MARGIN = 10.0


class Heartbeats:
    """The numbers a heartbeat carries, per node, in this (leading) process."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._acked: dict[str, int] = {}

    def params(self, node_id: str) -> dict[str, Any]:
        # Numbered from a random start per process: a new leader's numbers mean nothing to the
        # node until it acknowledges one of its own, so nothing an old leader sent is renewed.
        hb = self._next.get(node_id) or (secrets.randbits(31) << 8)
        self._next[node_id] = hb + 1
        out: dict[str, Any] = {"hb": hb}
        if node_id in self._acked:
            out["ack"] = self._acked[node_id]
        return out

    def answered(self, node_id: str, hb: int) -> None:
        self._acked[node_id] = hb


def node_lease(row: Node) -> float | None:
    fence = (row.capacity or {}).get("fence") or {}
    lease = fence.get("lease") if isinstance(fence, dict) else None
    if isinstance(lease, int | float) and not isinstance(lease, bool) and lease > 0:
        return float(lease)
    return None


def lost_after(row: Node) -> float | None:
    """Seconds of silence after which ``row`` is lost (None: never by itself)."""
    lease = node_lease(row)
    return None if lease is None else lease + LOST_MARGIN


class NodeLoss:
    def __init__(self, store: Store, nodes: NodeRegistry, lifecycle: LifecycleOps) -> None:
        self.store = store
        self.nodes = nodes
        self.lifecycle = lifecycle
        self.heartbeats = Heartbeats()

    # -- a node that answered ---------------------------------------------------------------------

    async def release_or_discard(self, row: Node, node: NodeClient, info: dict[str, Any]) -> None:
        """The node's fenced sandboxes: released where it still holds them, discarded elsewhere."""
        fence = info.get("fence") or {}
        fenced = fence.get("fenced") if isinstance(fence, dict) else None
        for sid in fenced if isinstance(fenced, list) else []:
            if not isinstance(sid, str):
                continue
            try:
                sb: Sandbox | None = await self.store.get_sandbox(sid)
            except NotFound:
                sb = None
            try:
                if _still_its_own(sb, row):
                    await node.call("POST", f"/v1/sandboxes/{sid}/unfence", timeout=30)
                    log.info("node.sandbox_released", node=row.id, sandbox=sid, state=str(sb.state) if sb else None)
                else:
                    with contextlib.suppress(NotFound):
                        await node.call("DELETE", f"/v1/sandboxes/{sid}", params={"reason": "moved"}, timeout=LONG)
                    log.warning("node.stale_copy_discarded", node=row.id, sandbox=sid,
                                now_on=sb.node_id if sb else None, state=str(sb.state) if sb else None)
            except SpaceError as exc:  # the next heartbeat tries again
                log.warning("node.fenced_sync_failed", node=row.id, sandbox=sid, error=exc.message[:200])

    # -- a node that did not -----------------------------------------------------------------------

    async def silent(self, row: Node, now: float) -> None:
        """``row`` did not answer: lost once past its lease and margin, its sandboxes relocated."""
        limit = lost_after(row)
        if limit is None or row.state not in ("ready", "unreachable", "lost"):
            return
        if now - row.heartbeat_at.timestamp() <= limit:
            return
        if row.state != "lost":
            log.error("node.lost", node=row.id, silent_s=round(now - row.heartbeat_at.timestamp(), 1),
                      lease=node_lease(row))
            await self.store.set_node_state(row.id, "lost")
        await self.relocate_all(row)

    async def relocate_all(self, row: Node) -> int:
        """Queue the restore elsewhere of every sandbox still placed on lost node ``row``."""
        n = 0
        for sb in await self.store.list_sandboxes(states=[State.RUNNING.value, State.PAUSED.value], node_id=row.id):
            op = Operation(id=ids.operation_id(), tenant=sb.tenant, kind="sandbox.recover", target=sb.id,
                           status="pending", request={"cause": "node_lost", "lost_node": row.id,
                                                      "from_state": str(sb.state),
                                                      "lost_at": row.heartbeat_at.isoformat()},
                           idempotency_key=f"lost:{row.id}:{sb.id}:{sb.generation}")
            try:
                await self.store.start_operation(op, move_to=State.RESTORING, expect=[sb.state])
            except (InvalidState, Conflict):
                continue  # something else got to it first (a delete, a concurrent tick)
            await self.lifecycle.event(sb, "node_lost", f"its node {row.id} was lost (silent since "
                                       f"{row.heartbeat_at:%H:%M:%S} UTC); restoring it elsewhere", node=row.id)
            n += 1
        return n

    # -- the restore elsewhere (the recover operation of a lost node's sandbox) -------------------

    async def relocate(self, op: Operation) -> dict[str, Any]:
        sb = await self.store.get_sandbox(op.target)
        lost = str(op.request["lost_node"])
        if sb.state != State.RESTORING:
            if sb.state in (State.RUNNING, State.PAUSED) and sb.node_id != lost:
                return {"sandbox_id": sb.id, "node_id": sb.node_id}  # a retry after it was done
            raise Conflict(f"sandbox {sb.id} is {sb.state}, not restoring", state=str(sb.state))
        full = await self._newest_uploaded_full(sb)
        rec = sb.backup or {}
        disk_at = dt.datetime.fromisoformat(rec["disk_at"]) if rec.get("disk_at") and rec.get("chain") else None
        use_memory = full is not None and (disk_at is None or full.created_at >= disk_at - dt.timedelta(seconds=1))
        if full is None and disk_at is None:
            raise NotFound(f"sandbox {sb.id}'s node {lost} was lost and nothing of it was shipped to object "
                           "storage (no disk backup, no uploaded checkpoint)", sandbox_id=sb.id, node=lost)
        # Placement is recorded first, so that a retry goes to the same node.
        if sb.node_id == lost or sb.node_id is None:
            node = await self.nodes.schedule(exclude=lost)
            sb = await self.store.update_sandbox(sb.id, node_id=node.node_id, instance_id=None)
        else:
            node = await self.nodes.client(sb.node_id)
        t0 = time.monotonic()
        egress = await self.lifecycle.egress(sb)
        if use_memory:
            assert full is not None
            info = await node.call("POST", f"/v1/sandboxes/{sb.id}/restore", timeout=LONG,
                                   json_body={"snapshot": full.id, "prefix": full.object_key, "token": op.id,
                                              "disk_mb": sb.disk_mb, "tenant": full.tenant,
                                              "source": full.sandbox_id, "egress": egress,
                                              "sealing": await self.lifecycle.sealer.for_snapshot(full)})
        else:
            info = await node.call("POST", f"/v1/sandboxes/{sb.id}/restore-backup", timeout=LONG,
                                   json_body={"tenant": sb.tenant, "prefix": rec["prefix"], "chain": rec["chain"],
                                              "seq": int(rec["seq"]), "token": op.id, "disk_mb": sb.disk_mb,
                                              "egress": egress, "sealing": await self.lifecycle.sealer.for_sandbox(sb)})
        back = State.PAUSED if op.request.get("from_state") == State.PAUSED.value else State.RUNNING
        if back == State.PAUSED:
            await node.call("POST", f"/v1/sandboxes/{sb.id}/pause", timeout=60)
        lost_at = dt.datetime.fromisoformat(str(op.request.get("lost_at") or dt.datetime.now(dt.UTC).isoformat()))
        how = _what_was_kept(use_memory, full.created_at if full else None, disk_at, lost_at)
        sb = await self.store.set_sandbox_state(sb.id, State.RUNNING, expect=[State.RESTORING],
                                                instance_id=info.get("instance_id"))
        if back == State.PAUSED:  # restoring → running → paused: it was paused, it stays paused
            sb = await self.store.set_sandbox_state(sb.id, State.PAUSED, expect=[State.RUNNING])
        seconds = round(time.monotonic() - t0, 2)
        as_of = full.created_at if use_memory and full is not None else disk_at
        await self.lifecycle.event(sb, "relocated", f"its node {lost} was lost; {how}; now on node {node.node_id}",
                                   node=node.node_id, lost_node=lost, memory=use_memory,
                                   snapshot=full.id if use_memory and full else None,
                                   chain=None if use_memory else rec.get("chain"), restore_s=seconds,
                                   # What it came back as of: writes after this moment were lost.
                                   restored_as_of=as_of.isoformat() if as_of is not None else None,
                                   lost_at=lost_at.isoformat())
        return {"sandbox_id": sb.id, "node_id": node.node_id, "memory": use_memory, "restore_s": seconds}

    async def relocate_failed(self, op: Operation, exc: SpaceError) -> None:
        """Nothing to restore it from, or no node took it: ``failed``, saying why (its files and
        checkpoints in object storage stay; a new sandbox can be forked from its snapshots)."""
        sb = await self.store.get_sandbox(op.target)
        if sb.state != State.RESTORING:
            return
        sb = await self.store.set_sandbox_state(sb.id, State.FAILED, expect=[State.RESTORING],
                                                error_code=exc.code, error_message=exc.message)
        await self.lifecycle.event(sb, "relocate_failed", f"could not be restored elsewhere: {exc.message}")

    async def _newest_uploaded_full(self, sb: Sandbox) -> Any:
        snaps = await self.store.list_snapshots(sandbox_id=sb.id, statuses=["ready"])
        uploaded = [s for s in snaps if s.kind == "full" and s.object_key is not None and s.restorable]
        return max(uploaded, key=lambda s: (s.created_at, s.id)) if uploaded else None


def _still_its_own(sb: Sandbox | None, node: Node) -> bool:
    """Whether a sandbox ``node`` froze is still that node's to run: placed there and not being
    restored elsewhere because the node was lost. Anything else placed there (running, paused, a
    move or a suspend under way) is released: only a copy the control plane replaced is discarded."""
    if sb is None or sb.node_id != node.id or sb.state in (State.TERMINATED, State.FAILED):
        return False
    return not (node.state == "lost" and sb.state == State.RESTORING)


def _age(at: dt.datetime, lost_at: dt.datetime) -> str:
    s = max(0.0, (lost_at - at).total_seconds())
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"


def _what_was_kept(memory: bool, memory_at: dt.datetime | None, disk_at: dt.datetime | None,
                   lost_at: dt.datetime) -> str:
    """``restored from disk backup 40 s old; memory from 11 min ago not used (processes restarted)``."""
    if memory:
        assert memory_at is not None
        return (f"restored from its full checkpoint {_age(memory_at, lost_at)} older than the node's last "
                "heartbeat (memory and files; work after it is lost)")
    assert disk_at is not None
    mem = (f"; its newest checkpoint ({_age(memory_at, lost_at)} old) is older, so processes were restarted"
           if memory_at is not None else "; no checkpoint was shipped, so processes were restarted")
    return f"restored from its disk backup {_age(disk_at, lost_at)} older than the node's last heartbeat{mem}"
