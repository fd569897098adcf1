from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e import e2b_env
from tests.e2e.harness import Server, own_server


@pytest.fixture(scope="module")
def api(server: Server) -> Iterator[httpx.Client]:
    """An admin client of the shared server."""
    with server.client() as c:
        yield c


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[Server]:
    """A server of its own, for tests that kill or restart it."""
    with own_server(tmp_path, start=False) as srv:
        yield srv


@pytest.fixture
def made(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[e2b_env.Sandboxes]:
    """The official E2B SDK pointed at the shared server; every sandbox added is killed after."""
    e2b_env.point_sdk_at(monkeypatch, server)
    yield from e2b_env.sandboxes()
