"""The stateful lifecycle through the public API, on real runsc and btrfs: pause/resume, disk and
full snapshots, rollback, fork, suspend/restore through object storage, crash recovery."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
from typing import Any

import httpx
import pytest

from tests.e2e.harness import COUNTER, Server, count, create_sandbox, read_events, sh, wait_for, wait_operation

pytestmark = pytest.mark.runtime


def act(api: httpx.Client, sid: str, action: str, body: dict[str, Any] | None = None,
        timeout: float = 300) -> dict[str, Any]:
    r = api.post(f"/v1/sandboxes/{sid}/{action}", json=body)
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=timeout)
    assert op["status"] == "succeeded", op["error"]
    return {**r.json(), "operation": op}


def snapshot(api: httpx.Client, sid: str, kind: str) -> str:
    r = api.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": kind})
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"])
    assert op["status"] == "succeeded", op
    return str(op["result"]["snapshot"])


def state(api: httpx.Client, sid: str) -> str:
    return str(api.get(f"/v1/sandboxes/{sid}").json()["state"])


def start_counter(api: httpx.Client, sid: str) -> str:
    r = api.post(f"/v1/sandboxes/{sid}/commands", json={"shell": COUNTER})
    assert r.status_code == 201, r.text
    wait_for(lambda: count(api, sid) > 3, 30, "the counter to count")
    return str(r.json()["id"])


def test_pause_freezes_and_resume_continues_from_memory(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    start_counter(api, sid)
    act(api, sid, "pause")
    assert state(api, sid) == "paused"
    paused = api.get(f"/v1/sandboxes/{sid}").json()
    assert "resume" in paused["allowed_actions"] and "pause" not in paused["allowed_actions"]
    # Pausing twice is a conflict that names the state.
    again = api.post(f"/v1/sandboxes/{sid}/pause")
    assert again.status_code == 409 and again.json()["error"]["state"] == "paused"
    act(api, sid, "resume")
    first = count(api, sid)
    wait_for(lambda: count(api, sid) > first + 3, 30, "the counter to continue")
    # It continued from memory (the shell variable), not from zero.
    assert count(api, sid) > first
    api.delete(f"/v1/sandboxes/{sid}")


def test_a_pause_is_done_when_its_request_answers_and_a_full_snapshot_of_it_keeps_its_memory(
        api: httpx.Client) -> None:
    """The replica that accepts a pause carries it out (the freezer alone): the answer already
    says succeeded. A full snapshot of the frozen sandbox needs its runtime to hold it instead;
    resuming after that continues from memory, and so does a rollback to that snapshot."""
    sid = create_sandbox(api)
    cid = start_counter(api, sid)
    r = api.post(f"/v1/sandboxes/{sid}/pause")
    assert r.status_code == 202, r.text
    assert r.json()["operation"]["status"] == "succeeded" and r.json()["sandbox"]["state"] == "paused", r.json()
    snap = snapshot(api, sid, "full")
    assert state(api, sid) == "paused"
    act(api, sid, "resume")
    first = count(api, sid)
    wait_for(lambda: count(api, sid) > first + 3, 30, "the counter to continue after the snapshot")
    assert api.post(f"/v1/sandboxes/{sid}/commands/{cid}/signal", json={"signal": "KILL"}).status_code == 204
    sh(api, sid, "rm -f /tmp/count")
    act(api, sid, "rollback", {"snapshot": snap})
    wait_for(lambda: count(api, sid) > 0, 30, "the counter to run again")
    assert count(api, sid) >= first - 20, first
    api.delete(f"/v1/sandboxes/{sid}")


def test_an_api_call_to_a_paused_sandbox_resumes_it(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    act(api, sid, "pause")
    assert sh(api, sid, "echo awake") == "awake\n"
    assert state(api, sid) == "running"
    api.delete(f"/v1/sandboxes/{sid}")


def test_disk_snapshot_rollback_brings_files_back(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    sh(api, sid, "mkdir -p /home/user/project && echo precious > /home/user/project/a.txt")
    snap = snapshot(api, sid, "disk")
    listed = api.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]
    assert [(s["id"], s["kind"], s["restorable"]) for s in listed] == [(snap, "disk", True)]
    sh(api, sid, "rm -rf /home/user/project")
    act(api, sid, "rollback", {"snapshot": snap})
    assert sh(api, sid, "cat /home/user/project/a.txt") == "precious\n"
    events = api.get(f"/v1/sandboxes/{sid}/events").json()["events"]
    assert events[-1]["kind"] == "rolled_back"
    api.delete(f"/v1/sandboxes/{sid}")


def test_full_snapshot_rollback_brings_processes_back(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    cid = start_counter(api, sid)
    snap = snapshot(api, sid, "full")
    at_snapshot = count(api, sid)
    assert api.post(f"/v1/sandboxes/{sid}/commands/{cid}/signal", json={"signal": "KILL"}).status_code == 204
    wait_for(lambda: api.get(f"/v1/sandboxes/{sid}/commands/{cid}").json()["state"] != "running", 30,
             "the counter to die")
    sh(api, sid, "rm -f /tmp/count")
    act(api, sid, "rollback", {"snapshot": snap})
    # The counter is running again, from the value it had in memory at the snapshot.
    wait_for(lambda: count(api, sid) > 0, 30, "the counter to run again")
    n = count(api, sid)
    assert at_snapshot - 20 <= n, (at_snapshot, n)
    cmds = api.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]
    assert any(c["id"] == cid and c["state"] == "running" for c in cmds), cmds
    api.delete(f"/v1/sandboxes/{sid}")


def test_fork_copies_files_and_processes_then_diverges(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    start_counter(api, sid)
    sh(api, sid, "echo origin > /home/user/who")
    r = api.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2})
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "succeeded", op
    forks = op["result"]["sandbox_ids"]
    assert len(forks) == 2 and sid not in forks
    for i, f in enumerate(forks):
        assert state(api, f) == "running"
        assert sh(api, f, "cat /home/user/who") == "origin\n"
        start = count(api, f)

        def moved(f: str = f, start: int = start) -> bool:
            return count(api, f) > start

        wait_for(moved, 30, "the fork's counter to continue")
        sh(api, f, f"echo fork{i} > /home/user/who")
    # Each diverged on its own; the source kept running and kept its file.
    assert sh(api, sid, "cat /home/user/who") == "origin\n"
    assert [sh(api, f, "cat /home/user/who") for f in forks] == ["fork0\n", "fork1\n"]
    src_before = count(api, sid)
    wait_for(lambda: count(api, sid) > src_before, 30, "the source to keep running")
    for f in [*forks, sid]:
        api.delete(f"/v1/sandboxes/{f}")


def test_suspend_uploads_then_restore_brings_files_and_processes_back(api: httpx.Client, server: Server) -> None:
    sid = create_sandbox(api)
    start_counter(api, sid)
    sh(api, sid, "head -c 1000000 /dev/urandom > /home/user/blob && sha256sum /home/user/blob > /home/user/sum")
    act(api, sid, "suspend")
    sb = api.get(f"/v1/sandboxes/{sid}").json()
    assert sb["state"] == "suspended" and sb["node_id"] is None and sb["snapshot_id"]
    snap = api.get(f"/v1/snapshots/{sb['snapshot_id']}").json()
    assert snap["restorable"] and snap["location"] == ["object_store"]
    manifest = server.data_dir / "objects" / f"tenants/default/sandboxes/{sid}/snapshots/{snap['id']}/manifest.json"
    assert manifest.exists(), list((server.data_dir / "objects").rglob("*"))[:20]
    doc = json.loads(manifest.read_text())
    assert doc["format"] == 2 and doc["mac"]["alg"] == "hmac-sha256", doc  # sealed with the deployment's key
    names = {a["name"] for a in doc["body"]["artifacts"]}
    assert "rootfs.btrfs.zst" in names and any(n.startswith("checkpoint/") for n in names)
    act(api, sid, "restore")
    assert state(api, sid) == "running"
    assert sh(api, sid, "sha256sum -c /home/user/sum").strip().endswith("OK")
    before = count(api, sid)
    wait_for(lambda: count(api, sid) > before, 30, "the restored counter to continue")
    api.delete(f"/v1/sandboxes/{sid}")


def test_suspend_without_memory_keeps_files_and_boots_afresh(api: httpx.Client, server: Server) -> None:
    sid = create_sandbox(api)
    start_counter(api, sid)
    sh(api, sid, "echo kept > /home/user/kept")
    boot = sh(api, sid, "cat /proc/sys/kernel/random/boot_id")
    act(api, sid, "suspend", {"memory": False})
    sb = api.get(f"/v1/sandboxes/{sid}").json()
    assert sb["state"] == "suspended"
    snap = api.get(f"/v1/snapshots/{sb['snapshot_id']}").json()
    assert snap["kind"] == "disk" and snap["restorable"]
    manifest = server.data_dir / "objects" / f"tenants/default/sandboxes/{sid}/snapshots/{snap['id']}/manifest.json"
    names = {a["name"] for a in json.loads(manifest.read_text())["body"]["artifacts"]}
    assert "rootfs.btrfs.zst" in names and not any(n.startswith("checkpoint/") for n in names)
    act(api, sid, "restore")
    assert sh(api, sid, "cat /home/user/kept") == "kept\n"
    assert sh(api, sid, "cat /proc/sys/kernel/random/boot_id") != boot  # booted, not resumed
    assert "sleep" not in sh(api, sid, "ps -eo args")  # the counter's processes are gone
    api.delete(f"/v1/sandboxes/{sid}")


def test_a_call_to_a_suspended_sandbox_restores_it(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    act(api, sid, "suspend")
    assert sh(api, sid, "echo back") == "back\n"
    assert state(api, sid) == "running"
    api.delete(f"/v1/sandboxes/{sid}")


def _kill_runtime(server: Server, sid: str) -> None:
    """SIGKILL the sandbox's gVisor kernel (the runsc sandbox process)."""
    inst = None
    root = server.data_dir / "runsc"
    out = subprocess.run(["runsc", f"--root={root}", "list", "--format=json"], capture_output=True,
                         text=True, check=True).stdout
    for item in json.loads(out) or []:
        if item["id"].startswith(sid):
            inst = item
    assert inst is not None, out
    os.kill(int(inst["pid"]), signal.SIGKILL)


