"""Pointing the official E2B SDK at a SPACE server: the three environment variables a user sets."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.e2e.harness import Server


def point_sdk_at(monkeypatch: pytest.MonkeyPatch, server: Server, key: str | None = None) -> None:
    monkeypatch.setenv("E2B_API_URL", server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    monkeypatch.setenv("E2B_API_KEY", key or server.admin_key)
    for name in ("E2B_DEBUG", "E2B_DOMAIN", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(name, raising=False)


class Sandboxes:
    """Every sandbox a test makes through the SDK, killed at teardown whatever happened."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def add(self, sandbox_id: str) -> str:
        self.ids.append(sandbox_id)
        return sandbox_id

    def kill_all(self) -> None:
        from e2b import Sandbox

        for sid in self.ids:
            # Already gone is fine; anything else shows in the server log.
            with contextlib.suppress(Exception):
                Sandbox.kill(sid)


def sandboxes() -> Iterator[Sandboxes]:
    made = Sandboxes()
    try:
        yield made
    finally:
        made.kill_all()
