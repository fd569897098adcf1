"""Warm pools, end to end on real runsc: a create binds a booted, never-used sandbox and answers
with it running; the per-request env applies without a cold start; the pool refills; a sandbox is
handed out once and never again (deleted ones are not recycled, warm ones are unreachable until
claimed); other sizes boot cold; sizes are bounded by node memory; a shrunk pool releases its
sandboxes; a node agent crash keeps the warm ones and never re-pools a claimed one; the CLI and
API speak the contract (`space pool set`, `space pool list --json`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import (
    SPACE,
    Server,
    _node_agent_running,
    create_sandbox,
    node_agent_pid,
    node_agent_pid_or_none,
    own_server,
    run,
    wait_operation,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.runtime

BOOT_DEADLINE = 120.0


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with own_server(tmp_path_factory.mktemp("pool"), "--warm-pool", "2") as srv:
        yield srv


@pytest.fixture(scope="module")
def api(pooled: Server) -> Iterator[httpx.Client]:
    with pooled.client() as c:
        yield c


def _pool(api: httpx.Client, template: str = "base", memory_mb: int = 512) -> dict[str, Any]:
    for p in api.get("/v1/pools").json()["pools"]:
        if p["template"] == template and p["memory_mb"] == memory_mb:
            return dict(p)
    return {"size": 0, "ready": 0, "booting": 0}


def _wait_ready(api: httpx.Client, n: int, **key: Any) -> dict[str, Any]:
    return wait_for(lambda: (p := _pool(api, **key))["ready"] >= n and p, BOOT_DEADLINE,
                    f"{n} warm sandboxes ready")


def _warm_ids(server: Server) -> set[str]:
    """Warm sandboxes as the node records them (state.json with ``warm``)."""
    out = set()
    for state in (server.data_dir / "pool" / "sandboxes").glob("*/state.json"):
        try:
            body = json.loads(state.read_text())
        except (OSError, ValueError):
            continue
        if body.get("warm") and body.get("status") == "running":
            out.add(str(body["id"]))
    return out


def _create(api: httpx.Client, **body: Any) -> httpx.Response:
    body.setdefault("template", "base")
    return api.post("/v1/sandboxes", json=body)


def test_create_binds_a_warm_sandbox_with_the_requests_env(pooled: Server, api: httpx.Client) -> None:
    _wait_ready(api, 2)
    warm = _warm_ids(pooled)
    assert len(warm) == 2
    # Waiting costs no CPU but for the next one to be claimed (thawed, so that no create pays for
    # waking it), and they all weigh little.
    assert sorted(_cgroup(pooled, w, "freezer", "freezer.state") for w in warm) == ["FROZEN", "THAWED"]
    assert {_cgroup(pooled, w, "cpu", "cpu.shares") for w in warm} == {"64"}

    r = _create(api, env={"GREETING": "hello from the request"}, metadata={"team": "a"})
    assert r.status_code == 201, r.text
    sb, op = r.json()["sandbox"], r.json()["operation"]
    # Answered running, with a finished operation: nothing left to wait for.
    assert sb["state"] == "running" and sb["metadata"] == {"team": "a"}
    assert op["status"] == "succeeded" and op["result"]["warm"] is True
    assert sb["id"] in warm, "the sandbox must be one the pool had booted"
    assert api.get(f"/v1/operations/{op['id']}").json()["status"] == "succeeded"

    assert _cgroup(pooled, sb["id"], "freezer", "freezer.state") == "THAWED"
    # Primed in the pool (one `true` as its user, forgotten): nothing shows in its command list.
    assert api.get(f"/v1/sandboxes/{sb['id']}/commands").json()["commands"] == []
    wait_for(lambda: _cgroup(pooled, sb["id"], "cpu", "cpu.shares") == "1024", 10, "its full CPU weight")
    code, out, _ = run(api, sb["id"], {"shell": "echo $GREETING; whoami"})
    assert (code, out) == (0, b"hello from the request\nuser\n")

    # The pool refills to its size in the background.
    _wait_ready(api, 2)
    assert sb["id"] not in _warm_ids(pooled)
    api.delete(f"/v1/sandboxes/{sb['id']}")


def test_a_sandbox_is_handed_out_once(pooled: Server, api: httpx.Client) -> None:
    _wait_ready(api, 2)
    # A warm sandbox has no owner: the data plane does not know it.
    for wid in _warm_ids(pooled):
        assert api.get(f"/v1/sandboxes/{wid}").status_code == 404
        assert api.post(f"/v1/sandboxes/{wid}/commands", json={"cmd": ["true"]}).status_code == 404

    first = _create(api).json()["sandbox"]["id"]
    assert run(api, first, {"shell": "echo used > /tmp/marker"})[0] == 0
    assert api.delete(f"/v1/sandboxes/{first}").status_code == 202

    seen = {first}
    for _ in range(3):
        _wait_ready(api, 1)
        r = _create(api)
        assert r.status_code == 201, r.text
        sid = r.json()["sandbox"]["id"]
        assert sid not in seen, "a sandbox was handed out twice"
        seen.add(sid)
        _, out, _ = run(api, sid, {"shell": "cat /tmp/marker 2>/dev/null || echo fresh"})
        assert out == b"fresh\n"
        api.delete(f"/v1/sandboxes/{sid}")


def test_other_sizes_boot_cold_and_sizes_are_bounded(pooled: Server, api: httpx.Client) -> None:
    r = _create(api, memory_mb=1024)
    assert r.status_code == 202, r.text
    assert r.json()["sandbox"]["state"] == "creating"
    op = wait_operation(api, r.json()["operation"]["id"])
    assert op["status"] == "succeeded" and not op["result"].get("warm")
    api.delete(f"/v1/sandboxes/{r.json()['sandbox']['id']}")

    r = api.put("/v1/pools/base", json={"size": 60, "memory_mb": 16384})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and "budget" in err["message"] and err["max_size"] >= 0
    assert api.put("/v1/pools/no-such-template", json={"size": 1}).status_code == 404
    with pooled.client(key=_member_key(api)) as member:
        assert member.put("/v1/pools/base", json={"size": 3}).status_code == 403


def test_pool_cli_contract_and_shrinking_releases_sandboxes(pooled: Server, api: httpx.Client) -> None:
    env = {**os.environ, "SPACE_URL": pooled.url, "SPACE_API_KEY": pooled.admin_key}
    res = subprocess.run([SPACE, "pool", "set", "base", "--size", "1", "--memory", "256"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    _wait_ready(api, 1, memory_mb=256)
    res = subprocess.run([SPACE, "pool", "list", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    listed = {(p["template"], p["memory_mb"]): p for p in json.loads(res.stdout)}
    assert listed[("base", 256)]["size"] == 1 and listed[("base", 256)]["ready"] == 1
    assert listed[("base", 512)]["size"] == 2

    small = _warm_ids(pooled) - _warm_ids_of_size(pooled, 512)
    assert len(small) == 1
    assert api.put("/v1/pools/base", json={"size": 0, "memory_mb": 256}).status_code == 200
    wait_for(lambda: not (small & _warm_ids(pooled)), BOOT_DEADLINE, "the shrunk pool to release its sandbox")
    assert ("base", 256) not in {(p["template"], p["memory_mb"]) for p in api.get("/v1/pools").json()["pools"]}


def test_node_agent_crash_keeps_warm_sandboxes_and_never_repools_a_claimed_one(
    pooled: Server, api: httpx.Client
) -> None:
    _wait_ready(api, 2)
    r = _create(api)
    assert r.status_code == 201, r.text
    claimed = r.json()["sandbox"]["id"]
    _wait_ready(api, 2)
    warm_before = _warm_ids(pooled)

    old = node_agent_pid(pooled)
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: node_agent_pid_or_none(pooled) not in (None, old), 60, "a new node agent")
    wait_for(lambda: api.post(f"/v1/sandboxes/{claimed}/commands", json={"cmd": ["true"]}).status_code == 201,
             60, "the node agent to serve again")
    _wait_ready(api, 2)
    # The same booted sandboxes serve again; the claimed one stays its owner's.
    assert _warm_ids(pooled) == warm_before
    assert claimed not in _warm_ids(pooled)
    assert run(api, claimed, {"cmd": ["true"]})[0] == 0
    api.delete(f"/v1/sandboxes/{claimed}")


def test_cold_create_still_works_without_a_pool(pooled: Server, api: httpx.Client) -> None:
    assert api.put("/v1/pools/base", json={"size": 0}).status_code == 200
    wait_for(lambda: not _warm_ids(pooled), BOOT_DEADLINE, "the pool to drain")
    sid = create_sandbox(api)  # asserts a 202 and a succeeded operation
    assert run(api, sid, {"cmd": ["true"]})[0] == 0
    api.delete(f"/v1/sandboxes/{sid}")


def _cgroup(server: Server, sandbox_id: str, controller: str, name: str) -> str:
    state = json.loads((server.data_dir / "pool" / "sandboxes" / sandbox_id / "state.json").read_text())
    return (Path("/sys/fs/cgroup") / controller / "space" / state["instance_id"] / name).read_text().strip()


def _warm_ids_of_size(server: Server, memory_mb: int) -> set[str]:
    out = set()
    for sid in _warm_ids(server):
        body = json.loads((server.data_dir / "pool" / "sandboxes" / sid / "state.json").read_text())
        if body.get("memory_mb") == memory_mb:
            out.add(sid)
    return out


def _member_key(api: httpx.Client) -> str:
    r = api.post("/v1/apikeys", json={"tenant": "pool-test", "role": "member"})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


def test_a_crash_between_claim_and_commit_leaves_nothing_behind(tmp_path: Path) -> None:
    """The API dies after the node handed out a warm sandbox and before the row was written: the
    client's retry (same Idempotency-Key) gets a sandbox, and the orphan is removed."""
    with own_server(tmp_path, "--warm-pool", "1", env={"SPACE_CLAIM_GRACE": "2"}, start=False) as srv:
        # The API writes the marker, as the service user: in the scratch dir that user may write to.
        marker = srv.data_dir.parent / "crashed"
        srv.env["SPACE_FAILPOINTS"] = f"api.after_warm_claim=crash-once:{marker}"
        srv.start()
        with srv.client() as api:
            _wait_ready(api, 1)
            (orphan,) = _warm_ids(srv)
            with pytest.raises(httpx.TransportError):
                api.post("/v1/sandboxes", json={"template": "base"}, headers={"Idempotency-Key": "job-1"})
        assert marker.exists()
        assert srv.proc is not None
        srv.proc.wait(timeout=30)
        wait_for(lambda: not _node_agent_running(srv.data_dir), 30, "the node agent to exit")

        srv.start()
        with srv.client() as api:
            r = api.post("/v1/sandboxes", json={"template": "base"}, headers={"Idempotency-Key": "job-1"})
            assert r.status_code in (201, 202), r.text
            sid = r.json()["sandbox"]["id"]
            assert sid != orphan
            if r.status_code == 202:
                assert wait_operation(api, r.json()["operation"]["id"])["status"] == "succeeded"
            assert run(api, sid, {"cmd": ["true"]})[0] == 0
            # Claimed but never recorded: reconcile removes it once its grace period is over.
            wait_for(lambda: not (srv.data_dir / "pool" / "sandboxes" / orphan).exists(), 120,
                     "the orphaned claim to be removed")
            assert api.get(f"/v1/sandboxes/{orphan}").status_code == 404
            api.delete(f"/v1/sandboxes/{sid}")
