"""Restore on any node: a sandbox suspended on one node comes back on another node process (its own
data dir, btrfs pool and template cache) registered with the same control plane, with its files and
running processes; concurrent restores needing the same template download it once."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.node.main import channel_dir_for
from tests.e2e.harness import (
    NodeAgent,
    Server,
    create_sandbox,
    loop_devices,
    node_scratch,
    own_server,
    wait_operation,
)
from tests.e2e.test_lifecycle import act, count, sh, start_counter
from tests.waiting import wait_for

pytestmark = pytest.mark.runtime

BLOB = "/home/user/blob"


@dataclasses.dataclass
class Parked:
    """A sandbox suspended from node-1 with a file and a counting process."""

    id: str
    command: str
    blob_sha256: str
    #: The counter's value just before the suspend (it lives in the shell's memory).
    count: int


@pytest.fixture(scope="module")
def primary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own: the nodes registered here must not leak into the shared one."""
    with own_server(tmp_path_factory.mktemp("multinode")) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(primary: Server) -> Iterator[httpx.Client]:
    with primary.client() as c:
        yield c


@pytest.fixture(scope="module")
def parked(api: httpx.Client) -> Iterator[list[Parked]]:
    """Three suspended sandboxes, made while node-1 is the only node: new sandboxes are placed on
    the least-loaded node, and the nodes started later have no template to create one from."""
    made: list[str] = []
    out: list[Parked] = []
    try:
        for _ in range(3):
            sid = create_sandbox(api)
            made.append(sid)
            assert api.get(f"/v1/sandboxes/{sid}").json()["node_id"] == "node-1"
            cid = start_counter(api, sid)
            digest = sh(api, sid, f"head -c 1000000 /dev/urandom > {BLOB} && sha256sum {BLOB}").split()[0]
            # Read before the suspend: the value frozen into the checkpoint is at least this.
            out.append(Parked(sid, cid, digest, count(api, sid)))
            act(api, sid, "suspend")
            sb = api.get(f"/v1/sandboxes/{sid}").json()
            assert sb["state"] == "suspended" and sb["node_id"] is None, sb
        yield out
    finally:
        for sid in made:
            _delete(api, sid)


def _delete(api: httpx.Client, sid: str) -> None:
    r = api.delete(f"/v1/sandboxes/{sid}")
    if r.status_code == 202:
        op = wait_operation(api, r.json()["operation"]["id"])
        assert op["status"] == "succeeded", op


@contextlib.contextmanager
def extra_node(primary: Server, api: httpx.Client, node_id: str, tmp: Path) -> Iterator[NodeAgent]:
    """A node agent registered with ``primary``, sharing its object store but not its cache; on
    exit its sandboxes are deleted and its pool, loop device and sockets released."""
    scratch = node_scratch(f"{node_id}-")
    node = NodeAgent(node_id=node_id, data_dir=scratch / "data", cache_dir=scratch / "cache",
                     log_path=tmp / f"{node_id}.log", object_store_url=str(primary.data_dir / "objects"))
    try:
        node.start(primary)
        yield node
    finally:
        try:
            for sb in api.get("/v1/sandboxes").json()["sandboxes"]:
                if sb["node_id"] == node_id:
                    _delete(api, sb["id"])
        finally:
            node.teardown()
        assert loop_devices(node.data_dir / "pool.img") == "", f"{node_id}'s loop device leaked"
        assert not channel_dir_for(node.data_dir).exists(), f"{node_id}'s socket directory leaked"
        shutil.rmtree(scratch)


def _assert_intact(api: httpx.Client, p: Parked, node: NodeAgent) -> None:
    sb = api.get(f"/v1/sandboxes/{p.id}").json()
    assert (sb["state"], sb["node_id"]) == ("running", node.node_id), sb
    # It lives in that node's pool now.
    assert (node.data_dir / "pool" / "sandboxes" / p.id / "rootfs").is_dir()
    assert sh(api, p.id, f"sha256sum {BLOB}").split()[0] == p.blob_sha256
    # The counter goes on from the value in its memory, not from zero.
    first = count(api, p.id)
    assert first >= p.count, (first, p.count)
    wait_for(lambda: count(api, p.id) > first, 30, "the restored counter to continue")
    cmds = api.get(f"/v1/sandboxes/{p.id}/commands").json()["commands"]
    assert any(c["id"] == p.command and c["state"] == "running" for c in cmds), cmds


