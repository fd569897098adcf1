"""The controller: carries out operations and reconciles desired state (SQL) with live state (nodes).

It holds nothing in memory that matters. Operations are claimed with a lease that is renewed while
they run; a controller that dies mid-operation leaves a lease that expires, and the next claim runs
the handler again. Every handler is therefore idempotent: it looks at the rows and the node, and
finishes whatever is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import structlog

from space import failpoints, ids
from space.controller import placement
from space.controller.backups import BackupSync
from space.controller.leader import Leadership
from space.controller.lifecycle_ops import LifecycleOps
from space.controller.moves import Moves, start_drain
from space.controller.node_loss import NodeLoss, node_lease
from space.controller.nodes import NodeRegistry
from space.controller.policies import Policies
from space.controller.registry_auth import registry_logins
from space.controller.rotation import KeyRotation
from space.controller.sealing import Sealer
from space.controller.template_ops import TemplateOps
from space.errors import (
    Conflict,
    Internal,
    InvalidState,
    KeyUnavailable,
    LeaseLost,
    NotFound,
    ObjectTampered,
    SpaceError,
    Unavailable,
    from_wire,
)
from space.lifecycle import State
from space.node.api.client import NodeClient
from space.objstore import ObjectStore
from space.store import Node, Operation, Store, fencing
from space.store.models import AuditRecord
from space.store.wakeups import OPERATION_FINISHED, OPERATION_QUEUED, LocalWakeups

log = structlog.get_logger("space.controller")

#: How long after a deadline the policy tick that acts on it runs (the deadline must be past when
#: the tick reads the clock).
DEADLINE_SLACK = 0.02

Handler = Callable[[Operation], Awaitable[dict[str, Any] | None]]

#: A sandbox whose runtime dies this often within the window is failed instead of recovered again.
MAX_CRASHES = 3
CRASH_WINDOW = 600.0

#: A sandbox claimed from a warm pool has no row for a moment: reconcile leaves it alone this long
#: (an API that died between claim and insert leaves one, removed after this).
CLAIM_GRACE = float(os.environ.get("SPACE_CLAIM_GRACE", "60"))

#: What a node's heartbeat records for placement (see space.controller.placement).
HEARTBEAT_FIELDS = ("pool", "sandboxes", "templates", "cpus", "memory_mb", "committed_cpu",
                    "committed_memory_mb", "loadavg", "warm", "fence")

#: The share of an operation's lease after which a controller that could not renew it stops.
LEASE_SAFETY = 0.8

#: How many times a retryable failure (node unreachable, timeout) is retried before giving up.
MAX_ATTEMPTS = 5


#: Heartbeats per lease: a lease runs from the arrival of the heartbeat before the last (the one
#: the last acknowledged), so it must span two periods and survive a lost heartbeat or two.
BEATS_PER_LEASE = 5
#: The shortest heartbeat period, whatever a node's lease.
MIN_BEAT_EVERY = 0.5


def heartbeat_period(rows: Iterable[Node], most: float) -> float:
    """Seconds between heartbeat rounds for these nodes: a fifth of the shortest lease among them
    (at least :data:`MIN_BEAT_EVERY`), and ``most`` when none has a lease."""
    periods = [max(MIN_BEAT_EVERY, lease / BEATS_PER_LEASE) for row in rows if (lease := node_lease(row)) is not None]
    return min([most, *periods])


class Controller:
    def __init__(
        self,
        store: Store,
        nodes: NodeRegistry,
        *,
        lease_seconds: float = 10.0,
        concurrency: int = 16,
        reconcile_every: float = 5.0,
        policy_every: float = 2.0,
        template_specs: dict[str, dict[str, Any]] | None = None,
        objects: ObjectStore | None = None,
        leader_lease_seconds: float = 3.0,
        wakeups: LocalWakeups | None = None,
        backup_every: float | None = None,
        operator_tenant: str = "default",
        encrypt_objects: bool = True,
    ) -> None:
        self.store = store
        #: The tenant of the operations the control plane starts on its own (a leaving node's drain).
        self.operator_tenant = operator_tenant
        #: Per node, the leaving it last acted on (its ``since``).
        self._leaving_seen: dict[str, Any] = {}
        self.nodes = nodes
        self.owner = "ctl-" + ids.token(6)
        self.lease_seconds = lease_seconds
        self.reconcile_every = reconcile_every
        self.policy_every = policy_every
        self.lifecycle = LifecycleOps(store, nodes, objects)
        #: Continuous backup: nodes configured, their reports recorded (``backup_every``: the
        #: deployment's default interval; None backs up only sandboxes whose policy asks).
        self.backups = BackupSync(store, objects, every=backup_every)
        #: Seconds between heartbeat rounds: a fifth of the shortest node lease, at most the
        #: reconcile period (:func:`heartbeat_period`).
        self.beat_every = reconcile_every
        #: Per node, the follow-up of its last heartbeat still running (:meth:`_follow_up`).
        self._following: dict[str, asyncio.Task[None]] = {}
        self.lifecycle.backups = self.backups
        #: Snapshots and backups sealed under their tenant's key (``encrypt_objects``): one sealer.
        self.lifecycle.sealer = self.backups.sealer = Sealer(store, enabled=encrypt_objects)
        self.policies = Policies(store, nodes, self.lifecycle)
        self.leadership = Leadership(store, self.owner, self._lead, lease_seconds=leader_lease_seconds)
        self.template_specs = template_specs or {}
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(concurrency)
        self._running: set[asyncio.Task[Any]] = set()
        #: Waiters of operations in this process (long-polls, stream waits), woken by whichever
        #: controller finishes the operation through :attr:`wakeups`; they poll the store as well.
        self._waiters: dict[str, set[asyncio.Event]] = {}
        #: How this process hears of queued and finished operations, whichever process did it.
        self.wakeups = wakeups if wakeups is not None else LocalWakeups()
        self.wakeups.listen(OPERATION_QUEUED, lambda _payload: self._wake.set())
        self.wakeups.listen(OPERATION_FINISHED, self._finished_somewhere)
        self.moves = Moves(store, nodes, self.lifecycle, self.wake)
        self._handlers: dict[str, Handler] = {
            "sandbox.create": self._create_sandbox,
            "sandbox.delete": self._delete_sandbox,
            "template.build": self._build_template,
            **self.lifecycle.handlers(),
            **self.moves.handlers(),
            **TemplateOps(self).handlers(),
            **KeyRotation(store, nodes).handlers(),
        }
        self._failure_handlers: dict[str, Callable[[Operation, SpaceError], Awaitable[None]]] = \
            self.lifecycle.failure_handlers() | self.moves.failure_handlers() | TemplateOps(self).failure_handlers()
        # A lost node's sandboxes come back elsewhere through the same operation as a crash's.
        self.node_loss = NodeLoss(store, nodes, self.lifecycle)
        self._handlers["sandbox.recover"] = self._recover
        self._failure_handlers["sandbox.recover"] = self._recover_failed

    async def _recover(self, op: Operation) -> dict[str, Any]:
        if op.request.get("lost_node"):
            return await self.node_loss.relocate(op)
        return await self.lifecycle.recover(op)

    async def _recover_failed(self, op: Operation, exc: SpaceError) -> None:
        if op.request.get("lost_node"):
            await self.node_loss.relocate_failed(op, exc)
        else:
            await self.lifecycle.rollback_failed(op, exc)

    def wake(self) -> None:
        """Tell the controllers, this one and the others, that a new operation is waiting (saves
        them the poll interval)."""
        self.wakeups.post(OPERATION_QUEUED, "")

    def watch(self, op_id: str) -> asyncio.Event:
        """An event set when this replica finishes ``op_id`` (call :meth:`unwatch` after)."""
        ev = asyncio.Event()
        self._waiters.setdefault(op_id, set()).add(ev)
        return ev

    def unwatch(self, op_id: str, ev: asyncio.Event) -> None:
        evs = self._waiters.get(op_id)
        if evs is not None:
            evs.discard(ev)
            if not evs:
                del self._waiters[op_id]

    def _notify(self, op_id: str) -> None:
        for ev in self._waiters.get(op_id, ()):
            ev.set()

    def _finished_somewhere(self, op_id: str | None) -> None:
        if op_id is not None:
            self._notify(op_id)
            return
        for evs in self._waiters.values():  # wake-ups may have been missed: every waiter re-reads
            for ev in evs:
                ev.set()

    # -- main loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Claim operations until cancelled; lead (run the singletons) while elected."""
        log.info("controller.started", owner=self.owner)
        leading = asyncio.create_task(self.leadership.run(), name="leadership")
        try:
            while True:
                if not await self._claim_some():
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout=1.0)
        finally:
            leading.cancel()
            await asyncio.gather(leading, return_exceptions=True)
            for t in list(self._running):
                t.cancel()
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)

    async def _lead(self) -> None:
        """The singletons, run by the leader only (cancelled the moment it stops leading):
        reconcile with the nodes (heartbeats, egress sync and audit drain included) and the
        lifecycle policies (idle, lifetime, snapshot schedules, retention)."""
        # Heartbeats on their own clock: they renew the nodes' fencing leases, so a slow
        # reconcile or policy tick must not hold them back.
        heartbeats = asyncio.create_task(self._heartbeat_loop())
        try:
            await self._lead_loop()
        finally:
            heartbeats.cancel()
            following = list(self._following.values())
            for t in following:
                t.cancel()
            await asyncio.gather(heartbeats, *following, return_exceptions=True)
            self._following.clear()

    async def _heartbeat_loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                # What follows a heartbeat (stale copies, backup configuration and records, egress
                # sync) runs apart: a slow call there must not hold back the next lease renewals.
                await self.check_nodes(follow_up=False)
            except SpaceError as exc:
                log.warning("controller.heartbeats_failed", error=str(exc))
            await asyncio.sleep(max(0.05, started + self.beat_every - time.monotonic()))

    async def _lead_loop(self) -> None:
        last_reconcile = last_policy = -float("inf")
        while True:
            now = time.monotonic()
            if now - last_reconcile >= self.reconcile_every:
                last_reconcile = now
                try:
                    await self.reconcile(heartbeats=False)
                except SpaceError as exc:
                    log.warning("controller.reconcile_failed", error=str(exc))
            if now >= self._next_policy(last_policy):
                last_policy = now
                try:
                    if await self.policies.tick():
                        self.wake()  # it queued operations: claim them now
                except SpaceError as exc:
                    log.warning("controller.policies_failed", error=str(exc))
            wake_at = min(last_reconcile + self.reconcile_every, self._next_policy(last_policy))
            await asyncio.sleep(max(0.05, wake_at - time.monotonic()))

    def _next_policy(self, last: float) -> float:
        """When the next policy tick is due: a period after the last, or just after the nearest
        deadline the last one saw, whichever comes first."""
        due = last + self.policy_every
        if self.policies.next_deadline is not None:
            due = min(due, self.policies.next_deadline + DEADLINE_SLACK)
        return due

    async def _claim_some(self) -> bool:
        claimed_any = False
        while not self._slots.locked():
            op = await self.store.claim_operation(self.owner, self.lease_seconds)
            if op is None:
                break
            claimed_any = True
            await self._slots.acquire()
            task = asyncio.create_task(self._execute(op), name=f"op:{op.id}")
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        return claimed_any

    async def carry_out_here(self, op: Operation, *, wait: float) -> Operation:
        """Carry out ``op``, which this replica claimed as it recorded it (``claim_for`` of
        :meth:`Store.start_operation`), here and now: under its lease and fencing like any claimed
        operation, without the round trip through the queue (a pause is a millisecond's work on
        the node; the claim would be most of it). Returns the operation once finished, or as it
        stands after ``wait`` seconds (it goes on; a crash leaves its lease to expire, and a
        controller carries it out again)."""
        assert op.status == "running" and op.lease_owner == self.owner, "claimed by this replica first"
        await self._slots.acquire()
        task = asyncio.create_task(self._execute(op), name=f"op:{op.id}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        done, _ = await asyncio.wait({task}, timeout=wait)
        if task in done and not task.cancelled() and task.exception() is None:
            finished = task.result()
            if finished is not None:
                return finished
        return op

    async def _execute(self, op: Operation) -> Operation | None:
        """Run ``op``'s handler under its lease and record the outcome as the lease's holder.

        The lease is this controller's licence to work on ``op``: when it is lost (another
        controller took it over after it expired, or the database stayed out of reach until it
        would have) the handler is cancelled where it stands and nothing is recorded; the
        controller that holds the lease now runs the (idempotent) handler again and finishes."""
        me = asyncio.current_task()
        assert me is not None
        lost = asyncio.Event()
        keeper = asyncio.create_task(self._keep_lease(op, me, lost), name=f"lease:{op.id}")
        bound = log.bind(op=op.id, kind=op.kind, target=op.target, attempt=op.attempts)
        try:
            # Every write of the handler is fenced by the lease (the keeper, started before, is not).
            with fencing.fenced(op.id, self.owner):
                return await self._carry_out(op, bound)
        except asyncio.CancelledError:
            if lost.is_set() and me.uncancel() == 0:
                bound.warning("operation.fenced", hint="its lease was lost: the holder finishes it")
                return None
            raise
        except LeaseLost as exc:
            bound.warning("operation.fenced", lease_owner=exc.details.get("lease_owner"))
            return None
        finally:
            keeper.cancel()
            self._slots.release()
            self.wakeups.post(OPERATION_FINISHED, op.id)

    async def _carry_out(self, op: Operation, bound: Any) -> Operation | None:
        """The operation as finished, or None when it was left for a retry."""
        t0 = time.perf_counter()
        handler = self._handlers.get(op.kind)
        if handler is None:
            return await self.store.finish_operation(op.id, "failed", error_code="internal", owner=self.owner,
                                                     error_message=f"unknown operation kind {op.kind}")
        try:
            # One operation at a time per target, in order, is the claim's rule
            # (Store.claim_operation), across every replica.
            result = await handler(op)
        except LeaseLost:
            raise  # fenced: the lease's holder carries it out (_execute)
        except SpaceError as exc:
            if exc.retryable and op.attempts < MAX_ATTEMPTS:
                # Leave it running: the lease expires and a later claim retries it.
                bound.warning("operation.retry", error=str(exc))
                return None
            bound.warning("operation.failed", error=str(exc))
            await self._on_failure(op, exc)
            return await self.store.finish_operation(op.id, "failed", error_code=exc.code, owner=self.owner,
                                                     error_message=exc.message)
        except Exception as exc:
            bound.exception("operation.crashed")
            err = Internal(f"unexpected error: {exc!r}")
            await self._on_failure(op, err)
            return await self.store.finish_operation(op.id, "failed", error_code="internal", owner=self.owner,
                                                     error_message=err.message)
        finished = await self.store.finish_operation(op.id, "succeeded", result=result or {}, owner=self.owner)
        bound.info("operation.succeeded", ms=round((time.perf_counter() - t0) * 1000, 1))
        return finished

    async def _keep_lease(self, op: Operation, work: asyncio.Task[Any], lost: asyncio.Event) -> None:
        """Renew ``op``'s lease every third of its length; cancel ``work`` once it is lost, or once
        renewals failed for so long that the lease may have expired (another controller may be
        running the operation then: this one must have stopped before it could)."""
        held_since = time.monotonic()  # the claim's lease started no later than this
        step = self.lease_seconds / 3
        next_renewal = held_since + step
        while True:
            deadline = held_since + self.lease_seconds * LEASE_SAFETY
            await asyncio.sleep(max(0.0, min(next_renewal, deadline) - time.monotonic()))
            held: bool | None = None
            if time.monotonic() < deadline:
                asked = time.monotonic()
                try:
                    # Bounded by the deadline: a renewal that hangs must not outlast the lease.
                    async with asyncio.timeout(max(0.01, deadline - asked)):
                        held = await self.store.renew_lease(op.id, self.owner, self.lease_seconds)
                except (SpaceError, TimeoutError) as exc:
                    log.warning("operation.lease_renew_failed", op=op.id, error=str(exc) or "timed out")
                if held:
                    held_since = asked
                    next_renewal = asked + step
                    continue
                next_renewal = time.monotonic() + min(step, 0.2)  # retry soon, within the lease
            if held is False or time.monotonic() >= deadline:
                log.warning("operation.lease_lost", op=op.id, owner=self.owner,
                            reason="taken over" if held is False else "not renewed in time")
                lost.set()
                work.cancel()
                return

    async def _on_failure(self, op: Operation, exc: SpaceError) -> None:
        if isinstance(exc, ObjectTampered):
            try:
                await self.lifecycle.tampered(op, exc)
            except SpaceError as err:
                log.warning("operation.tamper_record_failed", op=op.id, error=str(err))
        if isinstance(exc, KeyUnavailable):
            try:
                await self.lifecycle.key_refused(op, exc)
            except SpaceError as err:
                log.warning("operation.key_event_failed", op=op.id, error=str(err))
        special = self._failure_handlers.get(op.kind)
        if special is not None:
            try:
                await special(op, exc)
            except SpaceError as err:
                log.warning("operation.failure_handler_failed", op=op.id, error=str(err))
        elif op.kind == "sandbox.create":
            with contextlib.suppress(SpaceError):
                await self.store.set_sandbox_state(op.target, State.FAILED, expect=[State.CREATING],
                                                   error_code=exc.code, error_message=exc.message)
        elif op.kind == "sandbox.delete":
            with contextlib.suppress(SpaceError):
                await self.store.set_sandbox_state(op.target, State.FAILED, expect=[State.TERMINATING],
                                                   error_code=exc.code, error_message=exc.message)
        elif op.kind == "template.build":
            with contextlib.suppress(SpaceError):
                t = await self.store.get_template(op.target)
                await self.store.upsert_template(op.target, digest=t.digest, status="failed", spec=t.spec,
                                                 error=exc.message)

    # -- handlers ---------------------------------------------------------------------------

    async def _create_sandbox(self, op: Operation) -> dict[str, Any]:
        sb = await self.store.get_sandbox(op.target)
        if sb.state == State.RUNNING and sb.node_id is not None:
            # Only a create moves a sandbox from creating to running: an earlier attempt got that
            # far and lost its lease before it could record it (fencing). The create is done.
            return {"sandbox_id": sb.id, "node_id": sb.node_id, "timings": {}}
        if sb.state != State.CREATING:
            raise Conflict(f"sandbox {sb.id} is {sb.state}; it was deleted while being created",
                           state=sb.state)
        await self._wait_template(op, sb.template)
        if sb.node_id is None:
            node = await self.nodes.schedule(placement.Request(sb.template, sb.cpu, sb.memory_mb))
            sb = await self.store.update_sandbox(sb.id, node_id=node.node_id)
        else:
            node = await self.nodes.client(sb.node_id)
        body = {"template": sb.template, "cpu": sb.cpu, "memory_mb": sb.memory_mb, "env": sb.env,
                "disk_mb": sb.disk_mb, "egress": await self.lifecycle.egress(sb)}
        try:
            info = await node.call("PUT", f"/v1/sandboxes/{sb.id}", json_body=body)
        except Unavailable:
            # The node went away (its heartbeats will mark it down): the retry places the sandbox
            # anew. Should the node have created it after all, reconcile removes it there.
            await self.store.update_sandbox(sb.id, node_id=None)
            raise
        except NotFound:
            # A node that joined after the template was built: materialize it there (from the
            # object store or the host cache when it can, else by building), then create.
            await self._materialize(op, node, sb.template)
            info = await node.call("PUT", f"/v1/sandboxes/{sb.id}", json_body=body)
        await failpoints.hit("controller.create.after_node")
        try:
            await self.store.set_sandbox_state(
                sb.id, State.RUNNING, expect=[State.CREATING],
                instance_id=info.get("instance_id"), template_digest=info.get("template_digest"),
            )
        except InvalidState:
            # Deleted meanwhile: the delete operation removes it from the node.
            raise Conflict(f"sandbox {sb.id} was deleted while being created") from None
        return {"sandbox_id": sb.id, "node_id": node.node_id, "timings": info.get("timings", {})}

    async def _materialize(self, op: Operation, node: NodeClient, name: str) -> None:
        t = await self.store.get_template(name)
        spec = t.spec or self.template_specs.get(name)
        if not spec:
            raise NotFound(f"template {name!r} is not on node {node.node_id} and has no spec to build it from")
        await self.store.set_operation_progress(op.id, {"message": f"materializing template {name} on {node.node_id}"})
        logins = await registry_logins(self.lifecycle.credentials, self.operator_tenant, spec,
                                       target=f"template:{name}")
        async for item in node.ensure_template(spec, registry_auth=logins):
            if "error" in item:
                err = item["error"]
                raise from_wire(500, {"error": {**err, "message": f"node {node.node_id}: {err.get('message')}"}})
            if "log" in item:
                await self.store.append_operation_logs(op.id, [str(item["log"])])

    async def _wait_template(self, op: Operation, name: str, timeout: float = 1800.0) -> None:
        """A create that arrives while its template is still building waits for the build."""
        deadline = time.monotonic() + timeout
        while True:
            t = await self.store.get_template(name)
            if t.status == "ready":
                return
            if t.status == "failed":
                raise Unavailable(f"template {name!r} failed to build: {t.error}")
            if time.monotonic() > deadline:
                raise Unavailable(f"template {name!r} is still building")
            await self.store.set_operation_progress(op.id, {"message": f"waiting for template {name}"})
            await asyncio.sleep(1.0)

    async def _wait_nodes(self, op: Operation, timeout: float = 1800.0) -> list[NodeClient]:
        """The ready nodes, waiting for the first one to join: a cluster's control plane starts
        before its nodes, and its first build is queued when it starts."""
        deadline = time.monotonic() + timeout
        while not (nodes := await self.nodes.ready_nodes(placeable=True)):
            if time.monotonic() > deadline:
                raise Unavailable("no ready node to build the template on")
            await self.store.set_operation_progress(op.id, {"message": "waiting for a node to join"})
            await asyncio.sleep(1.0)
        return nodes

    async def _delete_sandbox(self, op: Operation) -> dict[str, Any]:
        sb = await self.store.get_sandbox(op.target)
        if sb.state == State.TERMINATED:
            return {"sandbox_id": sb.id}
        if sb.node_id is not None:
            node = await self.nodes.client(sb.node_id)
            await node.call("DELETE", f"/v1/sandboxes/{sb.id}")
        await self.lifecycle.forget_artifacts(sb)
        await self.store.set_sandbox_state(sb.id, State.TERMINATED)
        return {"sandbox_id": sb.id}

    async def _build_template(self, op: Operation) -> dict[str, Any]:
        spec = dict(op.request.get("spec") or self.template_specs.get(op.target) or {})
        if not spec:
            raise NotFound(f"no spec for template {op.target!r}")
        force = bool(op.request.get("force", False))
        # One node builds; it publishes the template to object storage, from which every other
        # node materializes it when a sandbox is first placed there (_materialize).
        nodes = (await self._wait_nodes(op))[:1]
        logins = await registry_logins(self.lifecycle.credentials, self.operator_tenant, spec,
                                       target=f"template:{op.target}")
        result: dict[str, Any] = {}
        for node in nodes:
            pending: list[str] = []
            last_flush = time.monotonic()
            async for item in node.ensure_template(spec, force=force, registry_auth=logins):
                if "log" in item:
                    pending.append(str(item["log"]))
                    if len(pending) >= 20 or time.monotonic() - last_flush > 0.5:
                        await self.store.append_operation_logs(op.id, pending)
                        await self.store.set_operation_progress(op.id, {"message": pending[-1]})
                        pending, last_flush = [], time.monotonic()
                elif "error" in item:
                    if pending:
                        await self.store.append_operation_logs(op.id, pending)
                    err = item["error"]
                    raise from_wire(500, {"error": {**err, "message": f"node {node.node_id}: {err.get('message')}"}})
                elif "template" in item:
                    result = item["template"]
            if pending:
                await self.store.append_operation_logs(op.id, pending)
        digest = str(result.get("digest"))
        await self.store.upsert_template(op.target, digest=digest, status="ready",
                                         spec=spec, size_bytes=result.get("size_bytes"))
        lines = [f"template {op.target} ready: {digest}"]
        tags = [str(t) for t in op.request.get("tags") or []]
        if tags:  # after the template: a tag never names a build that is not ready
            await self.store.tag_template(op.target, tags, digest=digest,
                                          build_id=str(op.request.get("e2b_build") or op.id))
            lines.append(f"tagged {', '.join(f'{op.target}:{t}' for t in tags)}")
        await self.store.append_operation_logs(op.id, lines)
        return {"template": op.target, "digest": digest, **({"tags": tags} if tags else {})}

    # -- reconciliation ---------------------------------------------------------------------

    async def check_nodes(self, down_after: float = 15.0, *, follow_up: bool = True) -> None:
        """Heartbeat every registered node, all at once (a node that does not answer must not hold
        back the others' heartbeats, which renew their fencing leases): a node silent for
        ``down_after`` seconds is ``unreachable`` (not scheduled onto), past its lease ``lost``
        (:mod:`space.controller.node_loss`), and ``ready`` again when it answers. ``follow_up``:
        wait for what follows each answer (:meth:`_follow_up`); otherwise it runs in the
        background, one at a time per node (a node whose last one still runs gets none now)."""
        now = time.time()
        pools = await self.warm_targets()
        rows = await self.store.list_nodes(None)
        self.beat_every = heartbeat_period(rows, self.reconcile_every)
        results = await asyncio.gather(*(self._check_node(row, pools, now, down_after, follow_up) for row in rows),
                                       return_exceptions=True)
        for row, result in zip(rows, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("node.check_failed", node=row.id, error=repr(result)[:300])
        self.nodes.invalidate_rows()

    async def _check_node(self, row: Node, pools: list[dict[str, Any]], now: float, down_after: float,
                          follow_up: bool = True) -> None:
        wanted = [] if row.cordoned else pools  # a cordoned node lets its warm sandboxes go
        try:
            node = await self.nodes.client(row.id)
            beat = self.node_loss.heartbeats.params(row.id)
            info = await node.call("GET", "/v1/node", params=beat, timeout=5)
            self.node_loss.heartbeats.answered(row.id, beat["hb"])
            if _pool_sizes(info.get("warm") or []) != _pool_sizes(wanted):
                # The node's warm pools converge on the database's (a new node, a restart,
                # a change this node missed).
                info["warm"] = (await node.call("PUT", "/v1/pool", json_body={"targets": wanted},
                                                timeout=5))["pools"]
        except SpaceError as exc:
            if row.state == "joining":  # why a node stays joining (its TLS, its address)
                log.warning("node.unreachable", node=row.id, state=row.state, error=exc.message[:300])
            if row.state == "ready" and now - row.heartbeat_at.timestamp() > down_after:
                log.warning("node.unreachable", node=row.id, silent_s=round(now - row.heartbeat_at.timestamp(), 1))
                await self.store.set_node_state(row.id, "unreachable")
            await self.node_loss.silent(row, now)
            return
        if row.state != "ready":
            log.info("node.up", node=row.id)
        await self.store.heartbeat_node(row.id, {k: info.get(k) for k in HEARTBEAT_FIELDS})
        if follow_up:
            await self._follow_up(row, node, info)
            return
        running = self._following.get(row.id)
        if running is None or running.done():
            self._following[row.id] = asyncio.create_task(self._follow_up(row, node, info, log_errors=True))

    async def _follow_up(self, row: Node, node: NodeClient, info: dict[str, Any], *, log_errors: bool = False) -> None:
        """What a node's answer asks for: its stale copies released or discarded, its backups
        configured and recorded, its gateway's secrets and audit synced."""
        try:
            await self._follow_up_once(row, node, info)
        except Exception as exc:
            if not log_errors:
                raise
            log.error("node.follow_up_failed", node=row.id, error=repr(exc)[:300])

    async def _follow_up_once(self, row: Node, node: NodeClient, info: dict[str, Any]) -> None:
        await self.node_loss.release_or_discard(row, node, info)
        if info.get("leaving") and not row.cordoned:
            await self._drain_leaving(row, info["leaving"])
        try:
            await self.backups.sync(row.id, node, info)
        except SpaceError as exc:  # the next heartbeat tries again
            log.warning("backup.sync_failed", node=row.id, error=str(exc))
        try:
            await self._sync_egress(row.id, node, info)
        except SpaceError as exc:  # the next heartbeat tries again
            log.warning("egress.sync_failed", node=row.id, error=str(exc))

    async def _drain_leaving(self, row: Node, leaving: Any) -> None:
        """A node going away for good (``space node leave``: its pod's preStop hook, or an operator
        retiring its machine) is drained while its leaving waits. Once: the drain cordons it, and
        an operator's uncordon is not undone while the same leaving stands."""
        reason = str(leaving.get("reason") if isinstance(leaving, dict) else "")[:200] or "unknown"
        since = leaving.get("since") if isinstance(leaving, dict) else None
        if self._leaving_seen.get(row.id) == since:
            return
        self._leaving_seen[row.id] = since
        try:
            _, op, created = await start_drain(self.store, row.id, tenant=self.operator_tenant,
                                               reason=f"the node is leaving: {reason}")
        except SpaceError as exc:  # nowhere to go, or not ready: its sandboxes stay (node loss covers them)
            log.warning("node.leaving_not_drained", node=row.id, reason=reason, error=exc.message)
            return
        if created:
            log.info("node.leaving", node=row.id, reason=reason, operation=op.id)
            self.nodes.invalidate_rows()
            self.wake()

    async def _sync_egress(self, node_id: str, node: NodeClient, info: dict[str, Any]) -> None:
        """Give the node's gateway back the secrets its agent lost in a restart, and move the
        gateway's audit journal into the audit log (acknowledged only once stored)."""
        for sid in info.get("egress_missing") or []:
            try:
                sb = await self.store.get_sandbox(sid)
            except NotFound:
                continue
            if sb.node_id == node_id and sb.state in (State.RUNNING, State.PAUSED):
                await node.call("PUT", f"/v1/sandboxes/{sid}/egress", json_body=await self.lifecycle.egress(sb),
                                timeout=10)
        while info.get("network"):
            batch = await node.call("GET", "/v1/egress/audit", params={"after": 0, "limit": 1000}, timeout=10)
            records = batch.get("records") or []
            if not records:
                return
            await self.store.record_audit([_gateway_record(node_id, r) for r in records])
            await node.call("POST", "/v1/egress/audit/ack", json_body={"upto": records[-1]["seq"]}, timeout=10)
            if len(records) < 1000:
                return

    async def warm_targets(self) -> list[dict[str, Any]]:
        return [{"template": p.template, "cpu": p.cpu, "memory_mb": p.memory_mb, "size": p.size}
                for p in await self.store.list_warm_pools()]

    async def push_warm_pools(self) -> None:
        """Send the warm pool sizes to every ready node now (after a change through the API)."""
        pools = await self.warm_targets()
        for node in await self.nodes.ready_nodes(placeable=True):
            try:
                status = (await node.call("PUT", "/v1/pool", json_body={"targets": pools}, timeout=5))["pools"]
                row = await self.store.get_node(node.node_id)
                await self.store.heartbeat_node(node.node_id, {**(row.capacity or {}), "warm": status})
            except SpaceError as exc:  # the next heartbeat converges it
                log.warning("warm.push_failed", node=node.node_id, error=str(exc))
        self.nodes.invalidate_rows()

    async def reconcile(self, *, heartbeats: bool = True) -> None:
        """Converge nodes with the database: remove what nobody wants, flag what died
        (``heartbeats``: heartbeat every node first; the leader runs those on their own clock)."""
        if heartbeats:
            await self.check_nodes()
        for node_row in await self.store.list_nodes("ready"):
            try:
                node = await self.nodes.client(node_row.id)
                live = (await node.call("GET", "/v1/sandboxes", timeout=5))["sandboxes"]
            except SpaceError as exc:
                log.warning("reconcile.node_unreachable", node=node_row.id, error=str(exc))
                continue
            wanted = {sb.id: sb for sb in await self.store.list_sandboxes(node_id=node_row.id)}
            busy = {op.target for op in await self.store.find_operations(status=["pending", "running"])}
            for item in live:
                sid = item["id"]
                sb = wanted.get(sid)
                if sid in busy:
                    continue
                if sb is None and time.time() - float(item.get("claimed_at") or 0) < CLAIM_GRACE:
                    continue  # claimed from the warm pool; its row is being written
                if sb is None or sb.state in (State.TERMINATED, State.FAILED):
                    log.info("reconcile.remove_unwanted", node=node_row.id, sandbox=sid)
                    with contextlib.suppress(SpaceError):
                        await node.call("DELETE", f"/v1/sandboxes/{sid}")
                elif item.get("status") == "dead" and sb.state in (State.RUNNING, State.PAUSED):
                    cause = item.get("death") or "exited"
                    log.warning("reconcile.sandbox_died", sandbox=sid, cause=cause)
                    with contextlib.suppress(SpaceError):
                        await self.sandbox_died(sid, cause, f"sandbox {sid}'s runtime instance died")
            present = {item["id"] for item in live}
            for sid, sb in wanted.items():
                if sb.state in (State.RUNNING, State.PAUSED) and sid not in present and sid not in busy:
                    log.warning("reconcile.sandbox_missing", sandbox=sid)
                    with contextlib.suppress(SpaceError):
                        await self.store.set_sandbox_state(
                            sid, State.FAILED, expect=[sb.state], error_code="runtime_error",
                            error_message="the sandbox is gone from its node",
                        )

    async def sandbox_died(self, sandbox_id: str, cause: str, message: str) -> State:
        """A sandbox's runtime died under it. Out of memory: ``failed`` with the reason (coming back
        would only die again). Anything else: recover it from its latest snapshot. Returns the
        state the sandbox is in now."""
        sb = await self.store.get_sandbox(sandbox_id)
        if sb.state not in (State.RUNNING, State.PAUSED):
            return State(sb.state)
        failure = None
        if cause == "oom":
            failure = f"sandbox {sandbox_id} ran out of memory (limit {sb.memory_mb} MiB) and was killed"
        else:
            since = time.time() - CRASH_WINDOW
            crashes = [e for e in await self.store.list_events(sandbox_id)
                       if e.kind == "crashed" and e.at.timestamp() >= since]
            if len(crashes) >= MAX_CRASHES:
                # Coming back would only die again: stop the loop, say why.
                failure = (f"sandbox {sandbox_id}'s runtime died {len(crashes) + 1} times in "
                           f"{CRASH_WINDOW // 60:.0f} minutes ({cause}); it is not recovered again")
        if failure is not None:
            try:
                sb = await self.store.set_sandbox_state(sandbox_id, State.FAILED, expect=[sb.state],
                                                        error_code="runtime_error", error_message=failure)
                await self.store.add_event(sandbox_id, sb.tenant, "failed", failure, {"cause": cause})
            except InvalidState:
                sb = await self.store.get_sandbox(sandbox_id)
            return State(sb.state)
        op = Operation(id=ids.operation_id(), tenant=sb.tenant, kind="sandbox.recover", target=sandbox_id,
                       status="pending", request={"cause": cause, "message": message})
        try:
            sb, _, _ = await self.store.start_operation(op, move_to=State.RESTORING, expect=[sb.state])
        except InvalidState:
            return State((await self.store.get_sandbox(sandbox_id)).state)
        await self.store.add_event(sandbox_id, sb.tenant, "crashed", f"{message} ({cause}); recovering",
                                   {"cause": cause})
        self.wake()
        return State.RESTORING

    async def sync_templates(self) -> None:
        """Templates present on nodes become known to the control plane (e.g. a reused pool)."""
        known = {t.name: t for t in await self.store.list_templates()}
        for node in await self.nodes.ready_nodes():
            try:
                items = (await node.call("GET", "/v1/templates"))["templates"]
            except SpaceError:
                continue
            for t in items:
                cur = known.get(t["name"])
                if cur is None or cur.status != "ready":
                    # The node's manifest holds the spec it was made from (a saved or derived
                    # template the database forgot); the configured spec wins for ours.
                    spec = self.template_specs.get(t["name"]) or t.get("spec") or {}
                    await self.store.upsert_template(t["name"], digest=t["digest"], status="ready", spec=spec,
                                                     size_bytes=t.get("size_bytes"))


def _pool_sizes(pools: list[dict[str, Any]]) -> set[tuple[str, float, int, int]]:
    return {(str(p["template"]), float(p["cpu"]), int(p["memory_mb"]), int(p["size"]))
            for p in pools if int(p.get("size") or 0) > 0}


__all__ = ["Controller"]


def _gateway_record(node_id: str, rec: dict[str, Any]) -> AuditRecord:
    at = rec.get("at")
    when = dt.datetime.fromisoformat(at) if isinstance(at, str) else (
        dt.datetime.fromtimestamp(float(at), dt.UTC) if at is not None else None)
    details = dict(rec.get("details") or {})
    details.update(sandbox=rec.get("sandbox"), seq=rec.get("seq"), node=node_id)
    journal = rec.get("journal")
    # A journal from before journals had ids is the node's one journal: its seqs are unique there.
    source = f"{node_id}:{journal if isinstance(journal, str) else '-'}:{rec.get('seq')}"[:200]
    return AuditRecord(tenant=str(rec.get("tenant") or ""), actor=f"gateway:{node_id}",
                       action=str(rec.get("action", "egress")), target=str(rec.get("target") or ""),
                       result=str(rec.get("result", "")), details=details, at=when, source=source)
