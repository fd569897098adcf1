"""Crash convergence: SIGKILL ``space serve`` in the middle of creates; after a restart every sandbox
ends running or cleanly failed, and no runsc container, sentry, mount or loop device is left behind."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import (
    Server,
    create_sandbox,
    node_agent_pid,
    node_agent_pid_or_none,
    read_events,
    run,
    wait_for,
    wait_operation,
)

pytestmark = pytest.mark.runtime


def _runsc_containers(server: Server) -> set[str]:
    out = subprocess.run(["runsc", f"--root={server.data_dir / 'runsc'}", "list", "--format=json"],
                         capture_output=True, text=True).stdout
    return {c["id"] for c in (json.loads(out) if out.strip() else None) or []}


def test_sigkill_mid_create_converges(fresh_server: Server) -> None:
    srv = fresh_server
    srv.start()
    with srv.client() as api:
        ops = []
        for _ in range(3):
            r = api.post("/v1/sandboxes", json={"template": "base"})
            ops.append((r.json()["sandbox"]["id"], r.json()["operation"]["id"]))
        # Kill as soon as the first runtime instance exists: creates are in flight.
        wait_for(lambda: _runsc_containers(srv), 60, "a runsc container to appear", interval=0.01)
    srv.kill()

    srv.start()
    with srv.client() as api:
        for sid, op_id in ops:
            op = wait_operation(api, op_id, timeout=180)
            state = api.get(f"/v1/sandboxes/{sid}").json()["state"]
            if op["status"] == "succeeded":
                assert state == "running"
                assert run(api, sid, {"cmd": ["true"]})[0] == 0
            else:
                assert state == "failed", (op, state)
        live = {sid for sid, _ in ops if api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"}
        # Exactly one runtime instance per running sandbox, none for the rest.
        instances = _runsc_containers(srv)
        assert {i.rsplit("-", 1)[0] for i in instances} == live
        assert len(instances) == len(live)
        for sid, _ in ops:
            api.delete(f"/v1/sandboxes/{sid}")
        wait_for(lambda: not _runsc_containers(srv), 120, "every runsc container to go")


def test_sandboxes_survive_a_server_restart(fresh_server: Server) -> None:
    srv = fresh_server
    srv.start()
    with srv.client() as api:
        r = api.post("/v1/sandboxes", json={"template": "base"})
        sid = r.json()["sandbox"]["id"]
        assert wait_operation(api, r.json()["operation"]["id"])["status"] == "succeeded"
        run(api, sid, {"shell": "echo kept > /home/user/state.txt"})
        bg = api.post(f"/v1/sandboxes/{sid}/commands", json={"shell": "sleep 1000"}).json()["id"]
        # The shim holds the channel; it is out of the agent's cgroups (what a container runtime
        # or systemd kills the agent by) in every hierarchy: tests/deploy/test_containers.py.
        shim = _shim_of(api.get(f"/v1/sandboxes/{sid}").json()["instance_id"])
        groups = {line.split(":", 2)[2] for line in Path(f"/proc/{shim}/cgroup").read_text().splitlines()}
        assert groups == {"/space/shims"}, groups
    srv.kill()
    srv.start()
    with srv.client() as api:
        code, out, _ = run(api, sid, {"cmd": ["cat", "/home/user/state.txt"]})
        assert (code, out) == (0, b"kept\n")
        cmds = {c["id"]: c for c in api.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]}
        assert cmds[bg]["state"] == "running"
        api.delete(f"/v1/sandboxes/{sid}")


def _shim_of(instance: str) -> int:
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"space.runtime.shim" in argv and any(a.endswith(f"/{instance}.sock".encode()) for a in argv):
                return int(p.name)
    raise AssertionError(f"no shim of instance {instance}")


def test_node_agent_crash_loses_nothing(server: Server, api: httpx.Client) -> None:
    """The shim holds the guest channel: a SIGKILLed node agent is restarted by the server and
    re-attaches; the sandbox, its running command and the command's buffered output are intact."""
    sid = create_sandbox(api)
    r = api.post(f"/v1/sandboxes/{sid}/commands", json={"shell": "echo before; read x; echo after $x", "stdin": True})
    cid = r.json()["id"]
    wait_for(lambda: b"before" in _stdout(api, sid, cid, limit=1), 30, "the command's first output")
    old = node_agent_pid(server)
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: node_agent_pid_or_none(server) not in (None, old), 60, "a new node agent")
    wait_for(lambda: api.post(f"/v1/sandboxes/{sid}/commands/{cid}/stdin", content=b"1\n",
                              params={"eof": "true"}).status_code == 204, 60, "the sandbox to answer again")
    events = read_events(api, sid, cid)
    out = b"".join(base64.b64decode(e["data"]["data"]) for e in events if e["event"] == "stdout")
    assert out == b"before\nafter 1\n" and events[-1]["data"]["exit_code"] == 0
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
    api.delete(f"/v1/sandboxes/{sid}")


def _stdout(api: httpx.Client, sid: str, cid: str, limit: int) -> bytes:
    events = read_events(api, sid, cid, limit=limit)
    return b"".join(base64.b64decode(e["data"]["data"]) for e in events if e["event"] == "stdout")


