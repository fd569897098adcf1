"""Which nodes exist and how to reach them; scheduling of new sandboxes onto them."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog

from space.cluster.identity import ControlPlaneTLS
from space.controller import placement
from space.controller.fresh import Fresh
from space.errors import NotFound, Unavailable
from space.node.api.client import NodeClient
from space.store import Node, Store

log = structlog.get_logger("space.controller.nodes")

#: States in which a sandbox holds (or is about to hold) resources on its node.
LIVE_STATES = ["creating", "running", "paused", "restoring", "suspending", "moving"]


@dataclasses.dataclass
class _Cached:
    client: NodeClient
    #: What the client was built from: a node that joined again (new address, new certificate)
    #: or a re-minted client certificate gets a new client.
    identity: tuple[str, str, str | None, int]
    checked_at: float


class NodeRegistry:
    """Node clients built from the ``nodes`` table (the database is the truth, this is a cache).

    Another replica may admit a node again at a new address at any moment: a cached client is
    checked against the node's row when it is more than ``rows_ttl`` seconds old, and dropped at
    once when the node stops answering."""

    def __init__(self, store: Store, *, rows_ttl: float = 1.0, tls: ControlPlaneTLS | None = None) -> None:
        self.store = store
        self.tls = tls
        self._clients: dict[str, _Cached] = {}
        self.rows_ttl = rows_ttl
        self._closing: set[asyncio.Task[None]] = set()
        # (No nodes is never cached: the first node to register is used at once.)
        self._rows: Fresh[str, list[Node]] = Fresh("node_rows", self._placeable, ttl=rows_ttl, cacheable=bool)

    async def placeable_rows(self) -> list[Node]:
        """The rows of the nodes new sandboxes may go to (ready, not cordoned), at most
        ``rows_ttl`` seconds old: the create hot path reads them on every call, and placement
        tolerates heartbeats that are seconds old anyway. While creates come, they are read again
        in the background before they get older (no read on the request's path)."""
        return await self._rows.get(PLACEABLE)

    async def _placeable(self, _: str) -> list[Node]:
        return [n for n in await self.store.list_nodes("ready") if not n.cordoned]

    def invalidate_rows(self) -> None:
        """Forget the cached rows (this replica just changed what they say)."""
        self._rows.forget(PLACEABLE)

    def _row_at_hand(self, node_id: str) -> Node | None:
        """The node's row from the placeable rows, if they are fresh (no read)."""
        for n in self._rows.peek(PLACEABLE) or ():
            if n.id == node_id:
                return n
        return None

    async def client(self, node_id: str) -> NodeClient:
        cached = self._clients.get(node_id)
        now = time.monotonic()
        generation = self.tls.generation if self.tls is not None else 0
        if cached is not None and now - cached.checked_at <= self.rows_ttl and cached.identity[3] == generation:
            return cached.client
        # The row the placement just read serves as well as a read of its own.
        row = self._row_at_hand(node_id)
        if row is None:
            try:
                row = await self.store.get_node(node_id)
            except NotFound:
                await self.forget(node_id)
                raise Unavailable(f"node {node_id} is not registered") from None
        tls = self.tls.context() if self.tls is not None and row.url.startswith("https://") else None
        identity = (row.url, row.token, row.key_sha256, self.tls.generation if self.tls is not None else 0)
        if cached is not None and cached.identity == identity:
            cached.checked_at = now
            return cached.client
        if cached is not None:
            log.info("node.client_replaced", node=node_id, url=row.url)
            self._retire(cached.client)
        c = NodeClient(row.id, row.url, row.token, tls=tls)
        self._clients[node_id] = _Cached(c, identity, now)
        return c

    def _retire(self, client: NodeClient) -> None:
        # Calls in flight on the old client finish on it; it is closed once they have.
        task = asyncio.create_task(_close_later(client))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def forget(self, node_id: str) -> None:
        cached = self._clients.pop(node_id, None)
        if cached is not None:
            self._retire(cached.client)

    async def ready_nodes(self, *, placeable: bool = False) -> list[NodeClient]:
        """Clients of the ready nodes (``placeable``: only those not cordoned)."""
        return [await self.client(n.id) for n in await self.store.list_nodes("ready")
                if not (placeable and n.cordoned)]

    async def schedule(self, req: placement.Request | None = None, *, exclude: str | None = None) -> NodeClient:
        """Pick the node for a new sandbox (see :mod:`space.controller.placement`); without a
        request (a restore, whose template is shipped along), the least loaded ready node.
        ``exclude``: a node not to use (one holding a stale copy of the sandbox)."""
        nodes = [n for n in await self.placeable_rows() if n.id != exclude]
        if not nodes:
            raise Unavailable("no ready node to place the sandbox on"
                              + (f" (other than {exclude})" if exclude else "") + "; cordoned nodes take none")
        if len(nodes) == 1:  # nothing to weigh
            return await self.client(nodes[0].id)
        req = req or placement.Request(template="", cpu=1.0, memory_mb=512)
        best = placement.rank(placement.fresh(nodes), req, await self.committed())[0]
        log.debug("placement.chosen", node=best.id, template=req.template)
        return await self.client(best.id)

    async def committed(self) -> dict[str, placement.Committed]:
        """What the live sandboxes placed on each node may use (from the database)."""
        out: dict[str, placement.Committed] = {}
        for sb in await self.store.list_sandboxes(states=LIVE_STATES):
            if sb.node_id is not None:
                c = out.setdefault(sb.node_id, placement.Committed())
                c.cpu += sb.cpu
                c.memory_mb += sb.memory_mb
        return out

    async def aclose(self) -> None:
        await self._rows.aclose()
        for cached in self._clients.values():
            await cached.client.aclose()
        self._clients.clear()
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)


#: The key of the placeable rows in their cache.
PLACEABLE = "placeable"

#: How long a replaced client stays open for the calls that were made on it.
RETIRE_AFTER = 300.0


async def _close_later(client: NodeClient) -> None:
    try:
        await asyncio.sleep(RETIRE_AFTER)
    finally:
        await client.aclose()
