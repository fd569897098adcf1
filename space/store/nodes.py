"""Nodes: registration, heartbeats, states, and marking silent nodes down."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import and_, select, update

from space.errors import InvalidRequest, NotFound
from space.store.base import StoreBase, _rowcount
from space.store.models import NODE_STATES, Node, utcnow


class NodeStore(StoreBase):
    """Nodes."""

    async def upsert_node(self, node_id: str, url: str, token: str, capacity: dict[str, Any]) -> Node:
        """Register a node, or refresh its address, token and capacity; either way it is ready."""
        now = utcnow()
        stmt = self._insert(Node).values(
            id=node_id, url=url, token=token, state="ready", capacity=capacity,
            heartbeat_at=now, created_at=now,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[Node.id],
            set_={"url": url, "token": token, "state": "ready", "capacity": capacity, "heartbeat_at": now},
        )
        async with self._tx() as s:
            await s.execute(stmt)
            return await self._get(s, Node, node_id, "node")

    async def heartbeat_node(self, node_id: str, capacity: dict[str, Any]) -> None:
        """Record that the node is alive (a down node comes back ready)."""
        async with self._tx() as s:
            res = await s.execute(
                update(Node).where(Node.id == node_id)
                .values(capacity=capacity, heartbeat_at=utcnow(), state="ready")
                .execution_options(synchronize_session=False)
            )
            if _rowcount(res) == 0:
                raise NotFound(f"node {node_id} not found")

    async def set_node_state(self, node_id: str, state: str) -> Node:
        if state not in NODE_STATES:
            raise InvalidRequest(f"invalid node state {state!r}: must be one of {', '.join(NODE_STATES)}")
        async with self._tx() as s:
            node = await self._get(s, Node, node_id, "node", lock=True)
            node.state = state
            return node

    async def set_node_cordoned(self, node_id: str, cordoned: bool) -> Node:
        """Take the node out of placement (``True``) or put it back; its health is not touched."""
        async with self._tx() as s:
            node = await self._get(s, Node, node_id, "node", lock=True)
            node.cordoned = cordoned
            return node

    async def mark_stale_nodes_down(self, stale_after: float) -> list[str]:
        """Mark ready nodes whose last heartbeat is older than ``stale_after`` seconds unreachable."""
        cutoff = utcnow() - dt.timedelta(seconds=stale_after)
        stale = and_(Node.state == "ready", Node.heartbeat_at < cutoff)
        async with self._tx() as s:
            node_ids = list(await s.scalars(select(Node.id).where(stale).with_for_update()))
            if node_ids:
                await s.execute(
                    update(Node).where(Node.id.in_(node_ids), stale).values(state="unreachable")
                    .execution_options(synchronize_session=False)
                )
        return node_ids

    async def list_nodes(self, state: str | None = "ready") -> list[Node]:
        q = select(Node).order_by(Node.id)
        if state is not None:
            q = q.where(Node.state == state)
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def get_node(self, node_id: str) -> Node:
        async with self._tx(write=False) as s:
            return await self._get(s, Node, node_id, "node")
