"""Operations: idempotent creates (the machinery the sandbox and snapshot creates share), claims
under a lease, progress, outcomes and logs."""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

from sqlalchemy import ColumnElement, and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from space.errors import Conflict, InvalidRequest, LeaseLost, NotFound
from space.store.base import StoreBase, _rowcount, log
from space.store.models import OPERATION_FINAL, Base, Operation, OperationLog, Sandbox, Snapshot, utcnow

_T = TypeVar("_T")

#: Operation statuses in which an operation may still use what its request names.
OPERATION_ACTIVE = ("pending", "running")


class OperationStore(StoreBase):
    """Operations and their logs."""

    async def create_operation(self, op: Operation) -> tuple[Operation, bool]:
        """Insert an operation; an idempotency key the tenant already used returns that one."""
        _prepare_operation(op, utcnow())

        async def existing(s: AsyncSession) -> tuple[Operation, bool] | None:
            prior = await self._find_idempotent(s, op)
            return None if prior is None else (prior, False)

        def insert(s: AsyncSession) -> tuple[Operation, bool]:
            s.add(op)
            return op, True

        return await self._idempotent_create(op, existing, insert)

    async def _find_idempotent(self, s: AsyncSession, op: Operation) -> Operation | None:
        if op.idempotency_key is None:
            return None
        prior = await s.scalar(
            select(Operation).where(
                Operation.tenant == op.tenant, Operation.idempotency_key == op.idempotency_key
            )
        )
        if prior is not None and prior.kind != op.kind:
            raise Conflict(
                f"idempotency key {op.idempotency_key!r} was already used for a {prior.kind} operation",
                operation_id=prior.id,
            )
        return prior

    async def _create_with_op(
        self,
        op: Operation,
        rows: Sequence[Base],
        replay: Callable[[AsyncSession, Operation], Awaitable[_T]],
        created: _T,
        now: dt.datetime | None = None,
        check: Callable[[AsyncSession], Awaitable[None]] | None = None,
    ) -> _T:
        """Insert ``rows`` and ``op`` in one transaction, or, when the op's idempotency key was
        used before, return what ``replay`` makes of the earlier operation. ``check`` runs in the
        same transaction before a new insert (the quota), never before a replay."""
        _prepare_operation(op, now or utcnow())

        async def existing(s: AsyncSession) -> _T | None:
            prior = await self._find_idempotent(s, op)
            if prior is None:
                if check is not None:
                    await check(s)
                return None
            return await replay(s, prior)

        def insert(s: AsyncSession) -> _T:
            s.add_all([*rows, op])
            return created

        return await self._idempotent_create(op, existing, insert)

    async def _idempotent_create(
        self,
        op: Operation,
        existing: Callable[[AsyncSession], Any],
        insert: Callable[[AsyncSession], _T],
    ) -> _T:
        try:
            async with self._tx() as s:
                found = await existing(s)
                if found is not None:
                    return cast(_T, found)
                await self._stamp_accepted(s, op)
                return insert(s)
        except Conflict:
            if op.idempotency_key is None:
                raise
        # A concurrent request with the same key committed first (the unique constraint stopped
        # us): its rows are visible now.
        log.debug("idempotent create lost a race", key=op.idempotency_key, tenant=op.tenant)
        async with self._tx(write=False) as s:
            found = await existing(s)
        if found is None:
            raise Conflict(f"operation {op.id} conflicts with an existing row")
        return cast(_T, found)

    async def _stamp_accepted(self, s: AsyncSession, op: Operation) -> None:
        """An operation's ``created_at`` is when the database accepted it: operations on one target
        run in that order (:func:`_first_in_line`), and API replicas on several machines, whose
        clocks disagree, must not reorder them. (SQLite: one machine's clock already.)"""
        if self.dialect == "postgresql":
            op.created_at = op.updated_at = await self._db_now(s)

    async def get_operation(self, op_id: str, tenant: str | None = None) -> Operation:
        op = await self._by_key(Operation, op_id)
        if op is None or (tenant is not None and op.tenant != tenant):
            raise NotFound(f"operation {op_id} not found")
        return op

    async def find_operations(
        self,
        *,
        target: str | None = None,
        status: Sequence[str] | None = None,
        kind: str | None = None,
    ) -> list[Operation]:
        q = select(Operation).order_by(Operation.created_at, Operation.id)
        if target is not None:
            q = q.where(Operation.target == target)
        if status is not None:
            q = q.where(Operation.status.in_(list(status)))
        if kind is not None:
            q = q.where(Operation.kind == kind)
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def claim_operation(
        self,
        owner: str,
        lease_seconds: float,
        kinds: Sequence[str] | None = None,
        op_id: str | None = None,
    ) -> Operation | None:
        """Take the oldest pending operation, or a running one whose lease expired, that is first
        in line on its target.

        Operations on one target (a sandbox, a template) run one at a time in the order they were
        accepted, whichever replica claims them: one is claimable only while no earlier one on
        its target is still pending or running, and no other one on it runs under a live lease
        (that covers an earlier request that committed after a later one was already claimed).
        The claim sets ``running``, the lease and ``attempts += 1``. With ``op_id`` only that
        operation is considered. None when there is nothing to take.
        """
        postgres = self.dialect == "postgresql"
        async with self._tx() as s:
            # Leases run on the database's clock: every controller judges expiry alike.
            now = await self._db_now(s)
            claimable = _claimable(now)
            where: list[ColumnElement[bool]] = [claimable, _first_in_line(now)]
            if kinds is not None:
                where.append(Operation.kind.in_(list(kinds)))
            if op_id is not None:
                where.append(Operation.id == op_id)
            candidates = (select(Operation.id, Operation.target).where(*where)
                          .order_by(Operation.created_at, Operation.id))
            if postgres:
                # Claimers skip each other's candidates instead of queueing behind them.
                candidates = candidates.with_for_update(skip_locked=True)
            for cand, target in list(await s.execute(candidates.limit(8))):
                if postgres and not await s.scalar(select(func.pg_try_advisory_xact_lock(_target_lock_key(target)))):
                    # Another claimer is deciding about this target right now. Waiting could
                    # deadlock two claimers that lock targets in different orders: skip it.
                    continue
                # Checked again under the target's lock (PostgreSQL: a fresh snapshot per
                # statement; SQLite: one writer), so two claimers never both pass it.
                res = await s.execute(
                    update(Operation)
                    .where(Operation.id == cand, claimable, _first_in_line(now))
                    .values(
                        status="running",
                        lease_owner=owner,
                        lease_expires_at=now + dt.timedelta(seconds=lease_seconds),
                        attempts=Operation.attempts + 1,
                        updated_at=now,
                    )
                    .execution_options(synchronize_session=False)
                )
                if _rowcount(res) == 1:
                    claimed = await self._get(s, Operation, cand, "operation")
                    log.debug("operation claimed", op_id=cand, owner=owner, attempts=claimed.attempts)
                    return claimed
        return None

    async def _target_busy(self, s: AsyncSession, target: str) -> bool:
        """Whether an operation on ``target`` is pending or running (a new one would queue)."""
        found = await s.scalar(select(Operation.id).where(Operation.target == target,
                                                          Operation.status.in_(OPERATION_ACTIVE)).limit(1))
        return found is not None

    async def renew_lease(self, op_id: str, owner: str, lease_seconds: float) -> bool:
        """Extend ``owner``'s lease; False if the operation is no longer running under it."""
        async with self._tx() as s:
            now = await self._db_now(s)
            res = await s.execute(
                update(Operation)
                .where(Operation.id == op_id, Operation.status == "running", Operation.lease_owner == owner)
                .values(lease_expires_at=now + dt.timedelta(seconds=lease_seconds), updated_at=now)
                .execution_options(synchronize_session=False)
            )
            return _rowcount(res) == 1

    async def set_operation_progress(self, op_id: str, progress: dict[str, Any]) -> None:
        async with self._tx() as s:
            res = await s.execute(
                update(Operation).where(Operation.id == op_id)
                .values(progress=progress, updated_at=utcnow())
                .execution_options(synchronize_session=False)
            )
            if _rowcount(res) == 0:
                raise NotFound(f"operation {op_id} not found")

    async def finish_operation(
        self,
        op_id: str,
        status: str,
        *,
        result: dict[str, Any] | None = None,
        error_code: str | None = None,
        error_message: str | None = None,
        owner: str | None = None,
    ) -> Operation:
        """Record the outcome and release the lease.

        With ``owner``, only the holder of the lease may finish (LeaseLost otherwise), so a
        controller that lost its lease cannot overwrite the work of the one that took over.
        """
        if status not in OPERATION_FINAL:
            raise InvalidRequest(f"invalid final status {status!r}: must be succeeded or failed")
        async with self._tx() as s:
            op = await self._get(s, Operation, op_id, "operation", lock=True)
            if owner is not None and op.lease_owner != owner:
                raise LeaseLost(
                    f"operation {op_id} is leased by {op.lease_owner!r}, not {owner!r}",
                    lease_owner=op.lease_owner,
                )
            now = utcnow()
            op.status = status
            op.result = result
            op.error_code = error_code
            op.error_message = error_message
            op.lease_expires_at = None
            op.finished_at = now
            op.updated_at = now
            return op

    async def append_operation_logs(self, op_id: str, lines: Sequence[str]) -> int:
        """Append lines (numbered from 1 per operation); returns the last sequence number."""
        async with self._tx() as s:
            # Locking the operation row serializes appenders, so sequence numbers never collide.
            found = await s.scalar(select(Operation.id).where(Operation.id == op_id).with_for_update())
            if found is None:
                raise NotFound(f"operation {op_id} not found")
            last = await s.scalar(
                select(func.coalesce(func.max(OperationLog.seq), 0)).where(OperationLog.op_id == op_id)
            )
            seq = int(last or 0)
            if lines:
                now = utcnow()
                s.add_all(
                    OperationLog(op_id=op_id, seq=seq + i, line=line, at=now)
                    for i, line in enumerate(lines, start=1)
                )
            return seq + len(lines)

    async def get_operation_logs(self, op_id: str, after: int = 0, limit: int = 1000) -> list[OperationLog]:
        """Lines with ``seq > after``, oldest first, at most ``limit``."""
        q = (
            select(OperationLog)
            .where(OperationLog.op_id == op_id, OperationLog.seq > after)
            .order_by(OperationLog.seq)
            .limit(limit)
        )
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))


