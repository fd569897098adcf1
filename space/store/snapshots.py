"""Snapshots: created (with the operation that takes them), listed, updated, marked deleted, and
which ones must not be deleted now."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from space.errors import Conflict, InvalidRequest, NotFound
from space.lifecycle import State
from space.store.base import _check_choice
from space.store.models import (
    SNAPSHOT_KINDS,
    SNAPSHOT_ORIGINS,
    SNAPSHOT_STATUSES,
    Operation,
    Sandbox,
    Snapshot,
    utcnow,
)
from space.store.operations import OPERATION_ACTIVE, OperationStore, _link_request, _same_tenant

#: Snapshot columns ``update_snapshot`` may change (identity, owner and origin are fixed).
SNAPSHOT_FIELDS = frozenset(
    {"status", "node_id", "object_key", "restorable", "size_bytes", "template_digest", "meta",
     "error"}
)


class SnapshotStore(OperationStore):
    """Snapshots (a create with an operation goes through the operations' idempotent create)."""

    async def create_snapshot(
        self, snap: Snapshot, op: Operation | None = None
    ) -> tuple[Snapshot, Operation | None, bool]:
        """Insert a snapshot row and, if given, the operation that takes it, atomically.

        The operation's ``request["snapshot"]`` names the snapshot (set here when absent), which
        also makes :meth:`snapshot_in_use` true while it is pending or running; its ``target``
        defaults to the sandbox. A replayed idempotency key returns the existing pair and False.
        """
        now = utcnow()
        _prepare_snapshot(snap, now)
        if op is None:
            async with self._tx() as s:
                s.add(snap)
            return snap, None, True
        _same_tenant(op, snap, "snapshot")
        _link_request(op, "snapshot", snap.id)
        if op.target is None:
            op.target = snap.sandbox_id

        async def replay(s: AsyncSession, prior: Operation) -> tuple[Snapshot, Operation | None, bool]:
            found = None
            snapshot_id = prior.request.get("snapshot")
            if isinstance(snapshot_id, str):
                found = await s.get(Snapshot, snapshot_id)
            if found is None:
                raise Conflict(
                    f"idempotency key {op.idempotency_key!r} was used for a request without a snapshot"
                )
            return found, prior, False

        return await self._create_with_op(op, [snap], replay, (snap, op, True), now)

    async def get_snapshot(self, snapshot_id: str, tenant: str | None = None) -> Snapshot:
        """A snapshot; another tenant's is NotFound, exactly like a missing one."""
        async with self._tx(write=False) as s:
            snap = await s.get(Snapshot, snapshot_id)
        if snap is None or (tenant is not None and snap.tenant != tenant):
            raise NotFound(f"snapshot {snapshot_id} not found")
        return snap

    async def list_snapshots(
        self,
        *,
        sandbox_id: str | None = None,
        tenant: str | None = None,
        kinds: Sequence[str] | None = None,
        statuses: Sequence[str] | None = None,
        node_id: str | None = None,
        restorable: bool | None = None,
        name: str | None = None,
        retain: bool | None = None,
    ) -> list[Snapshot]:
        """Snapshots, oldest first; every filter left None matches everything."""
        q = select(Snapshot).order_by(Snapshot.created_at, Snapshot.id)
        if name is not None:
            q = q.where(Snapshot.name == name)
        if retain is not None:
            q = q.where(Snapshot.retain.is_(retain))
        if sandbox_id is not None:
            q = q.where(Snapshot.sandbox_id == sandbox_id)
        if tenant is not None:
            q = q.where(Snapshot.tenant == tenant)
        if kinds is not None:
            q = q.where(Snapshot.kind.in_(list(kinds)))
        if statuses is not None:
            q = q.where(Snapshot.status.in_(list(statuses)))
        if node_id is not None:
            q = q.where(Snapshot.node_id == node_id)
        if restorable is not None:
            q = q.where(Snapshot.restorable.is_(restorable))
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def update_snapshot(self, snapshot_id: str, **fields: Any) -> Snapshot:
        """Change the columns in ``SNAPSHOT_FIELDS``; ``updated_at`` moves."""
        bad = sorted(set(fields) - SNAPSHOT_FIELDS)
        if bad:
            raise InvalidRequest(f"cannot set snapshot field(s) {', '.join(bad)}")
        if "status" in fields:
            _check_choice("snapshot status", fields["status"], SNAPSHOT_STATUSES)
        async with self._tx() as s:
            snap = await self._get(s, Snapshot, snapshot_id, "snapshot", lock=True)
            for name, value in fields.items():
                setattr(snap, name, value)
            snap.updated_at = utcnow()
            return snap

    async def latest_snapshot(
        self,
        sandbox_id: str,
        *,
        kind: str | None = None,
        restorable: bool | None = True,
        node_id: str | None = None,
    ) -> Snapshot | None:
        """The newest ready snapshot of a sandbox, or None.

        ``restorable`` filters exactly like in :meth:`list_snapshots`: True only uploaded ones,
        False only not-yet-uploaded ones, None either.
        """
        q = (
            select(Snapshot)
            .where(Snapshot.sandbox_id == sandbox_id, Snapshot.status == "ready")
            .order_by(Snapshot.created_at.desc(), Snapshot.id.desc())
            .limit(1)
        )
        if kind is not None:
            q = q.where(Snapshot.kind == kind)
        if restorable is not None:
            q = q.where(Snapshot.restorable.is_(restorable))
        if node_id is not None:
            q = q.where(Snapshot.node_id == node_id)
        async with self._tx(write=False) as s:
            return await s.scalar(q)

    async def delete_snapshot_row(self, snapshot_id: str) -> Snapshot:
        """Mark a snapshot deleted; the row stays, for the audit trail."""
        return await self.update_snapshot(snapshot_id, status="deleted")

    async def snapshot_in_use(self, snapshot_id: str) -> bool:
        """Whether deleting the snapshot now would break something (see :meth:`snapshots_in_use`)."""
        return snapshot_id in await self.snapshots_in_use()

    async def snapshots_in_use(self) -> set[str]:
        """Every snapshot that must not be deleted now: one a pending or running operation names
        (``request["snapshot"]`` or in ``request["snapshots"]``), or one a sandbox that is not
        terminated keeps its suspended state in (``Sandbox.snapshot_id``)."""
        async with self._tx(write=False) as s:
            held = await s.scalars(
                select(Sandbox.snapshot_id)
                .where(Sandbox.snapshot_id.is_not(None), Sandbox.state != State.TERMINATED)
            )
            out = {str(h) for h in held}
            # Active operations are few, and JSON containment differs per dialect: read in Python.
            requests = await s.scalars(
                select(Operation.request).where(Operation.status.in_(OPERATION_ACTIVE))
            )
            for req in requests:
                out.update(_snapshots_named(req))
            return out


def _snapshots_named(request: dict[str, Any] | None) -> set[str]:
    if not isinstance(request, dict):
        return set()
    out = {str(request["snapshot"])} if request.get("snapshot") else set()
    many = request.get("snapshots")
    if isinstance(many, list):
        out.update(str(m) for m in many)
    return out


def _prepare_snapshot(snap: Snapshot, now: dt.datetime) -> None:
    snap.status = snap.status or "creating"
    _check_choice("snapshot kind", snap.kind, SNAPSHOT_KINDS)
    _check_choice("snapshot origin", snap.origin, SNAPSHOT_ORIGINS)
    _check_choice("snapshot status", snap.status, SNAPSHOT_STATUSES)
    snap.restorable = bool(snap.restorable)
    snap.retain = bool(snap.retain)
    snap.meta = dict(snap.meta or {})
    snap.created_at = snap.created_at or now
    snap.updated_at = snap.updated_at or now
