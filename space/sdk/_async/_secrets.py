"""Secrets: credentials the node's egress gateway injects into a sandbox's matching requests.

A value goes in and never comes back out: ``list`` shows names, scopes and injection rules only.
"""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from space.sdk._models import JSON

from ._http import AsyncHTTP


class AsyncSecrets:
    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def set(
        self,
        name: str,
        value: str,
        *,
        hosts: Sequence[str],
        header: str | None = None,
        format: str | None = None,
        scope: str | None = None,
        expires_at: dt.datetime | str | None = None,
        ttl_seconds: int | None = None,
        rate_limit: int | None = None,
    ) -> JSON:
        """Create or replace ``name`` in ``scope`` (``tenant`` by default, ``project:<p>``,
        ``sandbox:<id>``): ``header`` (default ``Authorization``) gets ``format`` (default
        ``Bearer {}``; ``basic`` for a ``user:password`` value) on requests to ``hosts``."""
        body: dict[str, Any] = {"value": value, "hosts": list(hosts)}
        if isinstance(expires_at, dt.datetime):
            expires_at = expires_at.isoformat()
        optional = {"header": header, "format": format, "scope": scope, "expires_at": expires_at,
                    "ttl_seconds": ttl_seconds, "rate_limit": rate_limit}
        body.update({k: v for k, v in optional.items() if v is not None})
        return await self._http.json("PUT", f"/v1/secrets/{quote(name, safe='')}", json=body)

    async def list(self, scope: str | None = None) -> builtins.list[JSON]:
        """The tenant's secrets (one scope's if given), without their values."""
        params = {"scope": scope} if scope else None
        return list((await self._http.json("GET", "/v1/secrets", params=params)).get("secrets", []))

    async def delete(self, name: str, scope: str | None = None) -> None:
        params = {"scope": scope} if scope else None
        await self._http.request("DELETE", f"/v1/secrets/{quote(name, safe='')}", params=params)