def _claimable(now: dt.datetime) -> ColumnElement[bool]:
    """Pending, or running under a lease that expired (its holder is presumed gone)."""
    return or_(
        Operation.status == "pending",
        and_(
            Operation.status == "running",
            or_(Operation.lease_expires_at.is_(None), Operation.lease_expires_at < now),
        ),
    )


def _first_in_line(now: dt.datetime) -> ColumnElement[bool]:
    """No other operation on the same target is ahead of this one (accepted earlier and not
    finished) or running under a live lease."""
    other = aliased(Operation)
    ahead = or_(
        other.created_at < Operation.created_at,
        and_(other.created_at == Operation.created_at, other.id < Operation.id),
    )
    live = and_(other.status == "running", other.lease_expires_at.is_not(None), other.lease_expires_at >= now)
    blocking = (
        select(other.id)
        .where(other.target == Operation.target, other.id != Operation.id,
               other.status.in_(OPERATION_ACTIVE), or_(ahead, live))
        .correlate(Operation)
    )
    return ~blocking.exists()


def _target_lock_key(target: str) -> Any:
    """The PostgreSQL advisory lock key of a target (a collision only makes a claimer skip)."""
    return func.hashtext("space.operation-target:" + target)


def _same_tenant(op: Operation, row: Sandbox | Snapshot, what: str) -> None:
    if row.tenant != op.tenant:
        raise InvalidRequest(f"the {what} and its operation must belong to the same tenant")


def _link_request(op: Operation, key: str, value: Any) -> None:
    """Record in the operation's request what it creates, so that a replay can find it."""
    request = dict(op.request or {})
    if key in request and request[key] != value:
        raise InvalidRequest(f"operation request has {key}={request[key]!r}, expected {value!r}")
    request[key] = value
    op.request = request


def _prepare_operation(op: Operation, now: dt.datetime) -> None:
    op.status = op.status or "pending"
    op.request = dict(op.request or {})
    op.attempts = op.attempts or 0
    op.created_at = op.created_at or now
    op.updated_at = op.updated_at or now
