"""Append-only logs: a sandbox's events and the audit trail."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select

from space.store.base import StoreBase
from space.store.models import AuditRecord, SandboxEvent, utcnow


class EventStore(StoreBase):
    """Sandbox events and audit records."""

    # ---- events ---------------------------------------------------------------------------------

    async def add_event(
        self,
        sandbox_id: str,
        tenant: str,
        kind: str,
        message: str,
        data: dict[str, Any] | None = None,
    ) -> SandboxEvent:
        ev = SandboxEvent(sandbox_id=sandbox_id, tenant=tenant, at=utcnow(), kind=kind,
                          message=message, data=dict(data or {}))
        async with self._tx() as s:
            s.add(ev)
            await s.flush()  # assigns the id
        return ev

    async def list_events(
        self, sandbox_id: str, *, after: int = 0, limit: int = 1000
    ) -> list[SandboxEvent]:
        """Events with ``id > after``, oldest first, at most ``limit``."""
        q = (
            select(SandboxEvent)
            .where(SandboxEvent.sandbox_id == sandbox_id, SandboxEvent.id > after)
            .order_by(SandboxEvent.id)
            .limit(limit)
        )
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    # ---- audit ----------------------------------------------------------------------------------

    async def record_audit(self, records: Sequence[AuditRecord]) -> None:
        """Append audit records in one transaction (a gateway ships its decisions in batches)."""
        if not records:
            return
        now = utcnow()
        for rec in records:
            rec.at = rec.at or now
            rec.target = rec.target or ""
            rec.details = dict(rec.details or {})
        shipped = [r for r in records if r.source is not None]
        async with self._tx() as s:
            s.add_all([r for r in records if r.source is None])
            if shipped:
                # Stored once however often shipped: what is there already is skipped.
                cols = ("at", "tenant", "actor", "action", "target", "result", "status", "details", "source")
                stmt = self._insert(AuditRecord).values([{c: getattr(r, c) for c in cols} for r in shipped])
                await s.execute(stmt.on_conflict_do_nothing(index_elements=[AuditRecord.source]))

    async def list_audit(
        self,
        tenant: str | None,
        *,
        action: str | None = None,
        target: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[AuditRecord]:
        """Records with ``id > after``, oldest first. ``action`` ending in ``.`` matches a prefix
        (``egress.`` → every egress decision); ``tenant=None`` is every tenant (admins)."""
        q = select(AuditRecord).where(AuditRecord.id > after)
        if tenant is not None:
            q = q.where(AuditRecord.tenant == tenant)
        if action:
            q = q.where(AuditRecord.action.startswith(action) if action.endswith(".")
                        else AuditRecord.action == action)
        if target:
            q = q.where(AuditRecord.target == target)
        async with self._tx(write=False) as s:
            return list(await s.scalars(q.order_by(AuditRecord.id).limit(limit)))
