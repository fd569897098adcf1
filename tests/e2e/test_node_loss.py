"""A sandbox outlives its node: continuous disk backup, self-fencing and restore elsewhere, end to end
(a ``space serve`` and two further node agents over mutual TLS, real sandboxes, one object store).

- its disk is shipped as a chain of incremental links while it runs: a change shows up as a new
  link within seconds, no change ships nothing (the backup's time still moves on), and the row
  says what is durable (``backup``)
- the node agent and every process of its sandboxes SIGKILLed: the sandbox runs on another node
  from its disk backup (the files written before the last link are there), and the event says so
- the node cut off (every request to it refused) past its lease: it freezes its sandbox itself, the
  sandbox then runs elsewhere, and the frozen copy wrote nothing after the new one started; when the
  node answers again it discards that copy
- the agent alone SIGSTOPped (its sandboxes live on): each shim freezes its sandbox a grace after
  the published lease end, before the node is declared lost; the continued agent discards the copy
- the backup interval set for the tenant (not the sandbox) is the one used; turned off, the node
  stops backing the sandbox up and the row keeps what is durable
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import time
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
    node_processes,
    node_scratch,
    own_server,
    sh,
)
from tests.e2e.test_lifecycle import act
from tests.waiting import wait_for

pytestmark = pytest.mark.runtime

LEASE = 6
POLICY = {"backup_every": 1, "disk_every": None, "full_every": None}


@pytest.fixture(scope="module")
def primary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with own_server(tmp_path_factory.mktemp("nodeloss")) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(primary: Server) -> Iterator[httpx.Client]:
    with primary.client() as c:
        yield c


@contextlib.contextmanager
def further_node(primary: Server, api: httpx.Client, node_id: str, tmp: Path) -> Iterator[NodeAgent]:
    scratch = node_scratch(f"{node_id}-")
    marker = scratch / "partitioned"
    node = NodeAgent(node_id=node_id, data_dir=scratch / "data", cache_dir=scratch / "cache",
                     log_path=tmp / f"{node_id}.log", object_store_url=str(primary.data_dir / "objects"),
                     env={"SPACE_FENCE_AFTER": str(LEASE), "SPACE_FAILPOINTS": f"node.partitioned=while:{marker}"})
    try:
        node.start(primary)
        yield node
    finally:
        marker.unlink(missing_ok=True)
        try:
            for sb in api.get("/v1/sandboxes").json()["sandboxes"]:
                if sb["node_id"] == node_id:
                    _delete(api, sb["id"])
        finally:
            node.teardown()
        assert loop_devices(node.data_dir / "pool.img") == "", f"{node_id}'s loop device leaked"
        assert not channel_dir_for(node.data_dir).exists(), f"{node_id}'s socket directory leaked"
        shutil.rmtree(scratch)


def _delete(api: httpx.Client, sid: str) -> None:
    r = api.delete(f"/v1/sandboxes/{sid}")
    if r.status_code == 202:
        wait_for(lambda: api.get(f"/v1/operations/{r.json()['operation']['id']}").json()["status"]
                 in ("succeeded", "failed"), 120, f"the delete of {sid}")


def _on(api: httpx.Client, node: NodeAgent, policy: dict[str, Any] = POLICY) -> str:
    """A sandbox backed up every second, running on ``node`` (made where the template is, then
    suspended and restored there: only node-1 builds templates)."""
    sid = create_sandbox(api, snapshot_policy=policy)
    act(api, sid, "suspend")
    r = api.post(f"/v1/sandboxes/{sid}/restore", json={"node": node.node_id})
    assert r.status_code == 202, r.text
    wait_for(lambda: api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running", 300, "the restore")
    assert api.get(f"/v1/sandboxes/{sid}").json()["node_id"] == node.node_id
    return sid


def _backup(api: httpx.Client, sid: str) -> dict[str, Any]:
    return api.get(f"/v1/sandboxes/{sid}").json().get("backup") or {}


def _durable_after(api: httpx.Client, sid: str, moment: dt.datetime, what: str) -> dict[str, Any]:
    def fresh() -> dict[str, Any] | None:
        b = _backup(api, sid)
        return b if b.get("disk_at") and dt.datetime.fromisoformat(b["disk_at"]) > moment else None
    return wait_for(fresh, 60, what)  # type: ignore[no-any-return]


def _clock_writer(api: httpx.Client, sid: str, node: NodeAgent) -> Path:
    """A writer in the sandbox appending the wall clock (ms) ten times a second to its own disk,
    backed up once: the file on ``node``'s copy of its root."""
    r = api.post(f"/v1/sandboxes/{sid}/commands", json={
        "shell": "while :; do date +%s%3N >> /home/user/clock; sleep 0.1; done"})
    assert r.status_code == 201, r.text
    clock = node.data_dir / "pool" / "sandboxes" / sid / "rootfs" / "home" / "user" / "clock"
    wait_for(lambda: clock.exists() and clock.stat().st_size > 0, 30, "the writer to write")
    _durable_after(api, sid, dt.datetime.now(dt.UTC), "a backup of the running sandbox")
    return clock


