"""Nodes and the join tokens that admit them (operator admin keys only)."""

from __future__ import annotations

import builtins
from urllib.parse import quote

from space.sdk._models import JSON

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
