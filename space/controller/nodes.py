"""Which nodes exist and how to reach them; scheduling of new sandboxes onto them."""

from __future__ import annotations

import structlog

from space.errors import NotFound, Unavailable
from space.node.client import NodeClient
from space.store import Store

log = structlog.get_logger("space.controller.nodes")


class NodeRegistry:
    """Node clients built from the ``nodes`` table (the database is the truth, this is a cache)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._clients: dict[str, NodeClient] = {}

    async def client(self, node_id: str) -> NodeClient:
        c = self._clients.get(node_id)
        if c is not None:
            return c
        try:
            row = await self.store.get_node(node_id)
        except NotFound:
            raise Unavailable(f"node {node_id} is not registered") from None
        c = NodeClient(row.id, row.url, row.token)
        self._clients[node_id] = c
        return c

    async def forget(self, node_id: str) -> None:
        c = self._clients.pop(node_id, None)
        if c is not None:
            await c.aclose()

    async def ready_nodes(self) -> list[NodeClient]:
        return [await self.client(n.id) for n in await self.store.list_nodes("ready")]

    async def schedule(self) -> NodeClient:
        """Pick the node for a new sandbox: the ready node with the fewest live sandboxes."""
        nodes = await self.store.list_nodes("ready")
        if not nodes:
            raise Unavailable("no ready node to place the sandbox on")
        if len(nodes) == 1:  # nothing to weigh: skip counting every live sandbox
            return await self.client(nodes[0].id)
        counts: dict[str, int] = {n.id: 0 for n in nodes}
        for sb in await self.store.list_sandboxes(states=["creating", "running", "paused"]):
            if sb.node_id in counts:
                counts[sb.node_id] += 1
        best = min(nodes, key=lambda n: counts[n.id])
        return await self.client(best.id)

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()
