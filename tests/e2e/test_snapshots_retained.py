"""Retained snapshots through the public API, on real runsc, btrfs and the local object store: a
snapshot that outlives its sandbox, sandboxes created from a snapshot (files and running processes,
each independent), deleting one, and the plain snapshots that still die with their sandbox."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import COUNTER, Server, count, create_sandbox, sh, wait_for, wait_operation

pytestmark = pytest.mark.runtime


def counting(api: httpx.Client, sid: str) -> None:
    start = count(api, sid)
    wait_for(lambda: count(api, sid) > start, 30, f"the counter of {sid} to count")


def take(api: httpx.Client, sid: str, **body: Any) -> dict[str, Any]:
    r = api.post(f"/v1/sandboxes/{sid}/snapshots", json=body)
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "succeeded", op
    snap: dict[str, Any] = api.get(f"/v1/snapshots/{op['result']['snapshot']}").json()
    return snap


def delete_sandbox(api: httpx.Client, sid: str) -> None:
    r = api.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code == 202, r.text
    assert wait_operation(api, r.json()["operation"]["id"])["status"] == "succeeded"


def from_snapshot(api: httpx.Client, snap_id: str, **body: Any) -> dict[str, Any]:
    """A sandbox created from ``snap_id``, running."""
    r = api.post("/v1/sandboxes", json={"snapshot": snap_id, **body})
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "succeeded", op
    sb: dict[str, Any] = api.get(f"/v1/sandboxes/{r.json()['sandbox']['id']}").json()
    assert sb["state"] == "running", sb
    return sb


def objects(server: Server, prefix: str) -> list[Path]:
    root = server.data_dir / "objects" / prefix
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


@pytest.fixture(scope="module")
def orphan(api: httpx.Client) -> Iterator[dict[str, Any]]:
    """A retained full snapshot (a counter running, a file written) whose sandbox was deleted."""
    sid = create_sandbox(api)
    api.post(f"/v1/sandboxes/{sid}/commands", json={"shell": COUNTER}).raise_for_status()
    wait_for(lambda: count(api, sid) > 3, 30, "the counter to count")
    sh(api, sid, "echo kept > /home/user/kept")
    name = f"orphan-{uuid.uuid4().hex[:8]}"
    snap = take(api, sid, kind="full", retain=True, name=name)
    delete_sandbox(api, sid)
    yield {**snap, "source": sid, "name": name}
    api.delete(f"/v1/snapshots/{snap['id']}")


def test_a_retained_snapshot_outlives_its_sandbox(api: httpx.Client, server: Server,
                                                  orphan: dict[str, Any]) -> None:
    sid, snap_id = orphan["source"], orphan["id"]
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "terminated"
    snap = api.get(f"/v1/snapshots/{snap_id}").json()
    assert snap["retain"] is True and snap["name"] == orphan["name"] and snap["kind"] == "full"
    assert snap["status"] == "ready" and snap["restorable"]
    # Its node copy went with the sandbox; the uploaded one is outside the sandbox's prefix.
    assert snap["location"] == ["object_store"] and snap["node_id"] is None
    names = {p.name for p in objects(server, f"tenants/default/snapshots/{snap_id}")}
    assert {"manifest.json", "rootfs.btrfs.zst"} <= names, names
    assert objects(server, f"tenants/default/sandboxes/{sid}") == []
    # The tenant's listing finds it by name, by sandbox and among the retained ones.
    for query in ({"name": orphan["name"]}, {"sandbox_id": sid}, {"retained": "true"}):
        listed = api.get("/v1/snapshots", params=query).json()["snapshots"]
        assert snap_id in [s["id"] for s in listed], query
    assert api.get("/v1/snapshots", params={"name": orphan["name"], "retained": "false"}).json() == {"snapshots": []}


def test_a_sandbox_from_it_has_its_files_and_running_processes(api: httpx.Client, orphan: dict[str, Any]) -> None:
    sb = from_snapshot(api, orphan["id"], metadata={"from": "orphan"})
    try:
        assert sb["parent_id"] == orphan["source"] and sb["source_snapshot"] == orphan["id"]
        assert sb["template"] == "base" and sb["metadata"] == {"from": "orphan"}
        assert sh(api, sb["id"], "cat /home/user/kept") == "kept\n"
        # The counter was restored from memory: it goes on from where it was, not from zero.
        assert count(api, sb["id"]) > 3
        counting(api, sb["id"])
    finally:
        delete_sandbox(api, sb["id"])


def test_sandboxes_from_one_snapshot_are_independent(api: httpx.Client, orphan: dict[str, Any]) -> None:
    a, b = (from_snapshot(api, orphan["id"])["id"] for _ in range(2))
    try:
        sh(api, a, "echo changed > /home/user/kept && touch /home/user/only-a")
        assert sh(api, a, "cat /home/user/kept") == "changed\n"
        assert sh(api, b, "cat /home/user/kept; test -e /home/user/only-a || echo absent") == "kept\nabsent\n"
        counting(api, a)
        counting(api, b)
    finally:
        delete_sandbox(api, a)
        delete_sandbox(api, b)
    # Deleting them left the snapshot as it was.
    assert api.get(f"/v1/snapshots/{orphan['id']}").json()["restorable"]


def test_a_sandbox_from_a_live_sandboxs_plain_snapshot(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    try:
        sh(api, sid, "echo v1 > /home/user/f")
        snap = take(api, sid, kind="disk")
        assert snap["retain"] is False and snap["location"] == ["node"]
        # What the snapshot fixes cannot be asked for differently.
        for bad in ({"env": {"A": "b"}}, {"template": "other"}, {"memory_mb": 1024}):
            r = api.post("/v1/sandboxes", json={"snapshot": snap["id"], **bad})
            assert r.status_code == 400 and r.json()["error"]["field"] == next(iter(bad)), r.text
        assert api.post("/v1/sandboxes", json={"snapshot": "snap-unknown"}).status_code == 404
        sh(api, sid, "echo v2 > /home/user/f")
        child = from_snapshot(api, snap["id"])
        try:
            assert sh(api, child["id"], "cat /home/user/f") == "v1\n"
            assert sh(api, sid, "cat /home/user/f") == "v2\n"
        finally:
            delete_sandbox(api, child["id"])
    finally:
        delete_sandbox(api, sid)
    # Not retained: it went with its sandbox.
    assert api.get(f"/v1/snapshots/{snap['id']}").status_code == 404
    assert api.post("/v1/sandboxes", json={"snapshot": snap["id"]}).status_code == 404


def test_deleting_a_retained_snapshot_removes_its_objects_and_row(api: httpx.Client, server: Server) -> None:
    sid = create_sandbox(api)
    try:
        snap = take(api, sid, kind="disk", retain=True)
        assert sorted(snap["location"]) == ["node", "object_store"] and snap["restorable"]
        prefix = f"tenants/default/snapshots/{snap['id']}"
        assert objects(server, prefix)
        # A suspend moves the sandbox to object storage; the retained snapshot is there already.
        r = api.post(f"/v1/sandboxes/{sid}/suspend")
        assert wait_operation(api, r.json()["operation"]["id"], timeout=300)["status"] == "succeeded"
        assert api.get(f"/v1/snapshots/{snap['id']}").json()["location"] == ["object_store"]
        r = api.delete(f"/v1/snapshots/{snap['id']}")
        assert r.status_code == 202, r.text
        op = wait_operation(api, r.json()["operation"]["id"])
        assert op["status"] == "succeeded" and op["kind"] == "snapshot.delete", op
        assert api.get(f"/v1/snapshots/{snap['id']}").status_code == 404
        assert api.delete(f"/v1/snapshots/{snap['id']}").status_code == 404
        assert objects(server, prefix) == []
        assert snap["id"] not in [s["id"] for s in api.get("/v1/snapshots").json()["snapshots"]]
    finally:
        delete_sandbox(api, sid)