def test_a_killed_runtime_is_recovered_from_the_latest_full_checkpoint(api: httpx.Client, server: Server) -> None:
    sid = create_sandbox(api)
    cid = start_counter(api, sid)
    snap = snapshot(api, sid, "full")
    _kill_runtime(server, sid)
    wait_for(lambda: any(e["kind"] == "recovered" for e in api.get(f"/v1/sandboxes/{sid}/events").json()["events"]),
             60, "the sandbox to be recovered")
    ev = [e for e in api.get(f"/v1/sandboxes/{sid}/events").json()["events"] if e["kind"] == "recovered"][-1]
    assert snap in ev["message"] and "full checkpoint" in ev["message"]
    wait_for(lambda: state(api, sid) == "running", 30, "running again")
    cmds = api.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]
    assert any(c["id"] == cid and c["state"] == "running" for c in cmds), cmds
    api.delete(f"/v1/sandboxes/{sid}")


def test_a_killed_runtime_without_checkpoint_boots_from_the_disk_snapshot(api: httpx.Client, server: Server) -> None:
    sid = create_sandbox(api)
    sh(api, sid, "echo kept > /home/user/f")
    snap = snapshot(api, sid, "disk")
    sh(api, sid, "echo lost > /home/user/f")
    _kill_runtime(server, sid)
    wait_for(lambda: any(e["kind"] == "recovered" for e in api.get(f"/v1/sandboxes/{sid}/events").json()["events"]),
             60, "the sandbox to be recovered")
    ev = [e for e in api.get(f"/v1/sandboxes/{sid}/events").json()["events"] if e["kind"] == "recovered"][-1]
    assert snap in ev["message"] and "disk snapshot" in ev["message"] and "restarted" in ev["message"]
    wait_for(lambda: state(api, sid) == "running", 30, "running again")
    assert sh(api, sid, "cat /home/user/f") == "kept\n"
    api.delete(f"/v1/sandboxes/{sid}")


