"""Builders and back doors shared by the store tests."""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import update

from space import ids
from space.lifecycle import State
from space.store import Operation, Sandbox, Snapshot, Store


def new_sandbox(tenant: str = "acme", **kw: Any) -> Sandbox:
    fields: dict[str, Any] = {"id": ids.sandbox_id(), "tenant": tenant, "template": "base",
                              "cpu": 1.0, "memory_mb": 512, "state": State.CREATING}
    fields.update(kw)
    return Sandbox(**fields)


def new_op(tenant: str = "acme", kind: str = "sandbox.create", target: str | None = None,
           key: str | None = None, **kw: Any) -> Operation:
    return Operation(id=ids.operation_id(), tenant=tenant, kind=kind, target=target,
                     idempotency_key=key, request=kw.pop("request", {}), **kw)


async def expire_lease(store: Store, op_id: str) -> None:
    """Pretend the lease ran out (as if its holder crashed a while ago)."""
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    async with store._sessionmaker() as s, s.begin():
        await s.execute(update(Operation).where(Operation.id == op_id).values(lease_expires_at=past))


def new_snapshot(sandbox_id: str, tenant: str = "acme", **kw: Any) -> Snapshot:
    fields: dict[str, Any] = {"id": ids.snapshot_id(), "tenant": tenant, "sandbox_id": sandbox_id,
                              "kind": "disk", "origin": "manual", "template": "base"}
    fields.update(kw)
    return Snapshot(**fields)


async def on_two_pools(store: Store, worker: Callable[[Store, str], Awaitable[None]], n: int) -> None:
    """Run ``n`` workers named ``ctl-0``… at once, alternating between ``store`` and a second
    store on the same database (another controller process, in effect)."""
    import anyio

    replica = await Store.open(store.url)
    try:
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(worker, store if i % 2 else replica, f"ctl-{i}")
    finally:
        await replica.close()
