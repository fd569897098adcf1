"""Moving sandboxes between nodes: one sandbox (``sandbox.move``) and every sandbox of a node
(``node.drain``).

A move is a checkpoint on the old node, shipped through object storage, restored on the new one:

1. the old copy is frozen and checkpointed (memory and files) and its snapshot shipped (the
   node's ``suspend``; the copy stays there, paused);
2. a new node is chosen (never a cordoned one) and recorded in the operation's progress, so a retry
   goes to the same one;
3. the new node restores the snapshot (idempotent by the operation's id); a sandbox that was paused
   is paused again there;
4. one write makes the new copy the sandbox's (state back to what it was, the new node, the new
   instance, the old node named in ``evict_node``);
5. the user's snapshots on the old node are carried along, and the old copy is removed with reason
   ``moved``: streams still attached to it end with a ``moved`` event and resume on the new node.

At no moment do two copies run: the old one is frozen from step 1 until it is removed, and when a
move cannot finish, the new copy (if any) is removed before the old one is resumed. A controller
that crashes at any step leaves rows from which the next one finishes the move (every step is
idempotent), or undoes it.

A drain cordons the node (nothing new is placed there, its warm pool is let go), then moves its
sandboxes a few at a time until none is left, reporting progress in its operation. Its moves are
operations of their own, keyed by the drain: a drain taken over by another controller finds them
instead of starting them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog

from space import failpoints, ids
from space.controller import placement
from space.controller.lifecycle_ops import LONG, LifecycleOps
from space.controller.nodes import NodeRegistry
from space.controller.prefixes import object_prefix
from space.errors import Conflict, InvalidState, NotFound, SpaceError, Unavailable
from space.lifecycle import State
from space.node.api.client import NodeClient
from space.store import Node, Operation, Sandbox, Store, new_snapshot

log = structlog.get_logger("space.controller.moves")

#: Where a moved sandbox may come from, and what it goes back to.
MOVABLE = (State.RUNNING, State.PAUSED)
#: States of a sandbox on a node that a drain waits out before it can move it (or needs nothing).
SETTLING = (State.CREATING, State.RESTORING, State.SUSPENDING, State.MOVING)
#: Moves of one drain at a time, by default and at most.
DRAIN_PARALLEL = 2
MAX_DRAIN_PARALLEL = 16
#: How often a drain looks at its moves.
DRAIN_POLL = 0.25
#: Snapshot origin of the checkpoint a move ships.
MOVE_ORIGIN = "move"


def drain_target(node_id: str) -> str:
    """A drain's operation target: node ids and sandbox ids must not share one order."""
    return f"node/{node_id}"


async def start_drain(store: Store, node_id: str, *, tenant: str, parallel: int = DRAIN_PARALLEL,
                      reason: str | None = None) -> tuple[Node, Operation, bool]:
    """Cordon ``node_id`` and queue its drain (``node.drain``): the node, the operation, and whether
    it is new (a drain already under way is returned, not doubled). Conflict if the node is not
    ready (a lost node's sandboxes are restored from what was shipped of them, not drained) or no
    other ready, uncordoned node can take its sandboxes. The caller wakes the controllers."""
    row = await store.get_node(node_id)
    target = drain_target(node_id)
    running = await store.find_operations(target=target, kind="node.drain", status=["pending", "running"])
    if running:
        return row, running[0], False
    if row.state != "ready":
        raise Conflict(f"node {node_id} is {row.state}: only a ready node can be drained", node=node_id,
                       state=row.state)
    if not [n for n in await store.list_nodes("ready") if n.id != node_id and not n.cordoned]:
        raise Conflict(f"node {node_id} cannot be drained: no other ready, uncordoned node to move its "
                       "sandboxes to", node=node_id)
    row = await store.set_node_cordoned(node_id, True)
    request: dict[str, Any] = {"node": node_id, "parallel": parallel}
    if reason is not None:
        request["reason"] = reason
    op = Operation(id=ids.operation_id(), tenant=tenant, kind="node.drain", target=target, status="pending",
                   request=request)
    op, _ = await store.create_operation(op)
    return row, op, True