def events_of(api: httpx.Client, sid: str) -> list[dict[str, Any]]:
    return list(api.get(f"/v1/sandboxes/{sid}/events").json()["events"])


def test_an_idle_sandbox_is_paused_and_a_call_resumes_it(api: httpx.Client) -> None:
    sid = create_sandbox(api, idle_pause_s=3)
    wait_for(lambda: state(api, sid) == "paused", 60, "the idle sandbox to be paused")
    assert any(e["kind"] == "idle" for e in events_of(api, sid))
    assert sh(api, sid, "echo hello") == "hello\n"  # resumed transparently
    assert state(api, sid) == "running"
    api.delete(f"/v1/sandboxes/{sid}")


def test_a_running_command_keeps_a_sandbox_from_idling(api: httpx.Client) -> None:
    busy = create_sandbox(api, idle_pause_s=2)
    r = api.post(f"/v1/sandboxes/{busy}/commands", json={"shell": "sleep 600"})
    assert r.status_code == 201
    # A twin with the same limit, created later and doing nothing: once the policy has paused it,
    # the busy one has been past its own limit for at least as long.
    idle = create_sandbox(api, idle_pause_s=2)
    wait_for(lambda: state(api, idle) == "paused", 60, "the idle twin to be paused")
    assert state(api, busy) == "running"
    assert not any(e["kind"] == "idle" for e in events_of(api, busy))
    for sid in (busy, idle):
        api.delete(f"/v1/sandboxes/{sid}")


def test_an_idle_sandbox_is_suspended_and_a_call_restores_it(api: httpx.Client) -> None:
    sid = create_sandbox(api, idle_suspend_s=4)
    sh(api, sid, "echo persisted > /home/user/f")
    wait_for(lambda: state(api, sid) == "suspended", 90, "the idle sandbox to be suspended")
    assert sh(api, sid, "cat /home/user/f") == "persisted\n"  # restored transparently
    assert state(api, sid) == "running"
    kinds = [e["kind"] for e in events_of(api, sid)]
    assert "suspended" in kinds and "restored" in kinds, kinds
    api.delete(f"/v1/sandboxes/{sid}")


