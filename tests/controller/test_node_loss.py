"""A lost node's sandboxes come back elsewhere, and never while the node could still run them.

- heartbeats carry a number and acknowledge the previous answer (the node's lease runs from that)
- a silent node is ``unreachable`` at once and ``lost`` only after its own lease plus a margin; a
  node that reports no lease is never lost by itself
- a lost node's sandboxes are restored on another node: from the disk backup chain when it is the
  newest thing shipped (processes restarted), from the uploaded full checkpoint when that is at
  least as new (memory and files); the event says which, and how old; with nothing shipped, failed
- a node that answers again: its frozen copies still placed there are released, the others discarded
- backup reports land on the sandbox's row only from the node it is on; a superseded chain's
  objects are deleted once the row names the new chain; unconfigured sandboxes get configured

The nodes are small HTTP servers on unix sockets standing in for the node API (the seam: what the
controller sends is what is checked), on a real store (SQLite and PostgreSQL) and a real directory
object store.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from space.controller import Controller, NodeRegistry
from space.controller.node_loss import LOST_MARGIN
from space.errors import NotFound
from space.lifecycle import State
from space.objstore import ObjectStore
from space.store import Store, new_snapshot
from tests.store.storekit import new_op, new_sandbox
from tests.waiting import until

pytestmark = pytest.mark.anyio

LEASE = 5.0


class FakeNode:
    """Answers the heartbeat with what the test sets; records every call."""

    def __init__(self, name: str, sock: Path, log: list[tuple[str, str, str, dict[str, Any]]]) -> None:
        self.name, self.sock, self.log = name, sock, log
        self.info: dict[str, Any] = {"fence": {"lease": LEASE, "fenced": []}, "backups": {}, "warm": []}
        #: While set to an unset event, a backup configuration waits for it (a slow node call).
        self.hold_backup: asyncio.Event | None = None
        app = FastAPI()

        @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def any_call(path: str, request: Request) -> Response:
            body = await request.json() if request.method in ("POST", "PUT") and await request.body() else {}
            self.log.append((name, request.method, path, {**dict(request.query_params), **body}))
            if path.endswith("/backup") and request.method == "PUT" and self.hold_backup is not None:
                await self.hold_backup.wait()
            if path == "node":
                return JSONResponse(self.info)
            if path.endswith(("/restore", "/restore-backup")):
                return JSONResponse({"instance_id": f"{name}-instance"})
            if request.method == "DELETE":
                return Response(status_code=204)
            return JSONResponse({"pools": []} if path == "pool" else {})

        self.server = uvicorn.Server(uvicorn.Config(app, uds=str(sock), log_level="warning", lifespan="off"))


@pytest.fixture
async def nodes(tmp_path: Path, store: Store) -> AsyncIterator[tuple[FakeNode, FakeNode, list[Any]]]:
    log: list[tuple[str, str, str, dict[str, Any]]] = []
    pair = [FakeNode(n, tmp_path / f"{n}.sock", log) for n in ("node-a", "node-b")]
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


async def _stop(node: FakeNode) -> None:
    node.server.should_exit = True
    await until(lambda: not node.sock.exists() or node.server.started is False or _refuses(node.sock), 10,
                f"{node.name} to stop")


def _refuses(sock: Path) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(sock))
        except OSError:
            return True
    return False


async def _running_on(store: Store, node_id: str, state: State = State.RUNNING) -> str:
    sb, _, _ = await store.create_sandbox(new_sandbox(node_id=node_id), new_op())
    await store.set_sandbox_state(sb.id, State.RUNNING, expect=[State.CREATING])
    if state == State.PAUSED:
        await store.set_sandbox_state(sb.id, State.PAUSED)
    return sb.id


def _calls(log: list[Any], node: str, method: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    return [(p, q) for n, m, p, q in log if n == node and (method is None or m == method)]


async def _controller(store: Store, objects: ObjectStore | None = None) -> tuple[Controller, NodeRegistry]:
    registry = NodeRegistry(store)
    return Controller(store, registry, objects=objects), registry


def _ago(seconds: float) -> dt.datetime:
    return dt.datetime.now(dt.UTC) - dt.timedelta(seconds=seconds)


async def test_heartbeats_are_numbered_and_acknowledge_the_last_answer(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    _, _, log = nodes
    ctl, registry = await _controller(store)
    try:
        await ctl.check_nodes()
        await ctl.check_nodes()
        beats = [q for p, q in _calls(log, "node-a", "GET") if p == "node"]
        assert "ack" not in beats[0]
        assert int(beats[1]["ack"]) == int(beats[0]["hb"]) and int(beats[1]["hb"]) == int(beats[0]["hb"]) + 1
        assert (await store.get_node("node-a")).capacity["fence"]["lease"] == LEASE
    finally:
        await registry.aclose()


async def test_a_silent_node_is_lost_only_past_its_lease_and_comes_back_elsewhere_from_its_disk_backup(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    a, _, log = nodes
    sid = await _running_on(store, "node-a")
    paused = await _running_on(store, "node-a", State.PAUSED)
    disk_at = _ago(20)
    for s in (sid, paused):
        assert await store.record_backup(s, "node-a", {"node": "node-a", "prefix": f"tenants/acme/sandboxes/{s}/backup",
                                                       "chain": "c1", "seq": 3, "disk_at": disk_at.isoformat()})
    ctl, registry = await _controller(store)
    try:
        await ctl.check_nodes()  # a heartbeat: the node reported its lease
        await _stop(a)
        row = await store.get_node("node-a")
        await ctl.node_loss.silent(row, now=row.heartbeat_at.timestamp() + LEASE + LOST_MARGIN - 1)
        assert (await store.get_node("node-a")).state != "lost"
        assert (await store.get_sandbox(sid)).state == State.RUNNING
        await ctl.node_loss.silent(row, now=row.heartbeat_at.timestamp() + LEASE + LOST_MARGIN + 1)
        assert (await store.get_node("node-a")).state == "lost"
        for s in (sid, paused):
            assert (await store.get_sandbox(s)).state == State.RESTORING
        # A second look queues nothing twice.
        await ctl.node_loss.silent(await store.get_node("node-a"), now=time.time() + 3600)
        ops = await store.find_operations(status=["pending"])
        assert sorted(o.target for o in ops if o.kind == "sandbox.recover") == sorted([sid, paused])
        for op in ops:
            if op.kind == "sandbox.recover":
                await ctl._recover(op)
        sb = await store.get_sandbox(sid)
        assert (sb.state, sb.node_id, sb.instance_id) == (State.RUNNING, "node-b", "node-b-instance")
        assert (await store.get_sandbox(paused)).state == State.PAUSED
        restores = [q for p, q in _calls(log, "node-b", "POST") if p == f"sandboxes/{sid}/restore-backup"]
        assert [(q["chain"], q["seq"], q["prefix"]) for q in restores] == [
            ("c1", 3, f"tenants/acme/sandboxes/{sid}/backup")]
        assert ("sandboxes/" + paused + "/pause", {}) in _calls(log, "node-b", "POST")
        event = [e for e in await store.list_events(sid) if e.kind == "relocated"][-1]
        assert "disk backup" in event.message and "processes were restarted" in event.message
        assert "node-a was lost" in event.message, event.message
    finally:
        await registry.aclose()


async def test_a_node_that_reports_no_lease_is_never_lost(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    a, _, _ = nodes
    a.info["fence"] = {"lease": None, "fenced": []}
    sid = await _running_on(store, "node-a")
    ctl, registry = await _controller(store)
    try:
        await ctl.check_nodes()
        await _stop(a)
        await ctl.node_loss.silent(await store.get_node("node-a"), now=time.time() + 86400)
        assert (await store.get_node("node-a")).state != "lost"
        assert (await store.get_sandbox(sid)).state == State.RUNNING
    finally:
        await registry.aclose()


async def test_a_checkpoint_as_new_as_the_disk_backup_brings_the_memory_back(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    _, _, log = nodes
    sid = await _running_on(store, "node-a")
    sb = await store.get_sandbox(sid)
    snap = new_snapshot(sb, "full", "schedule")
    op = new_op(kind="snapshot.create", target=sid, request={"snapshot": snap.id})
    await store.start_operation(op, snapshot=snap)
    await store.update_snapshot(snap.id, status="ready", restorable=True, node_id="node-a",
                                object_key=f"tenants/acme/sandboxes/{sid}/snapshots/{snap.id}")
    created = (await store.get_snapshot(snap.id)).created_at
    await store.record_backup(sid, "node-a", {"node": "node-a", "prefix": "p", "chain": "c1", "seq": 0,
                                              "disk_at": (created - dt.timedelta(seconds=30)).isoformat()})
    ctl, registry = await _controller(store)
    try:
        await ctl.check_nodes()
        await ctl.node_loss.relocate_all(await store.get_node("node-a"))
        recover = [o for o in await store.find_operations(status=["pending"]) if o.kind == "sandbox.recover"]
        await ctl._recover(recover[0])
        restores = [q for p, q in _calls(log, "node-b", "POST") if p == f"sandboxes/{sid}/restore"]
        assert [q["snapshot"] for q in restores] == [snap.id]
        event = [e for e in await store.list_events(sid) if e.kind == "relocated"][-1]
        assert "full checkpoint" in event.message and "memory and files" in event.message
    finally:
        await registry.aclose()


async def test_with_nothing_shipped_the_sandbox_fails_saying_so(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    sid = await _running_on(store, "node-a")
    ctl, registry = await _controller(store)
    try:
        await ctl.check_nodes()
        await ctl.node_loss.relocate_all(await store.get_node("node-a"))
        recover = next(o for o in await store.find_operations(status=["pending"]) if o.kind == "sandbox.recover")
        with pytest.raises(NotFound) as info:
            await ctl._recover(recover)
        await ctl._recover_failed(recover, info.value)
        sb = await store.get_sandbox(sid)
        assert sb.state == State.FAILED and "nothing of it was shipped" in (sb.error_message or "")
    finally:
        await registry.aclose()


async def test_a_returning_node_keeps_what_is_still_its_own_and_discards_the_rest(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    a, _, log = nodes
    own = await _running_on(store, "node-a")
    moving = await _running_on(store, "node-a")  # a drain's move of it under way: still its own
    await store.set_sandbox_state(moving, State.MOVING, expect=[State.RUNNING])
    moved = await _running_on(store, "node-b")
    a.info["fence"] = {"lease": LEASE, "fenced": [own, moving, moved, "sb-gone"]}
    ctl, registry = await _controller(store)
    try:
        await ctl.check_nodes()
        posts = _calls(log, "node-a", "POST")
        assert (f"sandboxes/{own}/unfence", {}) in posts and (f"sandboxes/{moving}/unfence", {}) in posts
        deletes = [(p, q.get("reason")) for p, q in _calls(log, "node-a", "DELETE")]
        assert sorted(deletes) == sorted([(f"sandboxes/{moved}", "moved"), ("sandboxes/sb-gone", "moved")])
    finally:
        await registry.aclose()


async def test_a_lost_node_that_returns_discards_what_is_being_restored_elsewhere(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    a, _, log = nodes
    sid = await _running_on(store, "node-a")
    ctl, registry = await _controller(store)
    try:
        await ctl.check_nodes()
        await store.set_node_state("node-a", "lost")
        await ctl.node_loss.relocate_all(await store.get_node("node-a"))
        assert (await store.get_sandbox(sid)).state == State.RESTORING  # not yet placed anew
        a.info["fence"] = {"lease": LEASE, "fenced": [sid]}
        await ctl.check_nodes()
        assert [(p, q.get("reason")) for p, q in _calls(log, "node-a", "DELETE")] == [(f"sandboxes/{sid}", "moved")]
        assert (f"sandboxes/{sid}/unfence", {}) not in _calls(log, "node-a", "POST")
    finally:
        await registry.aclose()


async def test_backup_reports_are_recorded_from_the_sandboxs_node_and_a_superseded_chain_is_deleted(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]], tmp_path: Path) -> None:
    a, b, log = nodes
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    sid = await _running_on(store, "node-a")
    prefix = f"tenants/acme/sandboxes/{sid}/backup"
    for chain in ("c1", "c2"):
        await objects.put_bytes(f"{prefix}/{chain}/000000/manifest.json", b"{}")
    await store.update_sandbox(sid, snapshot_policy={"backup_every": 2})
    ctl, registry = await _controller(store, objects)
    try:
        await ctl.check_nodes()  # not configured on the node yet: configured
        puts = [q for p, q in _calls(log, "node-a", "PUT") if p == f"sandboxes/{sid}/backup"]
        assert [(q["every"], q["prefix"], q["tenant"]) for q in puts] == [(2, prefix, "acme")]
        # Its links sealed under the tenant's key (the deployment's) with the sandbox's shred secret.
        assert puts[0]["sealing"]["key"] == {"provider": "local", "key_id": "acme"}
        assert base64.b64decode(puts[0]["sealing"]["shred"]) == await store.shred_secret(sandbox_id=sid)
        now = time.time()
        report = {"chain": "c1", "seq": 4, "disk_at": now - 3, "every": 2, "prefix": prefix, "bytes_shipped": 99,
                  "key": {"provider": "local", "key_id": "acme"}}
        a.info["backups"] = {sid: report}
        b.info["backups"] = {sid: {**report, "chain": "zz", "seq": 9}}  # not its node: ignored
        await ctl.check_nodes()
        rec = (await store.get_sandbox(sid)).backup or {}
        assert (rec["chain"], rec["seq"], rec["node"]) == ("c1", 4, "node-a")
        a.info["backups"] = {sid: {**report, "chain": "c2", "seq": 0, "disk_at": now}}
        await ctl.check_nodes()
        rec = (await store.get_sandbox(sid)).backup or {}
        assert (rec["chain"], rec["seq"]) == ("c2", 0)
        # The tenant's key changed: the node is told (its next links under the new key), and what
        # it reports of its chain is still recorded.
        log.clear()
        await store.set_tenant_key("acme", "aws-kms", "arn:aws:kms:us-east-1:1:key/k")
        a.info["backups"] = {sid: {**report, "chain": "c2", "seq": 1, "disk_at": now + 1}}
        await ctl.check_nodes()
        puts = [q for p, q in _calls(log, "node-a", "PUT") if p == f"sandboxes/{sid}/backup"]
        assert [q["sealing"]["key"]["key_id"] for q in puts] == ["arn:aws:kms:us-east-1:1:key/k"]
        assert ((await store.get_sandbox(sid)).backup or {})["seq"] == 1
        assert await objects.list(f"{prefix}/") == [f"{prefix}/c2/000000/manifest.json"]
    finally:
        await registry.aclose()


async def test_the_backup_interval_is_the_sandboxs_else_its_tenants_else_the_deployments_and_off_stops_it(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]], tmp_path: Path) -> None:
    a, _, log = nodes
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    sid = await _running_on(store, "node-a")
    prefix = f"tenants/acme/sandboxes/{sid}/backup"
    registry = NodeRegistry(store)
    ctl = Controller(store, registry, objects=objects, backup_every=45.0)

    async def beat_with(every: float) -> list[float]:
        """One heartbeat of node-a reporting ``every``; the intervals the controller then PUT."""
        log.clear()
        a.info["backups"] = {sid: {"chain": "c1", "seq": 1, "disk_at": time.time(), "every": every,
                                   "prefix": prefix, "key": {"provider": "local", "key_id": "acme"}}}
        await ctl.check_nodes()
        return [q["every"] for p, q in _calls(log, "node-a", "PUT") if p == f"sandboxes/{sid}/backup"]

    try:
        assert await beat_with(1) == [45.0]  # nothing set: the deployment's
        await store.set_tenant_backup("acme", 10.0)
        await store.set_tenant_backup("other", 0.0)  # another tenant's setting changes nothing here
        assert await beat_with(45) == [10.0]
        assert await beat_with(10) == []  # as configured: left alone
        await store.update_sandbox(sid, snapshot_policy={"backup_every": 3})
        assert await beat_with(10) == [3.0]  # the sandbox's own policy wins
        await store.update_sandbox(sid, snapshot_policy={})
        await store.set_tenant_backup("acme", 0.0)
        assert await beat_with(10) == []
        assert _calls(log, "node-a", "DELETE") == [(f"sandboxes/{sid}/backup", {})]  # off: the node stops
        assert (await store.get_sandbox(sid)).backup["chain"] == "c1"  # what is durable stays on the row
        await store.set_tenant_backup("acme", None)
        assert await beat_with(0) == [45.0]
        assert await store.tenant_backup_every(["acme", "other", "nobody"]) == {"other": 0.0}
    finally:
        await registry.aclose()


async def test_a_slow_follow_up_holds_back_no_heartbeat(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]], tmp_path: Path) -> None:
    """The leader's heartbeat loop renews every node's lease on time even while what follows one
    node's answer (here: its backup configuration) hangs; that node gets one follow-up at a time."""
    a, _, log = nodes
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    sid = await _running_on(store, "node-a")
    registry = NodeRegistry(store)
    ctl = Controller(store, registry, objects=objects, backup_every=45.0)
    a.hold_backup = asyncio.Event()
    try:
        for _ in range(3):
            await asyncio.wait_for(ctl.check_nodes(follow_up=False), 10)
        for name in ("node-a", "node-b"):
            assert [p for p, _ in _calls(log, name, "GET")].count("node") == 3
        await until(lambda: len(_calls(log, "node-a", "PUT")) == 1, 10, "the held backup configuration")
        assert [p for p, _ in _calls(log, "node-a", "PUT")] == [f"sandboxes/{sid}/backup"]  # one in flight
    finally:
        a.hold_backup.set()
        for task in list(ctl._following.values()):
            await asyncio.wait_for(task, 10)
        await registry.aclose()


