# Generated from space/sdk/_async/_resources.py by scripts/unasync.py: do not edit.
"""Operations, templates and API keys."""

from __future__ import annotations

import builtins
import math
import time
from collections.abc import Iterator
from urllib.parse import quote

import httpx

from space import errors
from space.sdk._models import JSON, Operation

from ._http import SyncHTTP

#: The longest long-poll the server honours.
MAX_POLL = 60


class Operations:
    def __init__(self, http: SyncHTTP) -> None:
        self._http = http

    def get(self, op_id: str, wait: float | None = None) -> Operation:
        """The operation; with ``wait``, the server holds the answer up to that long for it to finish."""
        path = f"/v1/operations/{quote(op_id, safe='')}"
        if wait is None:
            return Operation.from_json(self._http.json("GET", path))
        seconds = max(0, min(MAX_POLL, math.ceil(wait)))
        timeout = httpx.Timeout(self._http.timeout + seconds)
        body = self._http.json("GET", path, params={"wait": seconds}, timeout=timeout)
        return Operation.from_json(body)

    def wait(self, op_id: str, timeout: float | None = 120.0) -> Operation:
        """Long-poll until the operation finished (succeeded or failed); raise Timeout past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = MAX_POLL if deadline is None else deadline - time.monotonic()
            op = self.get(op_id, wait=max(0.0, remaining))
            if op.done:
                return op
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.Timeout(
                    f"operation {op_id} did not finish within {timeout:g}s (it is {op.status})",
                    operation=op_id,
                )

    def logs(self, op_id: str, after: int = 0) -> Iterator[tuple[int, str]]:
        """``(seq, line)`` of the operation's log until it finishes (resuming across dropped streams)."""
        path = f"/v1/operations/{quote(op_id, safe='')}/logs"
        for name, seq, payload in self._http.events(path, final="end", after=after):
            if name == "log":
                yield int(payload.get("seq", seq or 0)), str(payload.get("line", ""))


class Templates:
    def __init__(self, http: SyncHTTP) -> None:
        self._http = http

    def list(self) -> builtins.list[JSON]:
        return list((self._http.json("GET", "/v1/templates")).get("templates", []))

    def get(self, name: str) -> JSON:
        return self._http.json("GET", f"/v1/templates/{quote(name, safe='')}")

    def build(self, name: str, spec: JSON | None = None, force: bool = False,
                    tags: builtins.list[str] | None = None) -> Operation:
        """Start a build and return its operation without waiting (follow it with ``operations``).

        ``spec`` is a template spec as ``space.node.templates.spec.load`` reads it from a
        ``space-template.toml`` (its files uploaded with :meth:`put_blob` first); without it the
        template is rebuilt from its stored spec. ``tags`` name the build it makes (``name:tag``)."""
        path = f"/v1/templates/{quote(name, safe='')}/build"
        payload: JSON = {"force": force}
        if spec is not None:
            payload["spec"] = spec
        if tags:
            payload["tags"] = builtins.list(tags)
        body = self._http.json("POST", path, json=payload)
        return Operation.from_json(body["operation"])

    def tags(self, name: str) -> builtins.list[JSON]:
        """The template's tags: ``{"tag", "digest", "build_id", "created_at"}`` each."""
        return list((self._http.json("GET", f"/v1/templates/{quote(name, safe='')}/tags")).get("tags", []))

    def save(self, name: str, sandbox_id: str, snapshot: str | None = None) -> Operation:
        """Save a sandbox as template ``name`` (from ``snapshot``, else from a disk snapshot taken
        now); returns the ``template.save`` operation, whose result has the ``digest``."""
        payload: JSON = {"name": name, "sandbox_id": sandbox_id}
        if snapshot is not None:
            payload["snapshot"] = snapshot
        body = self._http.json("POST", "/v1/templates", json=payload)
        return Operation.from_json(body["operation"])

    def has_blob(self, sha256: str) -> bool:
        """Whether the server stores the file with this sha256 (template specs refer to files so)."""
        try:
            self._http.json("GET", f"/v1/templates/blobs/{quote(sha256, safe='')}")
        except errors.NotFound:
            return False
        return True

    def put_blob(self, sha256: str, data: bytes) -> None:
        """Upload a file a template spec refers to (the server checks ``sha256``)."""
        timeout = httpx.Timeout(max(self._http.timeout, 600.0))
        self._http.request("PUT", f"/v1/templates/blobs/{quote(sha256, safe='')}", content=data,
                                 headers={"content-type": "application/octet-stream"}, timeout=timeout)


class ApiKeys:
    def __init__(self, http: SyncHTTP) -> None:
        self._http = http

    def create(self, tenant: str, role: str = "member", name: str = "") -> JSON:
        """A new key; the returned ``key`` is shown this once (the server keeps only its hash)."""
        body = {"tenant": tenant, "role": role, "name": name}
        return self._http.json("POST", "/v1/apikeys", json=body)

    def list(self) -> builtins.list[JSON]:
        return list((self._http.json("GET", "/v1/apikeys")).get("apikeys", []))

    def delete(self, key_id: str) -> None:
        self._http.request("DELETE", f"/v1/apikeys/{quote(key_id, safe='')}")
