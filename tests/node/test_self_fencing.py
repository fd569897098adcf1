"""A node's fencing lease (space.node.sandboxes.fencing) runs from the arrival of a heartbeat whose
answer the control plane acknowledged, never from one it may not have seen answered:

- no acknowledged heartbeat yet: no lease, nothing is ever fenced
- a heartbeat that arrived but was never acknowledged renews nothing (a one-way partition)
- past the lease every running or paused sandbox is fenced once; a new acknowledgement stops it
- an agent restarted while cut off keeps the lease it had (the last renewal is on disk)
- the lease's end is published for the shims on CLOCK_BOOTTIME at each renewal, and removed when
  there is no lease; sandboxes whose shims froze them are fenced at the next watch round

The sandbox manager is a stand-in (the seam: which sandboxes are asked to fence); the real freeze
is exercised by the cluster's node-loss scenario.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from space.node.sandboxes.fencing import Fence
from tests.waiting import until

pytestmark = pytest.mark.anyio


@dataclasses.dataclass
class Box:
    id: str
    status: str = "running"
    fenced: bool = False


class Manager:
    def __init__(self, *boxes: Box) -> None:
        self.boxes = list(boxes)
        self.asked: list[str] = []
        #: Sandboxes whose shim froze them (the seam: the driver's fence marks).
        self.marked: list[str] = []

    def list(self) -> list[Box]:
        return self.boxes

    async def take_fence_marks(self) -> list[str]:
        marked, self.marked = self.marked, []
        for sid in marked:
            await self.fence(sid)
        return marked

    async def fence(self, sandbox_id: str) -> Box:
        self.asked.append(sandbox_id)
        box = next(b for b in self.boxes if b.id == sandbox_id)
        box.fenced, box.status = True, "paused"
        return box


def _fence(manager: Manager, lease: float | None = 5.0, state: Path | None = None,
           lease_file: Path | None = None) -> Fence:
    return Fence(manager, lease=lease, state_file=state, lease_file=lease_file)  # type: ignore[arg-type]


async def test_without_an_acknowledged_heartbeat_there_is_no_lease_to_lose() -> None:
    f = _fence(Manager(Box("a")))
    f.heartbeat(1, None)
    f.heartbeat(2, 99)  # acknowledges a heartbeat this node never saw
    assert f.renewed is None and not f.expired(time.monotonic() + 3600)


async def test_the_lease_runs_from_the_arrival_of_the_acknowledged_heartbeat() -> None:
    f = _fence(Manager(Box("a")))
    f.heartbeat(1, None)
    arrived = f._arrivals[1]
    f.heartbeat(2, None)  # arrived, but its answer may never have reached the control plane
    f.heartbeat(3, 1)
    assert f.renewed == arrived
    assert not f.expired(arrived + 4.9) and f.expired(arrived + 5.1)


async def test_past_the_lease_every_live_sandbox_is_fenced_once() -> None:
    m = Manager(Box("run"), Box("pause", status="paused"), Box("dead", status="dead"))
    f = _fence(m, lease=0.01)
    f.heartbeat(1, None)
    f.heartbeat(2, 1)
    await until_expired(f)
    assert sorted(await f.fence_all()) == ["pause", "run"]
    assert await f.fence_all() == []
    assert m.asked == ["run", "pause"]
    assert f.status()["fenced"] == ["pause", "run"]


async def test_a_restarted_agent_keeps_the_lease_it_had(tmp_path: Path) -> None:
    state = tmp_path / "lease.json"
    f = _fence(Manager(), lease=30, state=state)
    f.heartbeat(1, None)
    f.heartbeat(2, 1)
    assert state.exists()
    again = _fence(Manager(), lease=30, state=state)
    assert again.renewed is not None and abs(again.renewed - f.renewed) < 0.5  # type: ignore[operator]
    never = _fence(Manager(), lease=30, state=tmp_path / "missing.json")
    assert never.renewed is None


async def until_expired(f: Fence) -> None:
    await until(f.expired, 5, "the lease to run out")


async def test_the_lease_end_is_published_for_the_shims_and_withdrawn_without_a_lease(tmp_path: Path) -> None:
    published = tmp_path / "lease-end"
    f = _fence(Manager(), lease=30, lease_file=published)
    assert not published.exists()  # no acknowledged heartbeat: no lease to publish
    f.heartbeat(1, None)
    f.heartbeat(2, 1)
    end = float(published.read_text())
    assert f.renewed is not None
    expected = time.clock_gettime(time.CLOCK_BOOTTIME) - (time.monotonic() - f.renewed) + 30
    assert abs(end - expected) < 0.1
    f.heartbeat(3, 2)  # renewed later: a later end
    assert float(published.read_text()) >= end
    _fence(Manager(), lease=None, lease_file=published)  # restarted without a lease: no shim may fence
    assert not published.exists()


async def test_sandboxes_their_shims_froze_are_fenced_at_the_next_round() -> None:
    m = Manager(Box("frozen-by-shim"), Box("other"))
    m.marked = ["frozen-by-shim"]
    f = _fence(m, lease=30)
    task = asyncio.create_task(f.watch(every=0.01))
    try:
        await until(lambda: m.asked == ["frozen-by-shim"], 5, "the marked sandbox to be fenced")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert f.status()["fenced"] == ["frozen-by-shim"] and f.fenced_at is not None
