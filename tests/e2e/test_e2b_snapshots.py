"""The official E2B SDK's snapshot API against SPACE: create, list (filters, pages), create sandboxes
from a snapshot, delete — on SPACE's retained snapshots.

Mirrors E2B's ``packages/python-sdk/tests/sync/sandbox_sync/test_snapshot_api.py``; beyond it, the
snapshot outlives its sandbox, brings back running processes, and the async client.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e import e2b_env
from tests.e2e.harness import runtime_available

if TYPE_CHECKING:
    from e2b import Sandbox, SnapshotInfo

pytestmark = [pytest.mark.runtime, pytest.mark.skipif(runtime_available() is not None,
                                                      reason=str(runtime_available()))]

e2b = pytest.importorskip("e2b")


class Snapshots:
    """Every snapshot a test makes, deleted at teardown whatever happened."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def add(self, info: SnapshotInfo) -> SnapshotInfo:
        self.ids.append(info.snapshot_id)
        return info

    def delete_all(self) -> None:
        for sid in self.ids:
            # Already gone is fine; anything else shows in the server log.
            with contextlib.suppress(Exception):
                e2b.Sandbox.delete_snapshot(sid)


@pytest.fixture
def snaps(made: e2b_env.Sandboxes) -> Iterator[Snapshots]:
    got = Snapshots()
    try:
        yield got
    finally:
        got.delete_all()


@pytest.fixture
def sandbox(made: e2b_env.Sandboxes) -> Sandbox:
    s: Sandbox = e2b.Sandbox.create(timeout=300)
    made.add(s.sandbox_id)
    return s


def _from(made: e2b_env.Sandboxes, snapshot_id: str) -> Sandbox:
    s: Sandbox = e2b.Sandbox.create(snapshot_id, timeout=300)
    made.add(s.sandbox_id)
    return s


def test_list_snapshots_rejects_both_filters(made: e2b_env.Sandboxes) -> None:
    # Newer SDKs refuse it themselves (ValueError); 2.63.0 asks, and the server refuses (400).
    with pytest.raises((ValueError, e2b.SandboxException)):
        e2b.Sandbox.list_snapshots(sandbox_id="sandbox-id", name="my-snapshot").next_items()


def test_create_snapshot_and_the_class_method(sandbox: Sandbox, snaps: Snapshots) -> None:
    snap = snaps.add(sandbox.create_snapshot())
    assert snap.snapshot_id.startswith("snap-")
    assert snap.names == [snap.snapshot_id]
    other = snaps.add(e2b.Sandbox.create_snapshot(sandbox.sandbox_id))
    assert other.snapshot_id not in ("", snap.snapshot_id)
    # The sandbox keeps running.
    assert sandbox.commands.run("echo still").stdout == "still\n"


def test_create_named_snapshot(sandbox: Sandbox, snaps: Snapshots) -> None:
    name = f"snap-{uuid.uuid4().hex[:8]}"
    snap = snaps.add(sandbox.create_snapshot(name=name))
    assert snap.snapshot_id
    assert any(name in n for n in snap.names)


def test_sandboxes_from_a_snapshot_have_its_files_and_are_independent(
        made: e2b_env.Sandboxes, sandbox: Sandbox, snaps: Snapshots) -> None:
    sandbox.files.make_dir("/home/user/app")
    sandbox.files.write("/home/user/app/config.json", '{"env": "test"}')
    sandbox.files.write("/home/user/shared.txt", "shared snapshot content")
    snap = snaps.add(sandbox.create_snapshot())
    one, two = _from(made, snap.snapshot_id), _from(made, snap.snapshot_id)
    assert one.files.exists("/home/user/app")
    assert one.files.read("/home/user/app/config.json") == '{"env": "test"}'
    assert one.files.read("/home/user/shared.txt") == "shared snapshot content"
    assert two.files.read("/home/user/shared.txt") == "shared snapshot content"
    one.files.write("/home/user/shared.txt", "modified in sandbox1")
    assert one.files.read("/home/user/shared.txt") == "modified in sandbox1"
    assert two.files.read("/home/user/shared.txt") == "shared snapshot content"
    assert sandbox.files.read("/home/user/shared.txt") == "shared snapshot content"


