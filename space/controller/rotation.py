"""A tenant's key rotation (``tenant.rewrap``): once a tenant's key is changed, new snapshots and
backup links are sealed under the new one at once (:mod:`space.controller.sealing`); this job
re-wraps the data keys of everything stored before, so that the old key can be retired.

Nothing is re-encrypted: a node opens each manifest's data key under the key it names and wraps it
under the new one, rewriting only the manifest (``POST /v1/objects/rewrap``). One object at a time,
its progress counted on the operation. It is idempotent: what is under the new key already is
skipped, so a job that failed (the old key refused, a node lost) is finished by running it again,
and the operations on one tenant run in the order they were set.
"""

from __future__ import annotations

from typing import Any

import structlog

from space import ids
from space.controller.lifecycle_ops import LONG
from space.controller.nodes import NodeRegistry
from space.kms import KeyRef
from space.lifecycle import State
from space.store import Operation, Store

log = structlog.get_logger("space.controller.rotation")

KIND = "tenant.rewrap"


def rewrap_target(tenant: str) -> str:
    return f"tenant/{tenant}"


async def start_rewrap(store: Store, tenant: str, key: KeyRef, *, actor_tenant: str) -> Operation:
    """Queue the re-wrap of ``tenant``'s stored data keys under ``key`` (the caller wakes the
    controllers)."""
    op = Operation(id=ids.operation_id(), tenant=actor_tenant, kind=KIND, target=rewrap_target(tenant),
                   status="pending", request={"tenant": tenant, "key": key.to_json()})
    op, _ = await store.create_operation(op)
    return op


class KeyRotation:
    def __init__(self, store: Store, nodes: NodeRegistry) -> None:
        self.store = store
        self.nodes = nodes

    def handlers(self) -> dict[str, Any]:
        return {KIND: self.rewrap}

    async def _stored(self, tenant: str) -> list[dict[str, Any]]:
        """Every manifest of the tenant's in object storage: its shipped snapshots, then each
        backup chain's links."""
        items: list[dict[str, Any]] = []
        for snap in await self.store.list_snapshots(tenant=tenant, statuses=["ready"]):
            if snap.object_key:
                items.append({"sandbox_id": snap.sandbox_id, "snapshot_id": snap.id, "prefix": snap.object_key})
        live = [s.value for s in State if s not in (State.TERMINATING, State.TERMINATED)]
        for sb in await self.store.list_sandboxes(tenant=tenant, states=live):
            rec = sb.backup or {}
            chain, seq, prefix = rec.get("chain"), rec.get("seq"), rec.get("prefix")
            if isinstance(chain, str) and isinstance(seq, int) and isinstance(prefix, str):
                items += [{"sandbox_id": sb.id, "prefix": prefix, "chain": chain, "seq": n} for n in range(seq + 1)]
        return items

    async def rewrap(self, op: Operation) -> dict[str, Any]:
        tenant, key = str(op.request["tenant"]), KeyRef.from_json(op.request["key"])
        items = await self._stored(tenant)
        progress: dict[str, Any] = {"total": len(items), "done": 0, "rewrapped": 0, "key": key.to_json()}
        await self.store.set_operation_progress(op.id, progress)
        node = await self.nodes.schedule()
        for item in items:
            res = await node.call("POST", "/v1/objects/rewrap", timeout=LONG,
                                  json_body={"tenant": tenant, "key": key.to_json(), **item})
            progress["done"] += 1
            progress["rewrapped"] += 1 if res.get("rewrapped") else 0
            await self.store.set_operation_progress(op.id, progress)
        log.info("tenant.rewrapped", tenant=tenant, key=key.key_id, objects=progress["done"],
                 rewrapped=progress["rewrapped"])
        return progress