def test_heartbeats_come_five_times_per_shortest_lease_and_no_slower_than_reconcile() -> None:
    """A lease runs from the heartbeat before the last: with 5 s heartbeats a 6 s lease ran out
    between every two of them."""
    from types import SimpleNamespace

    from space.controller.controller import heartbeat_period

    def row(lease: float | None) -> Any:
        return SimpleNamespace(capacity={"fence": {"lease": lease}} if lease is not None else {})

    assert heartbeat_period([row(6), row(30), row(None)], 5.0) == pytest.approx(1.2)
    assert heartbeat_period([row(30)], 5.0) == 5.0  # the default lease: the reconcile period
    assert heartbeat_period([row(1)], 5.0) == 0.5  # never busier than twice a second
    assert heartbeat_period([row(None)], 5.0) == 5.0 and heartbeat_period([], 5.0) == 5.0


async def test_a_leaving_node_is_drained_once_per_leaving_and_only_where_its_sandboxes_can_go(
        store: Store, nodes: tuple[FakeNode, FakeNode, list[Any]]) -> None:
    """``space node leave`` makes the node report ``leaving`` in its heartbeat's answer: the leader
    cordons it and queues its drain, once. An operator's uncordon is not undone while the same
    leaving stands; a new leaving drains again. With no other node to take its sandboxes, nothing
    is queued and the heartbeat goes on."""
    a, b, _ = nodes
    ctl, registry = await _controller(store)
    try:
        await ctl.check_nodes()
        await _running_on(store, "node-a")
        a.info["leaving"] = {"reason": "the cluster autoscaler is removing the node", "since": 100.0}

        await ctl.check_nodes()

        assert (await store.get_node("node-a")).cordoned
        drains = await store.find_operations(target="node/node-a", kind="node.drain")
        assert len(drains) == 1 and drains[0].status == "pending" and drains[0].tenant == "default"
        assert drains[0].request["reason"] == "the node is leaving: the cluster autoscaler is removing the node"
        await store.finish_operation(drains[0].id, "succeeded", result={"moved": []})
        await store.set_node_cordoned("node-a", False)  # the operator's call

        await ctl.check_nodes()
        assert not (await store.get_node("node-a")).cordoned
        assert len(await store.find_operations(target="node/node-a", kind="node.drain")) == 1

        a.info["leaving"] = {"reason": "the node is cordoned (kubectl cordon or drain)", "since": 200.0}
        await ctl.check_nodes()
        assert len(await store.find_operations(target="node/node-a", kind="node.drain")) == 2

        # node-b leaves while node-a is cordoned: nowhere to go.
        b.info["leaving"] = {"reason": "the operator retires the machine", "since": 300.0}
        await ctl.check_nodes()
        assert not (await store.get_node("node-b")).cordoned
        assert await store.find_operations(target="node/node-b", kind="node.drain") == []
        assert (await store.get_node("node-b")).state == "ready"
    finally:
        await registry.aclose()