def _running_elsewhere(api: httpx.Client, sid: str, old: str) -> dict[str, Any]:
    def elsewhere() -> dict[str, Any] | None:
        sb: dict[str, Any] = api.get(f"/v1/sandboxes/{sid}").json()
        return sb if sb["state"] == "running" and sb["node_id"] not in (None, old) else None
    return wait_for(elsewhere, 120, "the sandbox to run on another node")  # type: ignore[no-any-return]


def _node_processes(node: NodeAgent) -> list[int]:
    """Every process of the node: its agent, its helper and gateway, its sandboxes' runsc."""
    return node_processes(node.data_dir)


def _events(api: httpx.Client, sid: str) -> list[dict[str, Any]]:
    return api.get(f"/v1/sandboxes/{sid}/events").json()["events"]


def test_the_disk_is_shipped_as_it_changes_and_the_sandbox_outlives_its_killed_node(
        primary: Server, api: httpx.Client, tmp_path: Path) -> None:
    with further_node(primary, api, "node-b", tmp_path) as b, further_node(primary, api, "node-c", tmp_path) as c:
        # The interval is the tenant's here (the sandbox's own policy does not name one).
        assert api.put("/v1/tenants/default/backup", json={"every": "1s"}).json()["every"] == 1
        sid = _on(api, b, {k: v for k, v in POLICY.items() if k != "backup_every"})
        try:
            # Each moment is taken once the write is on disk: a look between an earlier moment and
            # the write would rightly find nothing changed, and be newer than that moment.
            sh(api, sid, "echo one > /home/user/one.txt && sync")
            first = dt.datetime.now(dt.UTC)
            after_one = _durable_after(api, sid, first, "the first write to be backed up")
            assert after_one["chain"] and after_one["links"] >= 1 and after_one["rpo_s"] < 30, after_one
            # Nothing changes: no link is shipped, but what is durable is as of the newer look.
            idle = _durable_after(api, sid, dt.datetime.fromisoformat(after_one["disk_at"]), "an idle look")
            assert (idle["chain"], idle["links"]) == (after_one["chain"], after_one["links"]), idle
            sh(api, sid, "head -c 300000 /dev/urandom > /home/user/two.bin && sync")
            second = dt.datetime.now(dt.UTC)
            digest = sh(api, sid, "sha256sum /home/user/two.bin").split()[0]
            after_two = _durable_after(api, sid, second, "the second write to be backed up")
            assert after_two["links"] > after_one["links"], (after_one, after_two)
            metrics = api.get("/metrics").text
            assert 'space_backup_worst_rpo_seconds{node="node-b"}' in metrics

            # node-c is where it goes (cordoned nodes get nothing new): the test reads that node's backups.
            others = [n["id"] for n in api.get("/v1/nodes").json()["nodes"] if n["id"] not in ("node-b", "node-c")]
            for other in others:
                assert api.post(f"/v1/nodes/{other}/cordon").status_code == 200
            killed_at = time.time()
            pids = _node_processes(b)
            assert b.proc is not None and b.proc.pid in pids
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            b.proc.wait(timeout=30)

            def elsewhere() -> bool:
                sb = api.get(f"/v1/sandboxes/{sid}").json()
                return sb["state"] == "running" and sb["node_id"] not in (None, "node-b")
            wait_for(elsewhere, 120, "the sandbox to run on another node")
            took = time.time() - killed_at
            assert sh(api, sid, "cat /home/user/one.txt").strip() == "one"
            assert sh(api, sid, "sha256sum /home/user/two.bin").split()[0] == digest
            nodes = {n["id"]: n for n in api.get("/v1/nodes").json()["nodes"]}
            assert nodes["node-b"]["state"] == "lost", nodes["node-b"]
            relocated = [e for e in _events(api, sid) if e["kind"] == "relocated"]
            assert relocated and "disk backup" in relocated[-1]["message"], _events(api, sid)
            assert "node-b was lost" in relocated[-1]["message"]
            print(f"node killed → sandbox running elsewhere: {took:.1f} s (lease {LEASE} s)")
            # Backup turned off for the tenant: the new node stops backing it up at its next
            # heartbeat, and the row keeps saying what is durable.
            assert api.get(f"/v1/sandboxes/{sid}").json()["node_id"] == c.node_id
            wait_for(lambda: sid in c.info()["backups"], 60, "the new node to back the sandbox up")
            assert api.put("/v1/tenants/default/backup", json={"every": "off"}).json()["every"] == 0
            wait_for(lambda: sid not in c.info()["backups"], 60, "the new node to stop backing it up")
            assert _backup(api, sid).get("disk_at")
        finally:
            _delete(api, sid)
            api.put("/v1/tenants/default/backup", json={"every": None})
            for n in api.get("/v1/nodes").json()["nodes"]:
                if n.get("cordoned"):
                    api.post(f"/v1/nodes/{n['id']}/uncordon")