def test_a_paused_sandbox_stays_paused_across_a_node_agent_crash(server: Server, api: httpx.Client) -> None:
    """The node agent adopts a paused instance as paused (not dead, not running) after a restart,
    and a resume continues its processes from memory."""
    from tests.e2e.test_lifecycle import act, count, start_counter

    sid = create_sandbox(api)
    start_counter(api, sid)
    act(api, sid, "pause")
    old = node_agent_pid(server)
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: node_agent_pid_or_none(server) not in (None, old), 60, "a new node agent")
    node = wait_for(lambda: next((s for s in _node_sandboxes(server) if s["id"] == sid), None), 60,
                    "the new node agent to adopt the sandbox")
    assert node["status"] == "paused", node
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
    act(api, sid, "resume")
    before = count(api, sid)
    wait_for(lambda: count(api, sid) > before, 30, "the counter to continue after the resume")
    api.delete(f"/v1/sandboxes/{sid}")


def _node_sandboxes(server: Server) -> list[dict[str, object]]:
    """The node agent's own view, through its API (unix socket, node token)."""
    from space.node.main import channel_dir_for

    sock = channel_dir_for(server.data_dir) / "node.sock"
    token = (server.data_dir / "node.token").read_text().strip()
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://node",
                          headers={"authorization": f"Bearer {token}"}, timeout=10) as c:
            r = c.get("/v1/sandboxes")
    except httpx.HTTPError:
        return []
    return list(r.json()["sandboxes"]) if r.status_code == 200 else []


def _sentries(server: Server) -> dict[int, str]:
    """pid -> instance of the node's runsc sentries and gofers, as the helper finds them in /proc."""
    from space.node.helper.verbs import HelperContext
    from space.node.helper.verbs_runtime import Runsc, runsc_processes

    return runsc_processes(Runsc(HelperContext(data_dir=server.data_dir, cache_dir=server.data_dir / "cache")))


def _forget_instance(server: Server, sid: str) -> str:
    """Make runsc lose track of the sandbox's running instance, as a launch cut short between
    starting the sentry and writing its state file leaves it; the instance id."""
    state = json.loads((server.data_dir / "pool" / "sandboxes" / sid / "state.json").read_text())
    instance = str(state["instance_id"])
    assert instance in _sentries(server).values()
    (server.data_dir / "runsc" / f"{instance}_sandbox:{instance}.state").unlink()
    return instance


@pytest.mark.parametrize("then", ["restart", "teardown"])
def test_a_sentry_runsc_lost_track_of_is_killed(fresh_server: Server, then: str) -> None:
    """Such a sentry holds the sandbox's log open in the pool: left running, the pool cannot be
    unmounted (``space node teardown`` failed with "target is busy"). A restart's recovery and a
    teardown both find it in /proc by the node's runsc root and kill it."""
    srv = fresh_server
    srv.start()
    with srv.client() as api:
        sid = create_sandbox(api)
        instance = _forget_instance(srv, sid)
    srv.stop()
    assert instance in _sentries(srv).values(), "the stop itself must leave sandboxes running"
    if then == "restart":
        srv.start()
        wait_for(lambda: instance not in _sentries(srv).values(), 60, "the stray sentry to be killed")
        with srv.client() as api:
            assert api.get(f"/v1/sandboxes/{sid}").json()["state"] != "running"
            api.delete(f"/v1/sandboxes/{sid}")
    else:
        srv.teardown()  # fresh_server's own teardown checks that the loop device went with the pool
        assert instance not in _sentries(srv).values()


def test_sigterm_shuts_down_cleanly_and_keeps_the_last_audit_records(fresh_server: Server) -> None:
    """A stop (SIGTERM) runs the server's shutdown: the audit records of the last calls are written
    (they are batched), the database is closed, and the process exits 0 instead of dying by signal."""
    import sqlite3

    fresh_server.start(wait_template=False)
    with fresh_server.client() as api:
        r = api.post("/v1/apikeys", json={"tenant": "default", "role": "readonly", "name": "last-call"})
        assert r.status_code == 201, r.text
        key_id = r.json()["id"]
    fresh_server.stop()
    assert fresh_server.proc is not None and fresh_server.proc.returncode == 0, fresh_server.log_tail()
    log_text = fresh_server.log_tail(20000)
    assert '"serve.stopped"' in log_text
    # The node agent ran its own shutdown too (pending removals, its helper), not died of the signal.
    stopped = [json.loads(line) for line in log_text.splitlines() if '"event": "node.stopped"' in line]
    assert [e["returncode"] for e in stopped] == [0], stopped
    assert '"helper.stopped"' in log_text
    db = sqlite3.connect(f"file:{fresh_server.data_dir / 'control' / 'space.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT action, result FROM audit_log WHERE target = ?", (key_id,)).fetchall()
    finally:
        db.close()
    assert rows == [("apikey.create", "ok")], rows


def test_a_stop_says_which_sandboxes_keep_running_and_a_restart_adopts_them(fresh_server: Server) -> None:
    """Sandboxes outlive ``space serve`` by design; its stop says how many keep running (and the
    gateway), and how to stop them, and the next start adopts them."""
    srv = fresh_server
    srv.start()
    with srv.client() as api:
        sid = create_sandbox(api)
    srv.stop()
    left = [json.loads(line) for line in srv.log_tail(20000).splitlines() if '"serve.left_running"' in line]
    assert len(left) == 1, srv.log_tail()
    assert left[0]["sandboxes"] == 1 and left[0]["warm"] == 0, left
    assert f"space node teardown --data-dir {srv.data_dir.resolve()}" in left[0]["message"], left
    assert "egress gateway" in left[0]["message"], left
    srv.start()
    with srv.client() as api:
        assert run(api, sid, {"cmd": ["true"]})[0] == 0
        api.delete(f"/v1/sandboxes/{sid}")
