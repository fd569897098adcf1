"""A node's fencing lease (space.node.sandboxes.fencing) runs from the arrival of a heartbeat whose
answer the control plane acknowledged, never from one it may not have seen answered:

- no acknowledged heartbeat yet: no lease, nothing is ever fenced
- a heartbeat that arrived but was never acknowledged renews nothing (a one-way partition)
- past the lease every running or paused sandbox is fenced once; a new acknowledgement stops it
- an agent restarted while cut off keeps the lease it had (the last renewal is on disk)

The sandbox manager is a stand-in (the seam: which sandboxes are asked to fence); the real freeze
is exercised by the cluster's node-loss scenario.
"""

from __future__ import annotations

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

    def list(self) -> list[Box]:
        return self.boxes

    async def fence(self, sandbox_id: str) -> Box:
        self.asked.append(sandbox_id)
        box = next(b for b in self.boxes if b.id == sandbox_id)
        box.fenced, box.status = True, "paused"
        return box


def _fence(manager: Manager, lease: float = 5.0, state: Path | None = None) -> Fence:
    return Fence(manager, lease=lease, state_file=state)  # type: ignore[arg-type]


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
