"""Where a tenant's objects live in object storage (the node checks each manifest's binding to it)."""

from __future__ import annotations

from space.store.models import Sandbox, Snapshot


def object_prefix(sb: Sandbox, snapshot_id: str) -> str:
    return f"tenants/{sb.tenant}/sandboxes/{sb.id}/snapshots/{snapshot_id}"


def sandbox_prefix(sb: Sandbox) -> str:
    return f"tenants/{sb.tenant}/sandboxes/{sb.id}/"


def retained_prefix(snap: Snapshot) -> str:
    """Outside every sandbox's prefix: deleting its sandbox's objects leaves it."""
    return f"tenants/{snap.tenant}/snapshots/{snap.id}"
