"""Faults that must not lose data: the node agent dying mid-upload, a corrupted or missing artifact
in object storage, a full pool."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import Server, create_sandbox, own_server, run, wait_for
from tests.e2e.harness import wait_operation as wait_op
from tests.e2e.test_lifecycle import act, count, sh, start_counter, state

pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def crashy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A server whose node agent dies (like SIGKILL) the first time it is about to commit an upload."""
    tmp = tmp_path_factory.mktemp("crashy")
    with own_server(tmp, start=False) as srv:
        # In the server's scratch directory: the node agent (the node user) must be able to write it.
        marker = srv.data_dir.parent / "crashed"
        srv.env["SPACE_FAILPOINTS"] = f"artifacts.before_manifest=crash-once:{marker}"
        srv.start()
        yield srv, marker


def test_node_agent_killed_during_upload_never_makes_the_snapshot_restorable(
        crashy: tuple[Server, Path]) -> None:
    srv, marker = crashy
    with srv.client() as api:
        sid = create_sandbox(api)
        start_counter(api, sid)
        sh(api, sid, "echo before > /home/user/f")
        r = api.post(f"/v1/sandboxes/{sid}/suspend")
        assert r.status_code == 202, r.text
        op_id = r.json()["operation"]["id"]
        wait_for(marker.exists, 120, "the node agent to die mid-upload")
        # Every artifact may be up, but not the manifest: not restorable, the sandbox not suspended.
        sb = api.get(f"/v1/sandboxes/{sid}").json()
        snaps = api.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]
        assert sb["state"] == "suspending" and not any(s["restorable"] for s in snaps), (sb, snaps)
        objects = srv.data_dir / "objects" / "tenants" / "default" / "sandboxes" / sid
        assert not list(objects.rglob("manifest.json"))
        # The serve restarts its node agent; the operation is retried and converges.
        op = wait_op(api, op_id, timeout=300)
        assert op["status"] == "succeeded", op
        assert state(api, sid) == "suspended"
        assert list(objects.rglob("manifest.json"))
        act(api, sid, "restore")
        assert sh(api, sid, "cat /home/user/f") == "before\n"
        n = count(api, sid)
        wait_for(lambda: count(api, sid) > n, 30, "the counter to continue after the restore")
        api.delete(f"/v1/sandboxes/{sid}")


def _artifact(srv: Server, sid: str, snap: str, name: str) -> Path:
    return srv.data_dir / "objects" / "tenants" / "default" / "sandboxes" / sid / "snapshots" / snap / name


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_a_damaged_artifact_fails_the_restore_and_the_sandbox_stays_suspended(
        api: httpx.Client, server: Server, damage: str) -> None:
    sid = create_sandbox(api)
    act(api, sid, "suspend")
    snap = api.get(f"/v1/sandboxes/{sid}").json()["snapshot_id"]
    image = next(p for p in _artifact(server, sid, snap, "checkpoint").iterdir())
    if damage == "corrupt":
        data = bytearray(image.read_bytes())
        data[len(data) // 2] ^= 0xFF
        image.write_bytes(bytes(data))
    else:
        image.unlink()
    r = api.post(f"/v1/sandboxes/{sid}/restore")
    assert r.status_code == 202, r.text
    op = wait_op(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "failed"
    assert op["error"]["code"] == "snapshot_corrupt" and snap in op["error"]["message"], op["error"]
    sb = api.get(f"/v1/sandboxes/{sid}").json()
    assert sb["state"] == "suspended" and sb["node_id"] is None, sb
    assert snap in sb["error"]["message"]
    # Nothing half-restored is left on the node.
    pool = server.data_dir / "pool" / "sandboxes" / sid
    assert not pool.exists(), list(pool.rglob("*"))[:10]
    api.delete(f"/v1/sandboxes/{sid}")


def test_a_full_pool_fails_snapshots_clearly_and_sandboxes_keep_running(tmp_path: Path) -> None:
    with own_server(tmp_path, "--pool-size-gb", "1") as srv, srv.client() as api:
        sid = create_sandbox(api)
        # From inside, the sandbox's own disk limit says no before the pool is full (the pool keeps
        # a reserve no sandbox reaches: tests/security/test_quota_probes.py) ...
        _, _, err = run(api, sid, {"shell": "dd if=/dev/zero of=/home/user/fill bs=1M status=none; sync"})
        assert b"Disk quota exceeded" in err, err
        # ... so the rest of the pool is filled from the host, as many sandboxes together would.
        host_fill = srv.data_dir / "pool" / "host-fill"
        done = subprocess.run(["dd", "if=/dev/zero", f"of={host_fill}", "bs=1M", "status=none"],
                              capture_output=True, check=False)
        subprocess.run(["sync"], check=True)
        assert b"No space left" in done.stderr, done.stderr
        for kind in ("disk", "full"):
            r = api.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": kind})
            assert r.status_code == 202, r.text
            op = wait_op(api, r.json()["operation"]["id"])
            assert op["status"] == "failed", op
            assert op["error"]["code"] == "insufficient_storage", op["error"]
            assert "running sandboxes are unaffected" in op["error"]["message"], op["error"]
        listed = api.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]
        assert all(s["status"] == "failed" and not s["restorable"] for s in listed), listed
        assert state(api, sid) == "running"
        assert sh(api, sid, "rm /home/user/fill && echo alive") == "alive\n"
        host_fill.unlink()
        r = api.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "disk"})
        op = wait_op(api, r.json()["operation"]["id"])
        assert op["status"] == "succeeded", op["error"]  # room again: snapshots work again
        api.delete(f"/v1/sandboxes/{sid}")
