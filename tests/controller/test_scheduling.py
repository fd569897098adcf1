"""Scheduling a new sandbox onto a node, on a real SQLite store: the least loaded ready node wins,
a lone node is taken without counting, and no ready node is a retryable Unavailable."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space.controller import NodeRegistry
from space.errors import Unavailable
from space.lifecycle import State
from space.store import Operation, Sandbox, Store

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'space.db'}")
    try:
        yield s
    finally:
        await s.close()


async def _sandbox_on(store: Store, sid: str, node: str) -> None:
    sb = Sandbox(id=sid, tenant="t", template="base", state=State.CREATING.value, cpu=1.0, memory_mb=256,
                 env={}, meta={})
    op = Operation(id=f"op-{sid}", tenant="t", kind="sandbox.create", target=sid, status="pending", request={})
    await store.create_sandbox(sb, op)
    await store.update_sandbox(sid, node_id=node)


async def test_least_loaded_ready_node_wins(store: Store) -> None:
    await store.upsert_node("node-a", "http://127.0.0.1:1", "ta", {})
    await store.upsert_node("node-b", "http://127.0.0.1:2", "tb", {})
    await _sandbox_on(store, "s1", "node-a")
    await _sandbox_on(store, "s2", "node-a")
    await _sandbox_on(store, "s3", "node-b")
    nodes = NodeRegistry(store)
    try:
        assert (await nodes.schedule()).node_id == "node-b"
        await _sandbox_on(store, "s4", "node-b")
        await _sandbox_on(store, "s5", "node-b")
        assert (await nodes.schedule()).node_id == "node-a"
    finally:
        await nodes.aclose()


async def test_lone_node_and_no_node(store: Store) -> None:
    nodes = NodeRegistry(store)
    try:
        with pytest.raises(Unavailable) as exc:
            await nodes.schedule()
        assert exc.value.retryable
        await store.upsert_node("node-a", "http://127.0.0.1:1", "ta", {})
        assert (await nodes.schedule()).node_id == "node-a"
    finally:
        await nodes.aclose()