def test_a_snapshot_outlives_its_sandbox_with_its_processes(
        made: e2b_env.Sandboxes, sandbox: Sandbox, snaps: Snapshots, api: httpx.Client) -> None:
    sandbox.commands.run("sleep 600", background=True)
    sandbox.files.write("/home/user/left.txt", "left behind")
    snap = snaps.add(sandbox.create_snapshot())
    assert sandbox.kill() is True
    child = _from(made, snap.snapshot_id)
    assert child.files.read("/home/user/left.txt") == "left behind"
    # A full snapshot: the process the first sandbox started runs in the new one.
    procs = child.commands.run('for p in /proc/[0-9]*; do tr "\\0" " " < $p/cmdline; echo; done').stdout
    assert "sleep 600" in procs, procs
    assert api.get(f"/v1/sandboxes/{child.sandbox_id}").json()["source_snapshot"] == snap.snapshot_id


def test_list_snapshots_all_by_sandbox_by_name_and_pages(sandbox: Sandbox, snaps: Snapshots) -> None:
    name = f"snap-filter-{uuid.uuid4().hex[:8]}"
    named = snaps.add(sandbox.create_snapshot(name=name))
    plain = snaps.add(sandbox.create_snapshot(mode="filesystem"))
    paginator = e2b.Sandbox.list_snapshots()
    assert paginator.has_next
    found = paginator.next_items()
    assert isinstance(found, list)
    assert {named.snapshot_id, plain.snapshot_id} <= {s.snapshot_id for s in found}
    mine = sandbox.list_snapshots().next_items()  # type: ignore[misc]  # the SDK's dual method
    assert {s.snapshot_id for s in mine} == {named.snapshot_id, plain.snapshot_id}
    assert [s.snapshot_id for s in e2b.Sandbox.list_snapshots(name=name).next_items()] == [named.snapshot_id]
    assert e2b.Sandbox.list_snapshots(name=f"{name}-does-not-exist").next_items() == []
    # One per page, newest first, until X-Next-Token runs out.
    pages = e2b.Sandbox.list_snapshots(sandbox_id=sandbox.sandbox_id, limit=1)
    seen = []
    while pages.has_next:
        seen += [s.snapshot_id for s in pages.next_items()]
    assert seen == [plain.snapshot_id, named.snapshot_id]


def test_delete_snapshot(sandbox: Sandbox, snaps: Snapshots) -> None:
    snap = snaps.add(sandbox.create_snapshot(mode="filesystem"))
    assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is False
    assert snap.snapshot_id not in {s.snapshot_id for s in e2b.Sandbox.list_snapshots().next_items()}
    with pytest.raises(e2b.SandboxException):
        e2b.Sandbox.create(snap.snapshot_id)


async def test_async_snapshot_api(made: e2b_env.Sandboxes, snaps: Snapshots) -> None:
    s = await e2b.AsyncSandbox.create(timeout=300)
    made.add(s.sandbox_id)
    await s.files.write("/home/user/a.txt", "async")
    snap = snaps.add(await s.create_snapshot(name=f"async-{uuid.uuid4().hex[:8]}"))
    child = await e2b.AsyncSandbox.create(snap.snapshot_id, timeout=300)
    made.add(child.sandbox_id)
    assert await child.files.read("/home/user/a.txt") == "async"
    listed = await e2b.AsyncSandbox.list_snapshots(sandbox_id=s.sandbox_id).next_items()
    assert [x.snapshot_id for x in listed] == [snap.snapshot_id]
    assert await e2b.AsyncSandbox.delete_snapshot(snap.snapshot_id) is True
    assert await e2b.AsyncSandbox.delete_snapshot(snap.snapshot_id) is False
