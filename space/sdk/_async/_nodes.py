"""Nodes and the join tokens that admit them (operator admin keys only)."""

from __future__ import annotations

import builtins
from urllib.parse import quote

from space.sdk._models import JSON, Operation

from ._http import AsyncHTTP


class AsyncJoinTokens:
    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def create(self, *, ttl_seconds: int = 86400, description: str = "", max_uses: int | None = None) -> JSON:
        """A join token: ``token`` (its text, returned this once), ``id``, ``expires_at``,
        ``ca_fingerprint`` (the cluster CA's sha256, for a node to check)."""
        body = {"ttl_seconds": ttl_seconds, "description": description, "max_uses": max_uses}
        return await self._http.json("POST", "/v1/nodes/tokens", json=body)

    async def list(self) -> builtins.list[JSON]:
        return list((await self._http.json("GET", "/v1/nodes/tokens")).get("tokens", []))

    async def revoke(self, token_id: str) -> JSON:
        return await self._http.json("DELETE", f"/v1/nodes/tokens/{quote(token_id, safe='')}")


class AsyncNodes:
    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http
        self.tokens = AsyncJoinTokens(http)

    async def list(self) -> builtins.list[JSON]:
        """Every node: ``id``, ``url``, ``state``, ``capacity``, ``load``, ``version``, ``heartbeat_at``."""
        return list((await self._http.json("GET", "/v1/nodes")).get("nodes", []))

    async def get(self, node_id: str) -> JSON:
        return await self._http.json("GET", f"/v1/nodes/{quote(node_id, safe='')}")

    async def remove(self, node_id: str) -> None:
        """Forget a node (refused while sandboxes are on it)."""
        await self._http.request("DELETE", f"/v1/nodes/{quote(node_id, safe='')}")

    async def cordon(self, node_id: str) -> JSON:
        """Place nothing new on the node (its warm pool is let go); what runs there runs on."""
        return await self._http.json("POST", f"/v1/nodes/{quote(node_id, safe='')}/cordon")

    async def uncordon(self, node_id: str) -> JSON:
        """Put the node back into placement (a drain under way stops)."""
        return await self._http.json("POST", f"/v1/nodes/{quote(node_id, safe='')}/uncordon")

    async def drain(self, node_id: str, *, parallel: int = 2) -> Operation:
        """Cordon the node and move every sandbox off it (running ones with their processes):
        the ``node.drain`` operation (``client.operations.wait`` it; its ``progress`` counts
        ``moved``, ``remaining``, ``failed``)."""
        body = await self._http.json("POST", f"/v1/nodes/{quote(node_id, safe='')}/drain",
                                     json={"parallel": parallel})
        return Operation.from_json(body["operation"])
