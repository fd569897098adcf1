"""Sandboxes: created (one, or several for a fork) with their operation under the tenant's quota,
read, moved between states, updated and touched; and ``start_operation``, which records an
operation on a sandbox, the snapshot it makes and the state it moves to in one transaction."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from space import ids
from space.errors import Conflict, InvalidRequest, InvalidState, NotFound
from space.lifecycle import State, allowed_actions, transition
from space.store import quotas
from space.store.base import _require_aware, _translate_errors
from space.store.models import Base, Operation, Sandbox, SandboxEvent, Snapshot, utcnow
from space.store.operations import OperationStore, _link_request, _prepare_operation, _same_tenant
from space.store.snapshots import _prepare_snapshot
from space.store.tenants import TenantStore

#: Sandbox columns a caller may change besides the state.
SANDBOX_FIELDS = frozenset(
    {"template", "template_digest", "node_id", "instance_id", "cpu", "memory_mb", "disk_mb", "env", "meta",
     "error_code", "error_message", "idle_pause_s", "idle_suspend_s", "expires_at",
     "expire_action", "auto_resume", "public_ports", "port_host", "snapshot_policy", "last_active_at", "parent_id",
     "source_snapshot", "snapshot_id", "egress", "secrets", "token_nonce", "evict_node", "backup"}
)


class SandboxStore(OperationStore, TenantStore):
    """Sandboxes. Their creates go through the operations' idempotent create and enforce the
    tenant's quota in the same transaction, hence both bases."""

    async def create_sandbox(self, sandbox: Sandbox, op: Operation) -> tuple[Sandbox, Operation, bool]:
        """Insert a sandbox and the operation that creates it, atomically.

        With ``op.idempotency_key`` set and already used by the tenant, nothing is written and the
        existing pair comes back with ``False``.
        """
        _same_tenant(op, sandbox, "sandbox")
        if op.target is None:
            op.target = sandbox.id
        now = utcnow()
        _prepare_sandbox(sandbox, now)
        if self._fast_sessions is not None and op.idempotency_key is None:
            # SQLite, nothing to look up first: the two-row insert synchronously, under the same
            # single-writer lock as every other write (~0.6 ms of the loop instead of ~3 ms of
            # trips to aiosqlite's thread, on every create's critical path).
            _prepare_operation(op, now)
            assert self._write_lock is not None
            async with self._write_lock:
                with _translate_errors(), self._fast_sessions() as fs, fs.begin():
                    self._enforce_quota_sync(fs, sandbox.tenant, quotas.QuotaDemand.of([sandbox]))
                    fs.add_all([sandbox, op])
            return sandbox, op, True

        async def replay(s: AsyncSession, prior: Operation) -> tuple[Sandbox, Operation, bool]:
            sb = await s.get(Sandbox, prior.target)
            if sb is None:
                raise Conflict(
                    f"idempotency key {op.idempotency_key!r} was used for a request without a sandbox"
                )
            return sb, prior, False

        async def check(s: AsyncSession) -> None:
            await self._enforce_quota(s, sandbox.tenant, quotas.QuotaDemand.of([sandbox]))

        return await self._create_with_op(op, [sandbox], replay, (sandbox, op, True), now, check)

    async def create_sandboxes(
        self, sandboxes: list[Sandbox], op: Operation, snapshot: Snapshot | None = None
    ) -> tuple[list[Sandbox], Operation, bool]:
        """Insert several sandboxes (a fork), the snapshot they start from if it is new, and the
        operation, atomically.

        The sandbox ids go into ``op.request["sandbox_ids"]`` (in order); a replay with the same
        idempotency key returns those sandboxes, the existing operation and ``False``. The
        operation's ``target`` defaults to the first sandbox's parent (or the sandbox itself).
        """
        if not sandboxes:
            raise InvalidRequest("create_sandboxes needs at least one sandbox")
        for sb in sandboxes:
            _same_tenant(op, sb, "sandbox")
        sandbox_ids = [sb.id for sb in sandboxes]
        if len(set(sandbox_ids)) != len(sandbox_ids):
            raise InvalidRequest("create_sandboxes got the same sandbox id twice")
        _link_request(op, "sandbox_ids", sandbox_ids)
        if op.target is None:
            op.target = sandboxes[0].parent_id or sandboxes[0].id
        now = utcnow()
        for sb in sandboxes:
            _prepare_sandbox(sb, now)
        rows: list[Base] = list(sandboxes)
        if snapshot is not None:
            _same_tenant(op, snapshot, "snapshot")
            _prepare_snapshot(snapshot, now)
            rows.append(snapshot)

        async def replay(s: AsyncSession, prior: Operation) -> tuple[list[Sandbox], Operation, bool]:
            wanted = prior.request.get("sandbox_ids")
            if not isinstance(wanted, list) or not wanted:
                raise Conflict(
                    f"idempotency key {op.idempotency_key!r} was used for a request without sandboxes"
                )
            found = {sb.id: sb for sb in await s.scalars(select(Sandbox).where(Sandbox.id.in_(wanted)))}
            missing = [sid for sid in wanted if sid not in found]
            if missing:
                raise Conflict(f"operation {prior.id} names sandboxes that do not exist: {missing}")
            return [found[sid] for sid in wanted], prior, False

        demand = quotas.QuotaDemand.of(
            sandboxes, storage=snapshot is not None and snapshot.origin in quotas.STORAGE_CHECKED_ORIGINS)

        async def check(s: AsyncSession) -> None:
            await self._enforce_quota(s, op.tenant, demand)

        return await self._create_with_op(op, rows, replay, (list(sandboxes), op, True), now, check)

    async def get_sandbox(self, sandbox_id: str, tenant: str | None = None) -> Sandbox:
        """A sandbox; another tenant's is NotFound, exactly like a missing one."""
        sb = await self._by_key(Sandbox, sandbox_id)
        if sb is None or (tenant is not None and sb.tenant != tenant):
            raise NotFound(f"sandbox {sandbox_id} not found")
        return sb

    async def list_sandboxes(
        self,
        tenant: str | None = None,
        states: Sequence[str] | None = None,
        node_id: str | None = None,
    ) -> list[Sandbox]:
        q = select(Sandbox).order_by(Sandbox.created_at, Sandbox.id)
        if tenant is not None:
            q = q.where(Sandbox.tenant == tenant)
        if states is not None:
            q = q.where(Sandbox.state.in_([State(st) for st in states]))
        if node_id is not None:
            q = q.where(Sandbox.node_id == node_id)
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def set_sandbox_state(
        self,
        sandbox_id: str,
        state: State | str,
        *,
        expect: State | str | Sequence[State | str] | None = None,
        event: tuple[str, str, dict[str, Any]] | None = None,
        **fields: Any,
    ) -> Sandbox:
        """Move a sandbox to ``state`` (checked by :func:`space.lifecycle.transition`).

        ``expect`` makes it a compare-and-set: unless the current state is one of those given,
        InvalidState is raised and nothing changes. ``fields`` are set in the same write, and so
        is ``event`` (kind, message, data) on its timeline.
        """
        _check_sandbox_fields(fields)
        expected = None if expect is None else _states(expect)
        async with self._tx() as s:
            sb = await self._get(s, Sandbox, sandbox_id, "sandbox", lock=True)
            now = utcnow()
            _move(sb, state, expected, now, fields)
            if event is not None:
                kind, message, data = event
                s.add(SandboxEvent(sandbox_id=sb.id, tenant=sb.tenant, at=now, kind=kind, message=message,
                                   data=dict(data)))
            return sb

    async def clear_eviction(self, sandbox_id: str, node_id: str) -> None:
        """The copy of ``sandbox_id`` on ``node_id`` is gone (a no-op if the row names another)."""
        async with self._tx() as s:
            await s.execute(update(Sandbox).where(Sandbox.id == sandbox_id, Sandbox.evict_node == node_id)
                            .values(evict_node=None).execution_options(synchronize_session=False))

    async def update_sandbox(self, sandbox_id: str, **fields: Any) -> Sandbox:
        """Change non-state columns (see ``SANDBOX_FIELDS``)."""
        _check_sandbox_fields(fields)
        async with self._tx() as s:
            sb = await self._get(s, Sandbox, sandbox_id, "sandbox", lock=True)
            for name, value in fields.items():
                setattr(sb, name, value)
            sb.generation += 1
            sb.updated_at = utcnow()
            return sb

    async def touch_sandbox(self, sandbox_id: str, at: dt.datetime) -> None:
        """Record activity at ``at``; an older report than the one stored changes nothing.

        Neither the generation nor ``updated_at`` moves: activity is not a change of the sandbox,
        and bumping would make every watcher re-read it. An unknown id is silently ignored.
        """
        _require_aware(at, "at")
        async with self._tx() as s:
            await s.execute(
                update(Sandbox)
                .where(
                    Sandbox.id == sandbox_id,
                    or_(Sandbox.last_active_at.is_(None), Sandbox.last_active_at < at),
                )
                .values(last_active_at=at)
                .execution_options(synchronize_session=False)
            )

    async def record_backup(self, sandbox_id: str, node_id: str | None, fields: dict[str, Any]) -> bool:
        """Merge ``fields`` into the sandbox's ``backup`` (what of it is durable), if it still runs on
        ``node_id`` (None: wherever it is): a node's late report after a move changes nothing. Like
        activity, not a change of the sandbox: neither its generation nor ``updated_at`` moves.
        Returns whether it was stored."""
        async with self._tx() as s:
            q = select(Sandbox).where(Sandbox.id == sandbox_id).with_for_update()
            sb = (await s.scalars(q)).first()
            if sb is None or (node_id is not None and sb.node_id != node_id):
                return False
            await s.execute(
                update(Sandbox).where(Sandbox.id == sandbox_id)
                .values(backup={**(sb.backup or {}), **fields})
                .execution_options(synchronize_session=False)
            )
        return True

    # ---- an operation on a sandbox --------------------------------------------------------------

    async def start_operation(
        self,
        op: Operation,
        *,
        move_to: State | None = None,
        expect: State | str | Sequence[State | str] | None = None,
        snapshot: Snapshot | None = None,
        claim_for: tuple[str, float] | None = None,
    ) -> tuple[Sandbox, Operation, bool]:
        """Record ``op`` on the sandbox ``op.target`` and, in the same transaction, insert the
        ``snapshot`` it makes and move the sandbox to ``move_to`` (a compare-and-set against
        ``expect``): a crash leaves all of it or none, never a state without the operation that
        finishes it. An idempotency key the tenant already used returns the earlier operation.

        ``claim_for=(owner, lease_seconds)``: the operation is claimed by ``owner`` in the same
        write (``running``, its lease, attempt 1), as :meth:`claim_operation` would, when no other
        operation on the sandbox is pending or running; else it is left pending for the
        controllers. The sandbox row's lock orders this against every other write on it."""
        now = utcnow()
        _prepare_operation(op, now)
        if snapshot is not None:
            _same_tenant(op, snapshot, "snapshot")
            _link_request(op, "snapshot", snapshot.id)
            _prepare_snapshot(snapshot, now)
        expected = None if expect is None else _states(expect)

        async def existing(s: AsyncSession) -> tuple[Sandbox, Operation, bool] | None:
            prior = await self._find_idempotent(s, op)
            if prior is None:
                return None
            return await self._get(s, Sandbox, prior.target, "sandbox"), prior, False

        try:
            async with self._tx() as s:
                found = await existing(s)
                if found is not None:
                    return found
                if snapshot is not None and snapshot.origin in quotas.STORAGE_CHECKED_ORIGINS:
                    await self._enforce_quota(s, op.tenant, quotas.QuotaDemand(storage=True))
                sb = await self._get(s, Sandbox, op.target, "sandbox", lock=True)
                if move_to is not None:
                    _move(sb, move_to, expected, now)
                await self._stamp_accepted(s, op)  # after the row lock: the order they got it in
                if claim_for is not None and not await self._target_busy(s, op.target):
                    owner, lease_seconds = claim_for
                    db_now = await self._db_now(s)
                    op.status, op.lease_owner, op.attempts = "running", owner, 1
                    op.lease_expires_at = db_now + dt.timedelta(seconds=lease_seconds)
                s.add_all([*([snapshot] if snapshot is not None else []), op])
                return sb, op, True
        except InvalidState:
            raise
        except Conflict:
            if op.idempotency_key is None:
                raise
        async with self._tx(write=False) as s:  # a concurrent request with the same key won
            found = await existing(s)
        if found is None:
            raise Conflict(f"operation {op.id} conflicts with an existing row")
        return found


