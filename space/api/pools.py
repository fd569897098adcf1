"""/v1/pools: warm pool sizes per template and size (admin to change, anyone to read)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from space.api.auth import Principal, principal
from space.api.fields import MAX_CPU, MAX_MEMORY_MB, MIN_MEMORY_MB, Int64, Number
from space.api.state import AppState, app_state
from space.errors import InvalidRequest, SpaceError
from space.node.sandboxes.warm import MAX_SIZE, MEMORY_BUDGET
from space.store import Node, WarmPool

router = APIRouter(prefix="/v1/pools")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]


class SetPool(BaseModel):
    #: Warm sandboxes each node keeps ready (0 removes the pool).
    size: Annotated[Int64, Field(ge=0, le=MAX_SIZE)]
    cpu: Number = Field(1.0, gt=0, le=MAX_CPU)
    memory_mb: Annotated[Int64, Field(ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB)] = 512


def pool_view(p: WarmPool, reports: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    per_node: dict[str, Any] = {}
    for node_id, warm in reports.items():
        for w in warm:
            if (w.get("template") == p.template and float(w.get("cpu", 0)) == p.cpu
                    and int(w.get("memory_mb", 0)) == p.memory_mb):
                per_node[node_id] = {k: w.get(k) for k in ("ready", "booting", "effective_size", "claimed",
                                                           "failures", "last_error", "boot_ms_p50")}
    return {
        "template": p.template,
        "cpu": p.cpu,
        "memory_mb": p.memory_mb,
        "size": p.size,
        "ready": sum(int(v.get("ready") or 0) for v in per_node.values()),
        "booting": sum(int(v.get("booting") or 0) for v in per_node.values()),
        "nodes": per_node,
        "updated_at": p.updated_at.isoformat() if p.updated_at else None,
    }


async def _reports(st: AppState, nodes: list[Node]) -> dict[str, list[dict[str, Any]]]:
    """Each ready node's pools as it reports them now (its last heartbeat if it does not answer)."""

    async def one(n: Node) -> list[dict[str, Any]]:
        try:
            client = await st.nodes.client(n.id)
            return list((await client.call("GET", "/v1/pool", timeout=2))["pools"])
        except SpaceError:
            return list((n.capacity or {}).get("warm") or [])

    found = await asyncio.gather(*(one(n) for n in nodes))
    return {n.id: warm for n, warm in zip(nodes, found, strict=True)}


@router.get("")
async def list_pools(who: Auth, st: St) -> dict[str, Any]:
    """Sizes as set, and what each node has ready now."""
    reports = await _reports(st, await st.store.list_nodes("ready"))
    return {"pools": [pool_view(p, reports) for p in await st.store.list_warm_pools()]}


@router.put("/{template}")
async def set_pool(template: str, body: SetPool, who: Auth, st: St) -> dict[str, Any]:
    who.require_operator()
    await st.store.get_template(template)  # 404 for an unknown template
    nodes = await st.store.list_nodes("ready")
    others = sum(p.size * p.memory_mb for p in await st.store.list_warm_pools()
                 if (p.template, p.cpu, p.memory_mb) != (template, body.cpu, body.memory_mb))
    for n in nodes:
        mem = int((n.capacity or {}).get("memory_mb") or 0)
        budget = int(mem * MEMORY_BUDGET)
        if mem and others + body.size * body.memory_mb > budget:
            fits = max(0, (budget - others) // body.memory_mb)
            raise InvalidRequest(
                f"warm pools would hold {others + body.size * body.memory_mb} MiB of sandbox memory on node "
                f"{n.id}, over its budget of {budget} MiB ({MEMORY_BUDGET:.0%} of {mem} MiB); at most "
                f"{fits} of {body.memory_mb} MiB fit", field="size", max_size=fits,
            )
    row = await st.store.set_warm_pool(template, cpu=body.cpu, memory_mb=body.memory_mb, size=body.size)
    await st.controller.push_warm_pools()
    return pool_view(row, await _reports(st, await st.store.list_nodes("ready")))


@router.delete("/{template}")
async def delete_pool(template: str, who: Auth, st: St, cpu: Annotated[float, Query(gt=0, le=MAX_CPU)] = 1.0,
                      memory_mb: Annotated[int, Query(ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB)] = 512) -> dict[str, Any]:
    who.require_operator()
    row = await st.store.set_warm_pool(template, cpu=cpu, memory_mb=memory_mb, size=0)
    await st.controller.push_warm_pools()
    return pool_view(row, {})
