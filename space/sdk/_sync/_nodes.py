# Generated from space/sdk/_async/_nodes.py by scripts/unasync.py: do not edit.
"""Nodes and the join tokens that admit them (operator admin keys only)."""

from __future__ import annotations

import builtins
from urllib.parse import quote

from space.sdk._models import JSON

from ._http import SyncHTTP


class JoinTokens:
    def __init__(self, http: SyncHTTP) -> None:
        self._http = http

    def create(self, *, ttl_seconds: int = 86400, description: str = "", max_uses: int | None = None) -> JSON:
        """A join token: ``token`` (its text, returned this once), ``id``, ``expires_at``,
        ``ca_fingerprint`` (the cluster CA's sha256, for a node to check)."""
        body = {"ttl_seconds": ttl_seconds, "description": description, "max_uses": max_uses}
        return self._http.json("POST", "/v1/nodes/tokens", json=body)

    def list(self) -> builtins.list[JSON]:
        return list((self._http.json("GET", "/v1/nodes/tokens")).get("tokens", []))

    def revoke(self, token_id: str) -> JSON:
        return self._http.json("DELETE", f"/v1/nodes/tokens/{quote(token_id, safe='')}")


class Nodes:
    def __init__(self, http: SyncHTTP) -> None:
        self._http = http
        self.tokens = JoinTokens(http)

    def list(self) -> builtins.list[JSON]:
        """Every node: ``id``, ``url``, ``state``, ``capacity``, ``load``, ``version``, ``heartbeat_at``."""
        return list((self._http.json("GET", "/v1/nodes")).get("nodes", []))

    def get(self, node_id: str) -> JSON:
        return self._http.json("GET", f"/v1/nodes/{quote(node_id, safe='')}")

    def remove(self, node_id: str) -> None:
        """Forget a node (refused while sandboxes are on it)."""
        self._http.request("DELETE", f"/v1/nodes/{quote(node_id, safe='')}")
