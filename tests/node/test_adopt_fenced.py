"""A restarted node agent adopts its sandboxes without letting a fenced one run (the seam: the
runtime driver, recorded; the sandboxes' state files are real files under a pool directory):

- a sandbox the agent had fenced stays frozen and fenced, never thawed
- a sandbox whose shim froze it while no agent ran (its fence mark) is adopted fenced, from what it
  was, and never thawed; the mark is consumed
- an ordinary running sandbox is thawed as before (a claim cut short must not stay frozen); a warm
  one's mark is consumed without a fence (it has no owner, so no copy elsewhere)
- later marks (the agent was only stopped) fence at the next watch round; a fenced sandbox is
  neither snapshotted, rolled back nor rebooted, and unfencing thaws it
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from space.errors import InvalidState
from space.node.sandboxes.manager import STATE_FILE, LocalSandbox, SandboxManager

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Driver:
    """Answers like runsc for the instances it is given; records freezes and thaws."""

    def __init__(self, live: dict[str, str], marked: set[str]) -> None:
        self.live, self.marked = live, marked
        self.calls: list[tuple[str, str]] = []

    async def list_instances(self) -> dict[str, str]:
        return dict(self.live)

    async def state(self, instance_id: str) -> str | None:
        return self.live.get(instance_id)

    def take_fence_mark(self, workdir: Path) -> bool:
        if workdir.name in self.marked:
            self.marked.discard(workdir.name)
            return True
        return False

    def freeze(self, instance_id: str) -> None:
        self.calls.append(("freeze", instance_id))

    def thaw(self, instance_id: str) -> None:
        self.calls.append(("thaw", instance_id))

    def set_cpu_shares(self, instance_id: str, shares: int) -> None:
        pass

    async def resume(self, instance_id: str) -> None:
        self.calls.append(("resume", instance_id))

    async def sweep(self, keep: set[str]) -> list[str]:
        return []


class Pool:
    def __init__(self, root: Path) -> None:
        self.root = root

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.root / "sandboxes" / sandbox_id


def _sandbox(pool: Pool, sid: str, **fields: Any) -> None:
    d = pool.sandbox_dir(sid)
    d.mkdir(parents=True)
    sb = LocalSandbox(id=sid, template="base", template_digest="d", cpu=1.0, memory_mb=256, env={}, user=None,
                      instance_id=f"i-{sid}", **{"status": "running", **fields})
    (d / STATE_FILE).write_text(json.dumps(dataclasses.asdict(sb)))


async def _manager(tmp_path: Path, driver: Driver) -> SandboxManager:
    pool = Pool(tmp_path / "pool")
    for sid, fields in (("agent-fenced", {"fenced": True, "fenced_from": "running", "status": "paused"}),
                        ("shim-fenced", {}), ("plain", {}), ("warm", {"warm": True})):
        _sandbox(pool, sid, **fields)
    m = SandboxManager(pool, None, driver, guest_dir=tmp_path, channel_dir=tmp_path / "ch")  # type: ignore[arg-type]
    await m.recover()
    return m


async def test_a_restarted_agent_never_thaws_a_fenced_sandbox(tmp_path: Path) -> None:
    driver = Driver({"i-agent-fenced": "running", "i-shim-fenced": "running", "i-plain": "running",
                     "i-warm": "running"}, marked={"i-shim-fenced", "i-warm"})
    m = await _manager(tmp_path, driver)
    for sid in ("agent-fenced", "shim-fenced"):
        sb = m.get(sid)
        assert (sb.fenced, sb.fenced_from, sb.status) == (True, "running", "paused"), sb
        assert ("thaw", f"i-{sid}") not in driver.calls and ("freeze", f"i-{sid}") in driver.calls
        on_disk = json.loads((m.pool.sandbox_dir(sid) / STATE_FILE).read_text())
        assert on_disk["fenced"] is True  # a second restart still knows
    assert ("thaw", "i-plain") in driver.calls and m.get("plain").status == "running"
    # A warm sandbox has no copy elsewhere: its mark is consumed, it is not fenced.
    assert not m.get_warm("warm").fenced  # type: ignore[union-attr]
    assert driver.marked == set()


async def test_marks_found_later_fence_and_a_fenced_sandbox_does_nothing_until_released(tmp_path: Path) -> None:
    driver = Driver({"i-agent-fenced": "running", "i-shim-fenced": "running", "i-plain": "running",
                     "i-warm": "running"}, marked=set())
    m = await _manager(tmp_path, driver)
    assert not m.get("shim-fenced").fenced
    driver.marked |= {"i-shim-fenced", "i-warm"}  # their shims froze them while this agent was stopped
    assert await m.take_fence_marks() == ["shim-fenced"]
    assert driver.marked == set()
    assert await m.take_fence_marks() == []
    assert m.get("shim-fenced").fenced and m.get("shim-fenced").status == "paused"
    for action in (lambda: m.take_snapshot("shim-fenced", "snap1", "full"),
                   lambda: m.rollback("shim-fenced", "snap1"),
                   lambda: m.reboot("shim-fenced")):
        with pytest.raises(InvalidState, match="fenced") as err:
            await action()
        assert err.value.details["state"] == "fenced"
    with pytest.raises(InvalidState, match="fenced"):
        await m.resume("shim-fenced")
    driver.calls.clear()
    sb = await m.unfence("shim-fenced")
    assert (sb.fenced, sb.status) == (False, "running")
    assert driver.calls == [("thaw", "i-shim-fenced")]  # runsc never paused it: no runsc resume
