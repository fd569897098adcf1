from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from space.node.main import channel_dir_for
from tests.e2e.harness import Server, free_port, loop_devices, runtime_available


@pytest.fixture(scope="module")
def api(server: Server) -> Iterator[httpx.Client]:
    """An admin client of the shared server."""
    with server.client() as c:
        yield c


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[Server]:
    """A server of its own, for tests that kill or restart it."""
    reason = runtime_available()
    if reason:
        pytest.skip(reason)
    srv = Server(data_dir=tmp_path / "data", port=free_port(), log_path=tmp_path / "serve.log")
    try:
        yield srv
    finally:
        srv.teardown()
        assert loop_devices(srv.data_dir / "pool.img") == "", "the pool's loop device leaked"
        assert not channel_dir_for(srv.data_dir).exists(), "the node's socket directory leaked"