class Moves:
    def __init__(self, store: Store, nodes: NodeRegistry, lifecycle: LifecycleOps, wake: Any) -> None:
        self.store = store
        self.nodes = nodes
        self.lifecycle = lifecycle
        #: Tells the controllers that operations were queued (the drain's moves).
        self._wake = wake

    def handlers(self) -> dict[str, Any]:
        return {"sandbox.move": self.move, "node.drain": self.drain}

    def failure_handlers(self) -> dict[str, Any]:
        return {"sandbox.move": self.move_failed, "node.drain": self.drain_failed}

    # -- one sandbox ---------------------------------------------------------------------------

    async def enqueue_move(self, sb: Sandbox, *, drain: str | None = None) -> Operation:
        """Record a move of ``sb`` off its node, with the snapshot it ships (one write, which also
        enters ``moving``). Keyed by the drain that asks for it: asked again, the same operation."""
        if sb.node_id is None or sb.state not in MOVABLE:
            raise InvalidState(f"cannot move a sandbox that is {sb.state}", state=str(sb.state), allowed=[])
        snap = new_snapshot(sb, "full", MOVE_ORIGIN)
        op = Operation(id=ids.operation_id(), tenant=sb.tenant, kind="sandbox.move", target=sb.id,
                       status="pending", idempotency_key=f"drain:{drain}:{sb.id}" if drain else None,
                       request={"from_state": str(sb.state), "source": sb.node_id, "snapshot": snap.id,
                                "drain": drain})
        _, op, created = await self.store.start_operation(op, move_to=State.MOVING, expect=[sb.state],
                                                          snapshot=snap)
        if created:
            self._wake()
        return op

    async def move(self, op: Operation) -> dict[str, Any]:
        sb = await self.store.get_sandbox(op.target)
        source = str(op.request["source"])
        back = State(str(op.request["from_state"]))
        snap_id = str(op.request["snapshot"])
        progress = dict((await self.store.get_operation(op.id)).progress or {})
        if sb.state == back and sb.node_id != source:
            # Moved already (a controller crashed after the switch): its event, should the crash
            # have come before it, and the old copy are left.
            if not any(e.kind == "moved" and (e.data or {}).get("snapshot") == snap_id
                       for e in await self.store.list_events(sb.id)):
                await self.lifecycle.event(
                    sb, "moved", f"moved from node {source} to node {sb.node_id} (its controller stopped "
                    "after the switch)", from_node=source, node=sb.node_id, snapshot=snap_id,
                    drain=op.request.get("drain"))
            await self._leave(sb, source, snap_id)
            return {"sandbox_id": sb.id, "node_id": sb.node_id, "from_node": source}
        if sb.state != State.MOVING:
            raise Conflict(f"sandbox {sb.id} is {sb.state}, not moving", state=str(sb.state))
        if sb.node_id != source:
            raise Conflict(f"sandbox {sb.id} is on node {sb.node_id}, not {source}", state=str(sb.state))
        old = await self.nodes.client(source)
        t0 = time.monotonic()
        timings: dict[str, float] = dict(progress.get("timings") or {})

        # 1. Frozen and shipped; the old copy stays, paused.
        snap = await self.store.get_snapshot(snap_id)
        if snap.status != "ready":
            await self._progress(op, progress, phase="checkpointing", message=f"checkpointing on {source}")
            prefix = object_prefix(sb, snap_id)
            res = await old.call("POST", f"/v1/sandboxes/{sb.id}/suspend",
                                 json_body={"snapshot": snap_id, "prefix": prefix, "tenant": sb.tenant,
                                            "kind": "full", "sealing": await self.lifecycle.sealer.for_sandbox(sb)},
                                 timeout=LONG)
            snap = await self.store.update_snapshot(
                snap_id, status="ready", restorable=True, object_key=prefix, node_id=source,
                size_bytes=res.get("bytes"), meta={"uploaded_bytes": res.get("bytes"),
                                                   "artifacts": res.get("artifacts")})
            timings["checkpoint_and_upload_s"] = round(time.monotonic() - t0, 3)

        # 2. Where to: recorded before anything is put there, so that a retry goes to the same node.
        target_id = progress.get("target")
        if target_id is None:
            node = await self.nodes.schedule(placement.Request(template=sb.template, cpu=sb.cpu,
                                                               memory_mb=sb.memory_mb), exclude=source)
            target_id = node.node_id
            await self._progress(op, progress, phase="restoring", target=target_id, timings=timings,
                                 message=f"restoring on {target_id}")
        new = await self.nodes.client(str(target_id))

        # 3. Restored there (a sandbox deleted meanwhile is not).
        if (await self.store.get_sandbox(sb.id)).state != State.MOVING:
            return await self._abandon(sb.id, new)
        t1 = time.monotonic()
        info = await new.call("POST", f"/v1/sandboxes/{sb.id}/restore",
                              json_body={"snapshot": snap.id, "prefix": snap.object_key, "token": op.id,
                                         "disk_mb": sb.disk_mb, "tenant": sb.tenant, "source": sb.id,
                                         "egress": await self.lifecycle.egress(sb),
                                         "sealing": await self.lifecycle.sealer.for_sandbox(sb)}, timeout=LONG)
        if back == State.PAUSED:
            await new.call("POST", f"/v1/sandboxes/{sb.id}/pause")
        timings["restore_s"] = round(time.monotonic() - t1, 3)

        # 4. The switch: from now on the new copy is the sandbox.
        try:
            sb = await self.store.set_sandbox_state(sb.id, back, expect=[State.MOVING], node_id=new.node_id,
                                                    instance_id=info.get("instance_id"), evict_node=source)
        except InvalidState:
            return await self._abandon(sb.id, new)
        await self.store.update_snapshot(snap.id, node_id=new.node_id)
        timings["total_s"] = round(time.monotonic() - t0, 3)
        what = "processes and files" if back == State.RUNNING else "paused, processes and files"
        await self.lifecycle.event(
            sb, "moved", f"moved from node {source} to node {new.node_id} ({what}; guest frozen about "
            f"{timings.get('total_s', 0):.1f} s)", from_node=source, node=new.node_id, snapshot=snap.id,
            timings=timings, drain=op.request.get("drain"))
        await failpoints.hit("controller.move.after_switch")
        # 5. The old copy goes.
        await self._leave(sb, source, snap.id)
        return {"sandbox_id": sb.id, "node_id": new.node_id, "from_node": source, "timings": timings}

    async def _leave(self, sb: Sandbox, source: str, snap_id: str) -> None:
        """After the switch: the user's snapshots on the old node come along, the old copy is
        removed (its streams end with ``moved``), and earlier moves' checkpoints are dropped (this
        one is newer)."""
        if sb.evict_node != source:
            return
        try:
            old = await self.nodes.client(source)
            await self.lifecycle.carry_snapshots(sb, old, keep=snap_id, why="moved")
            with contextlib.suppress(NotFound):
                await old.call("DELETE", f"/v1/sandboxes/{sb.id}", params={"reason": "moved"}, timeout=LONG)
            await self.store.clear_eviction(sb.id, source)
        except Unavailable as exc:
            # The old node went away meanwhile: its copy is frozen, and reconcile removes it when
            # the node is back (nobody wants it there any more).
            log.warning("move.evict_deferred", sandbox=sb.id, node=source, error=str(exc))
        for other in await self.store.list_snapshots(sandbox_id=sb.id, statuses=["ready", "failed"]):
            if other.origin == MOVE_ORIGIN and other.id != snap_id:
                with contextlib.suppress(SpaceError):
                    await self.lifecycle.remove_snapshot(other)

    async def _abandon(self, sandbox_id: str, new: NodeClient) -> dict[str, Any]:
        """The sandbox is being deleted: a copy made on the new node goes; the delete that follows
        removes the old one."""
        with contextlib.suppress(NotFound):
            await new.call("DELETE", f"/v1/sandboxes/{sandbox_id}", timeout=LONG)
        return {"sandbox_id": sandbox_id, "abandoned": True}

    async def _progress(self, op: Operation, progress: dict[str, Any], **fields: Any) -> None:
        progress.update(fields)
        await self.store.set_operation_progress(op.id, progress)

    async def move_failed(self, op: Operation, exc: SpaceError) -> None:
        """Put the sandbox back on its old node as it was: the new copy (if one was made) is removed
        first, then the old one resumed. A new copy that cannot be confirmed gone leaves the old one
        paused: never two running."""
        sb = await self.store.get_sandbox(op.target)
        if sb.state != State.MOVING:
            return
        source = str(op.request["source"])
        back = State(str(op.request["from_state"]))
        target = ((await self.store.get_operation(op.id)).progress or {}).get("target")
        clean = True
        if target is not None:
            try:
                with contextlib.suppress(NotFound):
                    await (await self.nodes.client(str(target))).call("DELETE", f"/v1/sandboxes/{sb.id}",
                                                                       timeout=LONG)
            except SpaceError as err:
                clean = False
                log.warning("move.undo_incomplete", sandbox=sb.id, node=target, error=str(err))
        now = State.PAUSED
        if back == State.RUNNING and clean:
            try:
                await (await self.nodes.client(source)).call("POST", f"/v1/sandboxes/{sb.id}/resume")
                now = State.RUNNING
            except SpaceError as err:
                log.warning("move.resume_failed", sandbox=sb.id, node=source, error=str(err))
        with contextlib.suppress(SpaceError):
            snap = await self.store.get_snapshot(str(op.request["snapshot"]))
            if snap.status != "ready":
                await self.store.update_snapshot(snap.id, status="failed", restorable=False, error=exc.message)
        sb = await self.store.set_sandbox_state(sb.id, now, expect=[State.MOVING], node_id=source)
        await self.lifecycle.event(sb, "move_failed", f"could not be moved off node {source}; it is {now.value} "
                                   f"there as before: {exc.message}", node=source, drain=op.request.get("drain"))

    # -- a whole node --------------------------------------------------------------------------

    async def drain(self, op: Operation) -> dict[str, Any]:
        node_id = str(op.request["node"])
        parallel = max(1, min(MAX_DRAIN_PARALLEL, int(op.request.get("parallel") or DRAIN_PARALLEL)))
        await self.store.set_node_cordoned(node_id, True)
        self.nodes.invalidate_rows()
        if not [n for n in await self.store.list_nodes("ready") if n.id != node_id and not n.cordoned]:
            raise Conflict(f"node {node_id} cannot be drained: no other ready, uncordoned node to move its "
                           "sandboxes to (it stays cordoned)", node=node_id)
        with contextlib.suppress(SpaceError):  # its warm sandboxes go now (the heartbeat would, too)
            await (await self.nodes.client(node_id)).call("PUT", "/v1/pool", json_body={"targets": []}, timeout=10)
        # Taken over from a controller that stopped: what it had counted is in the progress.
        progress = dict((await self.store.get_operation(op.id)).progress or {})
        moved: set[str] = set(progress.get("moved_ids") or [])
        failed: dict[str, str] = dict(progress.get("failed_ids") or {})
        in_flight: set[str] = set(progress.get("in_flight") or [])
        started = time.monotonic() - float(progress.get("elapsed_s") or 0)
        while True:
            if not (await self.store.get_node(node_id)).cordoned:
                raise Conflict(f"node {node_id} was uncordoned during its drain ({len(moved)} moved, the "
                               "rest stays)", node=node_id, moved=sorted(moved))
            active = await self.store.find_operations(status=["pending", "running"])
            busy = {o.target for o in active}
            mine = {o.target for o in active if o.kind == "sandbox.move" and o.request.get("drain") == op.id}
            for sid in in_flight - mine:  # finished since the last look: how?
                await self._count(op.id, sid, moved, failed)
            here = await self.store.list_sandboxes(node_id=node_id, states=[s.value for s in (*MOVABLE, *SETTLING)])
            todo = [sb for sb in here if sb.state in MOVABLE and sb.id not in busy and sb.id not in failed]
            for sb in todo[:max(0, parallel - len(mine))]:
                try:
                    await self.enqueue_move(sb, drain=op.id)
                except InvalidState:
                    continue  # it changed meanwhile: looked at again next round
                mine.add(sb.id)
            in_flight = mine
            remaining = [sb.id for sb in here if sb.id not in failed]
            await self.store.set_operation_progress(op.id, {
                "node": node_id, "moved": len(moved), "failed": len(failed), "remaining": len(remaining),
                "moved_ids": sorted(moved), "failed_ids": failed, "in_flight": sorted(in_flight),
                "elapsed_s": round(time.monotonic() - started, 1),
                "message": f"{len(moved)} moved, {len(in_flight)} moving, "
                           f"{max(0, len(remaining) - len(in_flight))} to go"
                           + (f", {len(failed)} failed" if failed else "")})
            if not remaining and not in_flight:
                break
            await asyncio.sleep(DRAIN_POLL)
        if failed:
            names = ", ".join(f"{sid} ({why})" for sid, why in sorted(failed.items()))
            raise Conflict(f"node {node_id}: {len(moved)} sandboxes moved, {len(failed)} could not be and run on "
                           f"there: {names[:2000]}", node=node_id, failed=sorted(failed))
        return {"node": node_id, "moved": sorted(moved), "elapsed_s": round(time.monotonic() - started, 1)}

    async def _count(self, drain_id: str, sandbox_id: str, moved: set[str], failed: dict[str, str]) -> None:
        """How this drain's move of ``sandbox_id`` ended (its operation, whoever ran it)."""
        ops = [o for o in await self.store.find_operations(target=sandbox_id, kind="sandbox.move")
               if o.request.get("drain") == drain_id]
        if not ops:
            return
        o = ops[-1]
        if o.status == "succeeded":
            moved.add(sandbox_id)
            log.info("drain.moved", drain=drain_id, sandbox=sandbox_id)
        elif o.status == "failed":
            failed[sandbox_id] = o.error_message or o.error_code or "failed"
            log.warning("drain.move_failed", drain=drain_id, sandbox=sandbox_id, error=failed[sandbox_id])

    async def drain_failed(self, op: Operation, exc: SpaceError) -> None:
        """A drain that ends early leaves the node cordoned (the operator decides: drain again, or
        uncordon); every sandbox is where its move left it, running."""
        log.warning("drain.failed", node=op.request.get("node"), error=exc.message)