def test_scheduled_snapshots_are_taken_and_pruned_by_retention(api: httpx.Client) -> None:
    policy = {"disk_every": "10s", "full_every": None, "retention": [{"within": "15s", "every": 0}]}
    sid = create_sandbox(api, snapshot_policy=policy)
    assert api.get(f"/v1/sandboxes/{sid}").json()["snapshot_policy"]["disk_every"] == 10

    def scheduled() -> list[dict[str, Any]]:
        snaps = api.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]
        return [s for s in snaps if s["origin"] == "schedule" and s["status"] == "ready"]

    def oldest() -> str | None:
        found = scheduled()
        return str(found[0]["id"]) if found else None

    first = wait_for(oldest, 60, "a scheduled snapshot")
    # Older than the only tier (15 s) and no longer the newest: retention removes it.
    wait_for(lambda: first not in {s["id"] for s in scheduled()} and scheduled(), 90,
             "the first scheduled snapshot to be pruned")
    api.delete(f"/v1/sandboxes/{sid}")


def test_a_bad_snapshot_policy_is_a_clear_400(api: httpx.Client) -> None:
    r = api.post("/v1/sandboxes", json={"template": "base", "snapshot_policy": {"disk_every": "1s"}})
    assert r.status_code == 400 and "disk_every" in r.json()["error"]["message"], r.text


def test_a_command_stream_survives_pause_and_resume_and_reattaches(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    prog = "for i in $(seq 1 40); do echo line$i; sleep 0.1; done"
    cid = api.post(f"/v1/sandboxes/{sid}/commands", json={"shell": prog}).json()["id"]
    first = read_events(api, sid, cid, limit=5)
    last_id = first[-1]["id"]
    act(api, sid, "pause")
    act(api, sid, "resume")
    rest = read_events(api, sid, cid, headers={"last-event-id": last_id})
    ids = [int(e["id"]) for e in first + rest]
    assert ids == list(range(ids[0], ids[0] + len(ids))), ids  # no gap, no repeat
    text = b"".join(base64.b64decode(e["data"]["data"]) for e in first + rest if e["event"] == "stdout")
    assert text.decode().split() == [f"line{i}" for i in range(1, 41)]
    assert rest[-1]["event"] == "exit" and rest[-1]["data"]["exit_code"] == 0
    api.delete(f"/v1/sandboxes/{sid}")


def test_a_sandbox_with_a_lifetime_is_deleted_when_it_runs_out(api: httpx.Client) -> None:
    sid = create_sandbox(api, lifetime_s=3)
    assert api.get(f"/v1/sandboxes/{sid}").json()["expires_at"]
    wait_for(lambda: state(api, sid) == "terminated", 60, "the sandbox to reach its lifetime")
    assert any(e["kind"] == "expired" for e in events_of(api, sid))


def test_manual_snapshots_travel_with_a_suspended_sandbox(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    sh(api, sid, "echo v1 > /home/user/f")
    disk = snapshot(api, sid, "disk")
    sh(api, sid, "echo v2 > /home/user/f")
    act(api, sid, "suspend")
    listed = {s["id"]: s for s in api.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]}
    assert listed[disk]["restorable"] and listed[disk]["location"] == ["object_store"], listed[disk]
    act(api, sid, "restore")
    assert sh(api, sid, "cat /home/user/f") == "v2\n"
    act(api, sid, "rollback", {"snapshot": disk})
    assert sh(api, sid, "cat /home/user/f") == "v1\n"
    api.delete(f"/v1/sandboxes/{sid}")


def test_patch_changes_policies_and_refuses_bad_input(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    r = api.patch(f"/v1/sandboxes/{sid}", json={"snapshot_policy": {"full_every": "10s"}})
    assert r.status_code == 400 and "full_every" in r.json()["error"]["message"], r.text
    assert api.patch(f"/v1/sandboxes/{sid}", json={"idle_pause_s": 0}).status_code == 422
    # A lifetime counts from now: a short one ends the sandbox.
    r = api.patch(f"/v1/sandboxes/{sid}", json={"lifetime_s": 2})
    assert r.status_code == 200 and r.json()["expires_at"], r.text
    wait_for(lambda: state(api, sid) == "terminated", 60, "the new lifetime to end the sandbox")
    gone = api.patch(f"/v1/sandboxes/{sid}", json={"idle_pause_s": 60})
    assert gone.status_code == 409 and gone.json()["error"]["state"] == "terminated", gone.text