def test_a_partitioned_node_freezes_its_copy_before_another_runs_and_discards_it_when_back(
        primary: Server, api: httpx.Client, tmp_path: Path) -> None:
    with further_node(primary, api, "node-d", tmp_path) as d, further_node(primary, api, "node-e", tmp_path):
        sid = _on(api, d)
        try:
            # A writer appending the wall clock (ms) ten times a second to its own disk.
            clock = _clock_writer(api, sid, d)

            marker = d.data_dir.parent / "partitioned"
            marker.touch()

            moved = _running_elsewhere(api, sid, "node-d")
            lost = [e for e in _events(api, sid) if e["kind"] == "node_lost"][-1]
            # The old copy froze itself (its lease ran out) before the control plane even declared
            # its node lost, let alone placed the sandbox anew: its writer's last line is older.
            last_old = int(clock.read_text().split()[-1])
            assert last_old < dt.datetime.fromisoformat(lost["at"]).timestamp() * 1000, (last_old, lost)
            size = clock.stat().st_size
            assert sh(api, sid, "cat /home/user/clock | wc -l").strip().isdigit()  # the new copy answers
            assert clock.stat().st_size == size, "the fenced copy wrote on"
            assert "sandbox.fenced" in d.log_tail(200_000)

            marker.unlink()  # the partition ends
            wait_for(lambda: not (d.data_dir / "pool" / "sandboxes" / sid).exists(), 60,
                     "the returning node to discard its stale copy")
            nodes = {n["id"]: n for n in api.get("/v1/nodes").json()["nodes"]}
            assert nodes["node-d"]["state"] == "ready", nodes["node-d"]
            assert api.get(f"/v1/sandboxes/{sid}").json()["node_id"] == moved["node_id"]
        finally:
            _delete(api, sid)


def test_a_stopped_agent_cannot_fence_so_its_shims_freeze_its_sandboxes_before_another_copy_runs(
        primary: Server, api: httpx.Client, tmp_path: Path) -> None:
    """The node agent alone is SIGSTOPped (a hung agent): its sandboxes' runtimes live on and no
    agent is there to freeze them. Their shims do, once the published lease end is past."""
    with further_node(primary, api, "node-f", tmp_path) as f, further_node(primary, api, "node-g", tmp_path):
        sid = _on(api, f)
        try:
            clock = _clock_writer(api, sid, f)
            instance = json.loads((f.data_dir / "pool" / "sandboxes" / sid / "state.json").read_text())["instance_id"]
            freezer = Path("/sys/fs/cgroup/freezer/space") / instance / "freezer.state"
            assert freezer.read_text().strip() == "THAWED"
            assert f.proc is not None
            os.kill(f.proc.pid, signal.SIGSTOP)  # the agent only: helper, gateway, shims and runsc run on
            try:
                # No agent runs: only the shim can freeze it, a grace after the lease's end.
                wait_for(lambda: freezer.read_text().strip() == "FROZEN", LEASE + 30, "the shim to freeze it")
                moved = _running_elsewhere(api, sid, "node-f")
                lost = [ev for ev in _events(api, sid) if ev["kind"] == "node_lost"][-1]
                # Frozen by its shim (no agent ran) before the node was even declared lost.
                last_old = int(clock.read_text().split()[-1])
                assert last_old < dt.datetime.fromisoformat(lost["at"]).timestamp() * 1000, (last_old, lost)
                size = clock.stat().st_size
                assert sh(api, sid, "cat /home/user/clock | wc -l").strip().isdigit()  # the new copy answers
                assert clock.stat().st_size == size, "the old copy wrote on"
            finally:
                os.kill(f.proc.pid, signal.SIGCONT)
            wait_for(lambda: not (f.data_dir / "pool" / "sandboxes" / sid).exists(), 90,
                     "the returning agent to discard its stale copy")
            assert api.get(f"/v1/sandboxes/{sid}").json()["node_id"] == moved["node_id"]
        finally:
            _delete(api, sid)
