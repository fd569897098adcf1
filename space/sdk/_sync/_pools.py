# Generated from space/sdk/_async/_pools.py by scripts/unasync.py: do not edit.
"""Warm pools: how many booted sandboxes each node keeps ready per template and size."""

from __future__ import annotations

import builtins
from urllib.parse import quote

from space.sdk._models import JSON

from ._http import SyncHTTP


class Pools:
    def __init__(self, http: SyncHTTP) -> None:
        self._http = http

    def list(self) -> builtins.list[JSON]:
        """Every pool: ``template``, ``cpu``, ``memory_mb``, ``size`` (per node), ``ready``, ``nodes``."""
        return list((self._http.json("GET", "/v1/pools")).get("pools", []))

    def set(self, template: str, size: int, *, cpu: float = 1.0, memory_mb: int = 512) -> JSON:
        """Keep ``size`` warm sandboxes of ``template`` at this size on every node (0 removes it)."""
        body = {"size": size, "cpu": cpu, "memory_mb": memory_mb}
        return self._http.json("PUT", f"/v1/pools/{quote(template, safe='')}", json=body)
