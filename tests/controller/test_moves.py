"""A sandbox's move between nodes never leaves two copies running and never loses it.

- a move asks the old node to checkpoint and ship, the new one to restore, then removes the old copy
  (reason ``moved``), in that order; the row switches to the new node in one write
- a restore that fails is undone: the new copy is removed *before* the old one is resumed
- a new copy that cannot be confirmed gone leaves the old one paused (never two running)
- a controller that crashed after the switch leaves only the old copy's removal to the next one
- a sandbox deleted while it moves: the new copy is removed, the delete takes the old

The nodes are small HTTP servers on unix sockets standing in for the node API (a seam: what the
controller sends, and in what order, is what is checked), on a real store (SQLite and PostgreSQL).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from space.controller import Controller, NodeRegistry
from space.errors import SpaceError
from space.lifecycle import State
from space.store import Store
from tests.store.storekit import new_op, new_sandbox
from tests.waiting import until

pytestmark = pytest.mark.anyio


class FakeNode:
    """Records every call as ``(node, method, path, reason)`` in a log shared by the nodes."""

    def __init__(self, name: str, sock: Path, log: list[tuple[str, str, str, str | None]]) -> None:
        self.name, self.sock, self.log = name, sock, log
        self.restore_fails = False
        self.delete_fails = False
        app = FastAPI()

        @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def any_call(path: str, request: Request) -> Response:
            self.log.append((name, request.method, path.removeprefix("sandboxes"), request.query_params.get("reason")))
            if request.method == "DELETE" and self.delete_fails:
                return JSONResponse({"error": {"code": "unavailable", "message": "node busy"}}, 503)
            if path.endswith("/restore"):
                if self.restore_fails:
                    return JSONResponse({"error": {"code": "snapshot_corrupt", "message": "bad image"}}, 422)
                return JSONResponse({"instance_id": f"{name}-instance"})
            if path.endswith("/suspend"):
                return JSONResponse({"bytes": 1234, "artifacts": []})
            if request.method == "DELETE":
                return Response(status_code=204)
            return JSONResponse({"pools": []} if path == "pool" else {})

        self.server = uvicorn.Server(uvicorn.Config(app, uds=str(sock), log_level="warning", lifespan="off"))


@pytest.fixture
async def nodes(tmp_path: Path, store: Store) -> AsyncIterator[tuple[FakeNode, FakeNode, list[Any]]]:
    log: list[tuple[str, str, str, str | None]] = []
    pair = [FakeNode(n, tmp_path / f"{n}.sock", log) for n in ("node-old", "node-new")]
    tasks = [asyncio.create_task(n.server.serve()) for n in pair]
    try:
        for n in pair:
            await until(lambda n=n: n.server.started, 10, f"{n.name} to listen")  # type: ignore[misc]
            await store.upsert_node(n.name, f"unix://{n.sock}", "t" * 32, {})
        yield pair[0], pair[1], log
    finally:
        for n in pair:
            n.server.should_exit = True
        await asyncio.gather(*tasks)


async def _running_on(store: Store, node_id: str, state: State = State.RUNNING) -> str:
    sb, _, _ = await store.create_sandbox(new_sandbox(node_id=node_id), new_op())
    await store.set_sandbox_state(sb.id, State.RUNNING, expect=[State.CREATING])
    if state == State.PAUSED:
        await store.set_sandbox_state(sb.id, State.PAUSED)
    return sb.id


async def _controller(store: Store) -> tuple[Controller, NodeRegistry]:
    registry = NodeRegistry(store)
    return Controller(store, registry), registry


def _calls(log: list[tuple[str, str, str, str | None]], sid: str) -> list[tuple[str, str, str, str | None]]:
    return [c for c in log if sid in c[2] or c[2] == f"/{sid}"]


async def test_a_move_ships_restores_switches_then_removes_the_old_copy(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    _, _, log = nodes
    sid = await _running_on(store, "node-old")
    ctl, registry = await _controller(store)
    try:
        op = await ctl.moves.enqueue_move(await store.get_sandbox(sid))
        assert (await store.get_sandbox(sid)).state == State.MOVING
        result = await ctl.moves.move(await store.get_operation(op.id))
        assert result["node_id"] == "node-new" and result["from_node"] == "node-old"
        sb = await store.get_sandbox(sid)
        assert (sb.state, sb.node_id, sb.instance_id, sb.evict_node) == (
            State.RUNNING, "node-new", "node-new-instance", None)
        assert [(n, m, p.rsplit("/", 1)[-1], r) for n, m, p, r in _calls(log, sid)] == [
            ("node-old", "POST", "suspend", None),
            ("node-new", "POST", "restore", None),
            ("node-old", "DELETE", sid, "moved"),
        ]
        snap = await store.get_snapshot(str(op.request["snapshot"]))
        assert (snap.status, snap.restorable, snap.node_id, snap.origin) == ("ready", True, "node-new", "move")
        assert [e.kind for e in await store.list_events(sid)][-1] == "moved"
    finally:
        await registry.aclose()


async def test_a_paused_sandbox_is_paused_again_on_its_new_node(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    _, _, log = nodes
    sid = await _running_on(store, "node-old", State.PAUSED)
    ctl, registry = await _controller(store)
    try:
        op = await ctl.moves.enqueue_move(await store.get_sandbox(sid))
        await ctl.moves.move(await store.get_operation(op.id))
        assert (await store.get_sandbox(sid)).state == State.PAUSED
        assert ("node-new", "POST", f"/{sid}/pause", None) in _calls(log, sid)
    finally:
        await registry.aclose()


async def _failed_move(store: Store, ctl: Controller, sid: str) -> Any:
    op = await ctl.moves.enqueue_move(await store.get_sandbox(sid))
    with pytest.raises(SpaceError) as failure:
        await ctl.moves.move(await store.get_operation(op.id))
    return op, failure.value


async def test_a_failed_restore_removes_the_new_copy_before_resuming_the_old(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    _, new, log = nodes
    new.restore_fails = True
    sid = await _running_on(store, "node-old")
    ctl, registry = await _controller(store)
    try:
        op, exc = await _failed_move(store, ctl, sid)
        await ctl.moves.move_failed(await store.get_operation(op.id), exc)
        sb = await store.get_sandbox(sid)
        assert (sb.state, sb.node_id) == (State.RUNNING, "node-old")
        calls = [(n, m, p.rsplit("/", 1)[-1]) for n, m, p, _ in _calls(log, sid)]
        assert calls[-2:] == [("node-new", "DELETE", sid), ("node-old", "POST", "resume")], calls
        assert [e.kind for e in await store.list_events(sid)][-1] == "move_failed"
        assert (await store.get_snapshot(str(op.request["snapshot"]))).status == "ready"  # shipped: kept
    finally:
        await registry.aclose()


async def test_a_new_copy_not_confirmed_gone_leaves_the_old_one_paused(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    _, new, log = nodes
    new.restore_fails = True
    sid = await _running_on(store, "node-old")
    ctl, registry = await _controller(store)
    try:
        op, exc = await _failed_move(store, ctl, sid)
        new.delete_fails = True  # whatever the restore left there cannot be confirmed gone
        await ctl.moves.move_failed(await store.get_operation(op.id), exc)
        sb = await store.get_sandbox(sid)
        assert (sb.state, sb.node_id) == (State.PAUSED, "node-old")
        assert not [c for c in _calls(log, sid) if c[2].endswith("/resume")]
    finally:
        await registry.aclose()


async def test_after_a_crash_past_the_switch_only_the_old_copy_is_removed(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    _, _, log = nodes
    sid = await _running_on(store, "node-old")
    ctl, registry = await _controller(store)
    try:
        op = await ctl.moves.enqueue_move(await store.get_sandbox(sid))
        # What the crashed controller got done: shipped, restored on node-new, switched.
        await store.update_snapshot(str(op.request["snapshot"]), status="ready", restorable=True,
                                    object_key="k", node_id="node-new")
        await store.set_operation_progress(op.id, {"target": "node-new"})
        await store.set_sandbox_state(sid, State.RUNNING, expect=[State.MOVING], node_id="node-new",
                                      evict_node="node-old")
        other, other_registry = await _controller(store)  # a fresh process
        try:
            await other.moves.move(await store.get_operation(op.id))
        finally:
            await other_registry.aclose()
        assert [(n, m, r) for n, m, _, r in _calls(log, sid)] == [("node-old", "DELETE", "moved")]
        assert (await store.get_sandbox(sid)).evict_node is None
        # The crash came before the moved event: the one that finished records it, once.
        moved = [e for e in await store.list_events(sid) if e.kind == "moved"]
        assert len(moved) == 1 and moved[0].data["from_node"] == "node-old", moved
        again, again_registry = await _controller(store)
        try:
            await again.moves.move(await store.get_operation(op.id))
        finally:
            await again_registry.aclose()
        assert len([e for e in await store.list_events(sid) if e.kind == "moved"]) == 1
    finally:
        await registry.aclose()


async def test_a_sandbox_deleted_while_it_moves_leaves_no_new_copy(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, log = nodes
    sid = await _running_on(store, "node-old")
    ctl, registry = await _controller(store)
    try:
        op = await ctl.moves.enqueue_move(await store.get_sandbox(sid))
        real: Callable[..., Any] = ctl.moves.lifecycle.egress

        async def deleted_meanwhile(sb: Any) -> Any:  # the delete lands while the restore is asked
            await store.set_sandbox_state(sid, State.TERMINATING)
            return await real(sb)

        monkeypatch.setattr(ctl.moves.lifecycle, "egress", deleted_meanwhile)
        result = await ctl.moves.move(await store.get_operation(op.id))
        assert result.get("abandoned")
        sb = await store.get_sandbox(sid)
        assert (sb.state, sb.node_id) == (State.TERMINATING, "node-old")
        assert ("node-new", "DELETE", sid) in [(n, m, p.rsplit("/", 1)[-1]) for n, m, p, _ in _calls(log, sid)]
    finally:
        await registry.aclose()
