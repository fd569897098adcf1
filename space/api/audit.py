"""/v1/audit: read the audit trail (admin keys; a tenant's own, every tenant's for the operator)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from space.api.auth import Principal, principal
from space.api.fields import Cursor
from space.api.state import AppState, app_state
from space.store.models import AuditRecord

router = APIRouter(prefix="/v1/audit")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]

#: How long a read waits for this replica's queued records, so that a call's own record is there.
FLUSH_WAIT = 1.0


def record_view(r: AuditRecord) -> dict[str, Any]:
    return {
        "id": r.id,
        "at": r.at.isoformat() if r.at else None,
        "tenant": r.tenant,
        "actor": r.actor,
        "action": r.action,
        "target": r.target,
        "result": r.result,
        "status": r.status,
        "details": r.details or {},
    }


@router.get("")
async def list_audit(
    who: Auth,
    st: St,
    after: Cursor = 0,
    action: Annotated[str | None, Query(max_length=64)] = None,
    target: Annotated[str | None, Query(max_length=512)] = None,
    tenant: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """Records with ``id > after``, oldest first. ``action`` ending in ``.`` is a prefix."""
    if tenant is None:
        who.require_admin()
        scope: str | None = None if who.is_operator else who.tenant
    else:
        who.require_manage(tenant)
        scope = tenant
    await st.audit.flush(timeout=FLUSH_WAIT)
    rows = await st.store.list_audit(scope, action=action, target=target, after=after, limit=limit)
    return {"records": [record_view(r) for r in rows], "next": rows[-1].id if rows else after}