def _start_restore(api: httpx.Client, sid: str, node_id: str) -> str:
    r = api.post(f"/v1/sandboxes/{sid}/restore", json={"node": node_id})
    assert r.status_code == 202, r.text
    return str(r.json()["operation"]["id"])


def test_a_sandbox_suspended_on_one_node_restores_on_another(
    primary: Server, api: httpx.Client, parked: list[Parked], tmp_path: Path
) -> None:
    p = parked[0]
    with extra_node(primary, api, "node-2", tmp_path) as node:
        nodes = {n["id"]: n for n in api.get("/v1/nodes").json()["nodes"]}
        assert {"node-1", "node-2"} <= set(nodes), nodes
        assert nodes["node-2"]["url"] == node.url and nodes["node-2"]["state"] == "ready"
        before = node.info()
        assert before["templates"] == [] and before["template_downloads"] == 0, before

        op = wait_operation(api, _start_restore(api, p.id, "node-2"), timeout=300)
        assert op["status"] == "succeeded", op
        assert op["result"]["node_id"] == "node-2"
        _assert_intact(api, p, node)
        # The template came from object storage (its cache was empty), received into its pool.
        after = node.info()
        assert after["template_downloads"] == 1 and after["templates"] == ["base"], after
        assert any((node.cache_dir / "templates").glob("base-*.btrfs.zst"))
        events = api.get(f"/v1/sandboxes/{p.id}/events").json()["events"]
        assert events[-1]["kind"] == "restored" and "node-2" in events[-1]["message"], events[-1]


def test_concurrent_restores_on_a_fresh_node_share_one_template_download(
    primary: Server, api: httpx.Client, parked: list[Parked], tmp_path: Path
) -> None:
    pair = parked[1:3]
    with extra_node(primary, api, "node-3", tmp_path) as node:
        assert node.info()["template_downloads"] == 0
        # Both requests go out at once, so both restores need the missing template together.
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            op_ids = list(ex.map(lambda p: _start_restore(api, p.id, "node-3"), pair))
        ops: list[dict[str, Any]] = [wait_operation(api, o, timeout=300) for o in op_ids]
        assert [o["status"] for o in ops] == ["succeeded", "succeeded"], ops
        assert node.info()["template_downloads"] == 1
        for p in pair:
            _assert_intact(api, p, node)


def test_creates_go_where_the_template_and_the_warm_pool_are(
    primary: Server, api: httpx.Client, tmp_path: Path
) -> None:
    """Placement end to end: node-1 has the template but is busier; an empty node without the
    template loses a cold create to it (no download), and a warm create is served where the pool
    could be filled."""
    busy = create_sandbox(api, memory_mb=2048)
    placed: list[str] = [busy]
    try:
        assert api.get(f"/v1/sandboxes/{busy}").json()["node_id"] == "node-1"
        with extra_node(primary, api, "node-4", tmp_path) as node:
            def heartbeat_seen() -> bool:
                nodes = {n["id"]: n for n in api.get("/v1/nodes").json()["nodes"]}
                return "templates" in (nodes.get("node-4", {}).get("capacity") or {})
            wait_for(heartbeat_seen, 60, "node-4's first heartbeat")

            sid = create_sandbox(api, memory_mb=768)  # cold: no pool of that size
            placed.append(sid)
            assert api.get(f"/v1/sandboxes/{sid}").json()["node_id"] == "node-1"

            assert api.put("/v1/pools/base", json={"size": 1}).status_code == 200
            wait_for(lambda: api.get("/v1/pools").json()["pools"][0]["nodes"].get("node-1", {}).get("ready"),
                     120, "a warm sandbox on node-1")
            r = api.post("/v1/sandboxes", json={"template": "base"})
            assert r.status_code == 201, r.text
            placed.append(r.json()["sandbox"]["id"])
            assert r.json()["sandbox"]["node_id"] == "node-1"
            # node-4 never needed the template: nothing was placed there, nothing downloaded.
            assert node.info()["template_downloads"] == 0 and node.info()["sandboxes"] == 0
            assert api.put("/v1/pools/base", json={"size": 0}).status_code == 200
    finally:
        for sid in placed:
            _delete(api, sid)
