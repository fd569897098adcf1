"""Time-driven policies, applied by the controller on every tick: maximum lifetime, idleness
(auto-pause, auto-suspend), the snapshot schedule and tiered retention.

Each rule only *enqueues* operations (or deletes pruned snapshots, which is idempotent), so a
crash between ticks loses nothing: the next tick sees the same rows and decides the same.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from typing import Any

import structlog

from space import ids, retention
from space.controller.lifecycle_ops import LifecycleOps
from space.controller.nodes import NodeRegistry
from space.errors import SpaceError
from space.lifecycle import State
from space.store import Operation, Sandbox, Snapshot, Store, new_snapshot

log = structlog.get_logger("space.controller.policies")

#: Seconds between two looks at one sandbox's snapshots for pruning.
PRUNE_EVERY = 60.0


class Policies:
    def __init__(self, store: Store, nodes: NodeRegistry, ops: LifecycleOps) -> None:
        self.store = store
        self.nodes = nodes
        self.ops = ops
        self._pruned: dict[str, float] = {}
        #: (sandbox, kind) → the newest snapshot time this process knows of.
        self._last_seen: dict[tuple[str, str], dt.datetime] = {}
        #: When (``time.monotonic()``) the nearest deadline the last tick saw runs out; None: none
        #: is set. The leader ticks then rather than at its next period: a 3-second timeout pauses
        #: at 3 s, not at up to 3 + the period (E2B's SDK tests expect the pause within 2 s).
        self.next_deadline: float | None = None

    async def tick(self, now: dt.datetime | None = None) -> int:
        """Apply every policy once; returns how many operations were enqueued."""
        now = now or dt.datetime.now(dt.UTC)
        busy = {op.target for op in await self.store.find_operations(status=["pending", "running"])}
        in_use: set[str] | None = None  # read once per tick, when some sandbox is due for pruning
        enqueued = 0
        live = await self.store.list_sandboxes(states=[State.RUNNING.value, State.PAUSED.value,
                                                       State.SUSPENDED.value])
        ahead = [sb.expires_at for sb in live if sb.expires_at is not None and sb.expires_at > now]
        self.next_deadline = (time.monotonic() + (min(ahead) - now).total_seconds()) if ahead else None
        ids = {sb.id for sb in live}
        for key in [k for k in self._last_seen if k[0] not in ids]:
            del self._last_seen[key]
        for sb in live:
            if sb.id in busy:
                continue
            try:
                if await self._expire(sb, now) or await self._idle(sb, now):
                    enqueued += 1
                    continue
                if sb.state == State.RUNNING:
                    enqueued += await self._schedule(sb, now)
                if self._prune_due(sb):
                    if in_use is None:
                        in_use = await self.store.snapshots_in_use()
                    await self._prune(sb, now, in_use)
            except SpaceError as exc:
                log.warning("policy.failed", sandbox=sb.id, error=str(exc))
        return enqueued

    async def _enqueue(self, sb: Sandbox, kind: str, request: dict[str, Any], *,
                       state: State | None = None, snapshot: Snapshot | None = None,
                       key: str | None = None) -> Operation:
        return (await self._enqueue_once(sb, kind, request, state=state, snapshot=snapshot, key=key))[0]

    async def _enqueue_once(self, sb: Sandbox, kind: str, request: dict[str, Any], *,
                            state: State | None = None, snapshot: Snapshot | None = None,
                            key: str | None = None) -> tuple[Operation, bool]:
        """The operation, and whether this call made it (False: ``key`` named an earlier one)."""
        op = Operation(id=ids.operation_id(), tenant=sb.tenant, kind=kind, target=sb.id, status="pending",
                       request={**request, "from_state": str(sb.state)}, idempotency_key=key)
        _, op, created = await self.store.start_operation(op, move_to=state, expect=[sb.state], snapshot=snapshot)
        return op, created

    # -- lifetime ------------------------------------------------------------------------------

    async def _expire(self, sb: Sandbox, now: dt.datetime) -> bool:
        if sb.expires_at is None or sb.expires_at > now:
            return False
        if sb.expire_action in ("pause", "suspend", "suspend_disk"):
            # The deadline is cleared after the action is enqueued: a crash in between leaves a
            # paused or suspending sandbox whose next tick only clears it.
            acted = sb.state == State.RUNNING
            if acted and sb.expire_action == "pause":
                # The deadline stays until the pause has happened (the pause clears it in the write
                # that records the sandbox paused): a request for an auto-resuming sandbox meanwhile
                # waits for the pause, then wakes it (space/e2b/edge.py), instead of reaching a
                # sandbox being frozen. The deadline names the operation: the ticks meanwhile make
                # it once; one that failed gives up the deadline, as before.
                op, created = await self._enqueue_once(
                    sb, "sandbox.pause", {"reason": "timeout"},
                    key=f"timeout-pause:{sb.id}:{sb.expires_at.timestamp():.6f}")
                if created:
                    await self.ops.event(sb, "expired", "its timeout ran out: pausing it")
                if op.status in ("pending", "running"):
                    return created
                acted = False  # it failed: the deadline is given up below
            elif acted:
                memory = sb.expire_action == "suspend"
                snap = new_snapshot(sb, "full" if memory else "disk", "suspend")
                await self._enqueue(sb, "sandbox.suspend", {"snapshot": snap.id, "memory": memory,
                                                            "reason": "timeout"},
                                    state=State.SUSPENDING, snapshot=snap)
                await self.ops.event(sb, "expired", "its timeout ran out: suspending it"
                                     + ("" if memory else " (its files only)"))
            await self.store.update_sandbox(sb.id, expires_at=None)
            return acted
        await self._enqueue(sb, "sandbox.delete", {"reason": "lifetime"}, state=State.TERMINATING)
        await self.ops.event(sb, "expired", "its maximum lifetime ran out: deleting it")
        return True

    # -- idleness ------------------------------------------------------------------------------

    async def _idle(self, sb: Sandbox, now: dt.datetime) -> bool:
        if sb.idle_pause_s is None and sb.idle_suspend_s is None:
            return False
        last = sb.last_active_at or sb.updated_at or sb.created_at
        if sb.state == State.RUNNING and sb.node_id is not None:
            try:
                node = await self.nodes.client(sb.node_id)
                act = await node.call("GET", f"/v1/sandboxes/{sb.id}/activity", timeout=10)
            except SpaceError:
                return False  # a sandbox we cannot ask about is not idle-paused blindly
            if act.get("running"):
                # Commands still running are work in progress, whoever is watching them.
                await self.store.touch_sandbox(sb.id, now)
                return False
            guest_last = act.get("last_activity")
            if isinstance(guest_last, (int, float)) and guest_last > 0:
                seen = dt.datetime.fromtimestamp(guest_last, dt.UTC)
                if seen > last:
                    last = seen
                    await self.store.touch_sandbox(sb.id, seen)
        idle = (now - last).total_seconds()
        if sb.state in (State.RUNNING, State.PAUSED) and sb.idle_suspend_s is not None and idle >= sb.idle_suspend_s:
            snap = new_snapshot(sb, "full", "suspend")
            await self._enqueue(sb, "sandbox.suspend", {"snapshot": snap.id, "idle": True},
                                state=State.SUSPENDING, snapshot=snap)
            await self.ops.event(sb, "idle", f"idle for {idle:.0f}s: suspending")
            return True
        if sb.state == State.RUNNING and sb.idle_pause_s is not None and idle >= sb.idle_pause_s:
            await self._enqueue(sb, "sandbox.pause", {"idle": True})
            await self.ops.event(sb, "idle", f"idle for {idle:.0f}s: pausing")
            return True
        return False

    # -- schedule and retention ----------------------------------------------------------------

    async def _schedule(self, sb: Sandbox, now: dt.datetime) -> int:
        policy = retention.SnapshotPolicy.from_dict(sb.snapshot_policy or None)
        n = 0
        for kind in ("disk", "full"):
            if policy.interval(kind) is None:
                continue
            # The newest snapshot is never older than what we last saw: while that is not due, the
            # database need not be asked (one query per interval, not two per sandbox per tick).
            seen = self._last_seen.get((sb.id, kind))
            if seen is not None and not retention.due(policy, kind, seen, now):
                continue
            latest = await self.store.latest_snapshot(sb.id, kind=kind, restorable=None)
            last = latest.created_at if latest is not None else sb.created_at
            self._last_seen[(sb.id, kind)] = last
            if not retention.due(policy, kind, last, now):
                continue
            snap = new_snapshot(sb, kind, "schedule")
            # Keyed by the slot it is due for: a second leader ticking at the same moment (the
            # first still thinks it leads) finds this operation instead of taking a second one.
            slot = (last + dt.timedelta(seconds=policy.interval(kind) or 0)).isoformat()
            await self._enqueue(sb, "snapshot.create", {"snapshot": snap.id, "kind": kind}, snapshot=snap,
                                key=f"schedule:{sb.id}:{kind}:{slot}")
            self._last_seen[(sb.id, kind)] = now
            n += 1
        return n

    def _prune_due(self, sb: Sandbox) -> bool:
        """Look at a sandbox's snapshots once a minute, or as often as its schedule takes one."""
        policy = retention.SnapshotPolicy.from_dict(sb.snapshot_policy or None)
        every = min([PRUNE_EVERY, *(i for i in (policy.disk_every, policy.full_every) if i)])
        now = time.monotonic()
        if now - self._pruned.get(sb.id, -every) < every:
            return False
        self._pruned[sb.id] = now
        if len(self._pruned) > 100_000:
            self._pruned.clear()
        return True

    async def _prune(self, sb: Sandbox, now: dt.datetime, in_use: set[str]) -> None:
        snaps = await self.store.list_snapshots(sandbox_id=sb.id, statuses=["ready"])
        if not any(s.origin == "schedule" for s in snaps):
            return
        policy = retention.SnapshotPolicy.from_dict(sb.snapshot_policy or None)
        pinned = set()
        newest_full = await self.store.latest_snapshot(sb.id, kind="full", node_id=sb.node_id)
        if newest_full is not None:
            pinned.add(newest_full.id)  # crash recovery restores from it
        pinned |= {s.id for s in snaps if s.id in in_use}
        refs = [retention.SnapshotRef(id=s.id, created_at=s.created_at, kind=s.kind, origin=s.origin) for s in snaps]
        by_id = {s.id: s for s in snaps}
        for sid in retention.prune(refs, policy, now, pinned=pinned):
            with contextlib.suppress(SpaceError):
                await self.ops.remove_snapshot(by_id[sid])
                log.info("snapshot.pruned", sandbox=sb.id, snapshot=sid)
