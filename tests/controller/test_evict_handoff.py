"""The suspend → evict hand-off survives the controller that suspended: the row names the node
holding the old copy until its removal is confirmed, and a restore claimed by another controller
removes it first, or, when that node cannot be reached, places the sandbox elsewhere.

The nodes are small HTTP servers on unix sockets standing in for the node API (a seam: what the
controller sends is what is checked), on a real store (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Response

from space.controller import Controller, NodeRegistry
from space.lifecycle import State
from space.store import Store
from tests.store.storekit import new_op, new_sandbox
from tests.waiting import until

pytestmark = pytest.mark.anyio


class FakeNode:
    def __init__(self, sock: Path) -> None:
        self.sock = sock
        self.deleted: list[str] = []
        app = FastAPI()

        @app.delete("/v1/sandboxes/{sid}")
        async def delete(sid: str) -> Response:
            self.deleted.append(sid)
            return Response(status_code=204)

        self.server = uvicorn.Server(uvicorn.Config(app, uds=str(sock), log_level="warning", lifespan="off"))


@pytest.fixture
async def old_node(tmp_path: Path) -> AsyncIterator[FakeNode]:
    node = FakeNode(tmp_path / "old.sock")
    task = asyncio.create_task(node.server.serve())
    try:
        await until(lambda: node.server.started, 10, "the fake node to listen")
        yield node
    finally:
        node.server.should_exit = True
        await task


async def _suspended_with_stale_copy(store: Store, node_id: str) -> str:
    sb, _, _ = await store.create_sandbox(new_sandbox(node_id=node_id), new_op())
    await store.set_sandbox_state(sb.id, State.RUNNING, expect=[State.CREATING])
    await store.set_sandbox_state(sb.id, State.SUSPENDING)
    # What the suspending controller recorded before it crashed: the copy's removal never ran.
    await store.set_sandbox_state(sb.id, State.SUSPENDED, node_id=None, evict_node=node_id)
    return sb.id


async def test_another_controller_removes_the_copy_the_crashed_one_left(store: Store, old_node: FakeNode) -> None:
    await store.upsert_node("node-old", f"unix://{old_node.sock}", "t" * 32, {})
    sid = await _suspended_with_stale_copy(store, "node-old")
    nodes = NodeRegistry(store)
    try:
        other = Controller(store, nodes)  # a fresh process: nothing in memory about the suspend
        assert await other.lifecycle.finish_eviction(await store.get_sandbox(sid)) is None
        assert old_node.deleted == [sid]
        assert (await store.get_sandbox(sid)).evict_node is None
        # Done once: a second restore attempt asks nothing.
        assert await other.lifecycle.finish_eviction(await store.get_sandbox(sid)) is None
        assert old_node.deleted == [sid]
    finally:
        await nodes.aclose()


async def test_an_unreachable_old_node_is_avoided_not_waited_for(store: Store, tmp_path: Path) -> None:
    await store.upsert_node("node-old", f"unix://{tmp_path / 'gone.sock'}", "t" * 32, {})
    await store.upsert_node("node-new", f"unix://{tmp_path / 'new.sock'}", "t" * 32, {})
    sid = await _suspended_with_stale_copy(store, "node-old")
    nodes = NodeRegistry(store)
    try:
        ctl = Controller(store, nodes)
        assert await ctl.lifecycle.finish_eviction(await store.get_sandbox(sid)) == "node-old"
        assert (await store.get_sandbox(sid)).evict_node == "node-old"  # still owed
        for _ in range(5):
            assert (await nodes.schedule(exclude="node-old")).node_id == "node-new"
    finally:
        await nodes.aclose()
