"""The SDK's lifecycle methods against a real server (real runsc and btrfs), sync and async.

Aspects: ``create`` sends the idle, lifetime and snapshot-policy settings; pause/resume round-trip
and update the handle's state; a refused action raises ``InvalidState`` naming the state, a missing
snapshot ``NotFound``; ``snapshot()`` returns a typed ``Snapshot`` (disk, or full with ``memory``),
also without waiting; ``snapshots()``, ``rollback``, ``delete_snapshot``; ``events()`` as typed
``SandboxEvent`` with an ``after`` cursor; ``fork`` from a snapshot returns running handles;
``suspend`` then ``restore``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from space import AsyncClient, Client
from space.errors import InvalidState, NotFound
from space.sdk import AsyncSandbox, SandboxEvent, Snapshot
from tests.e2e.harness import Server
from tests.waiting import wait_for

pytestmark = pytest.mark.runtime

POLICY = {"disk_every": 600, "full_every": "1h",
          "retention": [{"within": "1h", "every": 0}, {"within": "24h", "every": "1h"}]}


# Named apart from the fake-API ``client`` / ``aclient`` of this directory's conftest.
@pytest.fixture
def live(server: Server) -> Iterator[Client]:
    with Client(server.url, server.admin_key) as c:
        yield c


@pytest.fixture
async def alive(server: Server) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(server.url, server.admin_key) as c:
        yield c


async def _delete_with_forks(client: AsyncClient, sb: AsyncSandbox) -> None:
    """The sandbox and every fork of it, also those a failed fork left behind."""
    for s in await client.sandboxes.list():
        if s.info.get("parent_id") == sb.id:
            await s.delete()
    await sb.delete()


def test_pause_snapshots_rollback_and_events(live: Client) -> None:
    sb = live.sandboxes.create("base", idle_pause=600, idle_suspend=7200, lifetime=3600,
                                 snapshot_policy=POLICY)
    try:
        assert (sb.info["idle_pause_s"], sb.info["idle_suspend_s"]) == (600, 7200) and sb.info["expires_at"]
        assert sb.info["snapshot_policy"] == {
            "disk_every": 600, "full_every": 3600,
            "retention": [{"within": 3600, "every": 0}, {"within": 86400, "every": 3600}]}

        op = sb.pause()
        assert op.kind == "sandbox.pause" and op.status == "succeeded" and sb.state == "paused"
        with pytest.raises(InvalidState) as refused:
            sb.pause()
        assert refused.value.state == "paused" and "resume" in refused.value.allowed
        sb.resume()
        assert sb.state == "running"

        sb.files.write("/home/user/keep.txt", b"v1")
        disk = sb.snapshot()
        assert isinstance(disk, Snapshot) and disk.kind == "disk" and disk.sandbox_id == sb.id
        assert disk.status == "ready" and disk.restorable and disk.created_at
        full = sb.snapshot(memory=True)
        assert full.kind == "full" and full.restorable
        listed = {s.id: s for s in sb.snapshots()}
        assert listed[disk.id].kind == "disk" and listed[full.id].kind == "full"

        sb.files.write("/home/user/keep.txt", b"v2")
        sb.rollback(disk.id)
        assert sb.state == "running" and sb.files.read("/home/user/keep.txt") == b"v1"
        with pytest.raises(NotFound):
            sb.rollback("snap-doesnotexist00000")

        sb.delete_snapshot(full.id)
        assert full.id not in {s.id for s in sb.snapshots()}

        # Without waiting, the handle still names the snapshot being taken.
        pending = sb.snapshot(wait=False)
        assert pending.kind == "disk" and pending.id not in (disk.id, full.id)
        assert sb.operation is not None
        assert live.operations.wait(sb.operation.id).status == "succeeded"
        assert wait_for(lambda: sb.get_snapshot(pending.id).restorable, 60, "the snapshot to be ready")

        events = sb.events()
        assert all(isinstance(e, SandboxEvent) for e in events)
        kinds = [e.kind for e in events]
        assert kinds.index("paused") < kinds.index("resumed") < kinds.index("rolled_back"), kinds
        assert [e.id for e in events] == sorted(e.id for e in events)
        assert sb.events(after=events[-2].id) == events[-1:]
    finally:
        sb.delete()


async def test_async_fork_suspend_and_restore(alive: AsyncClient) -> None:
    sb = await alive.sandboxes.create("base")
    try:
        await sb.files.write("/home/user/who", b"origin")
        snap = await sb.snapshot(memory=True)
        forks = await sb.fork(snapshot=snap.id, count=1)
        [child] = forks
        assert child.state == "running" and child.id != sb.id
        assert (child.info["parent_id"], child.info["source_snapshot"]) == (sb.id, snap.id)
        assert await child.files.read("/home/user/who") == b"origin"
        await child.delete()

        await sb.suspend()
        assert sb.state == "suspended" and sb.info["snapshot_id"]
        with pytest.raises(InvalidState) as refused:
            await sb.pause()
        assert refused.value.state == "suspended" and "restore" in refused.value.allowed
        await sb.restore()
        assert sb.state == "running"
        assert await sb.files.read("/home/user/who") == b"origin"
    finally:
        await _delete_with_forks(alive, sb)


def test_update_sets_keeps_and_clears(live: Client) -> None:
    sb = live.sandboxes.create("base", idle_pause=600, lifetime=3600)
    try:
        sb.update(idle_suspend=7200)  # what is left out stays
        assert (sb.info["idle_pause_s"], sb.info["idle_suspend_s"]) == (600, 7200) and sb.info["expires_at"]
        sb.update(idle_pause=None, lifetime=None, metadata={"team": "a"})  # None turns it off
        fresh = live.sandboxes.get(sb.id).info
        assert (fresh["idle_pause_s"], fresh["expires_at"], fresh["metadata"]) == (None, None, {"team": "a"})
    finally:
        sb.delete()