#: States of a sandbox that is being or has been deleted.
_GONE = frozenset({State.TERMINATING, State.TERMINATED})


def _move(sb: Sandbox, state: State | str, expected: frozenset[State] | None, now: dt.datetime,
          fields: Mapping[str, Any] | None = None) -> None:
    """The one state change of a sandbox row, whichever write makes it: a compare-and-set against
    ``expected``, the transition the state machine allows, ``fields`` set alongside."""
    current = State(sb.state)
    if expected is not None and current not in expected:
        raise InvalidState(
            f"sandbox {sb.id} is {current.value}, expected " + " or ".join(sorted(st.value for st in expected)),
            state=current.value, allowed=allowed_actions(current))
    new = transition(current, state)
    for name, value in (fields or {}).items():
        setattr(sb, name, value)
    sb.state = new
    sb.generation += 1
    sb.updated_at = now
    if new in _GONE and current not in _GONE:
        # Whatever deletes it: its E2B tokens (and URLs signed with them) die with it.
        sb.token_nonce = ids.token_nonce()
    if new == State.TERMINATED and sb.terminated_at is None:
        sb.terminated_at = now


def _states(expect: State | str | Sequence[State | str]) -> frozenset[State]:
    if isinstance(expect, str):  # a State is a str too
        return frozenset({State(expect)})
    return frozenset(State(st) for st in expect)


def _check_sandbox_fields(fields: Iterable[str]) -> None:
    bad = sorted(set(fields) - SANDBOX_FIELDS)
    if bad:
        raise InvalidRequest(f"cannot set sandbox field(s) {', '.join(bad)}")


def _prepare_sandbox(sb: Sandbox, now: dt.datetime) -> None:
    sb.state = State(sb.state or State.CREATING)
    # Always its own: a row never inherits tokens (a fork's copy, an id seen before).
    sb.token_nonce = ids.token_nonce()
    sb.env = dict(sb.env or {})
    sb.meta = dict(sb.meta or {})
    sb.snapshot_policy = dict(sb.snapshot_policy or {})
    sb.generation = sb.generation or 1
    sb.created_at = sb.created_at or now
    sb.updated_at = sb.updated_at or now
