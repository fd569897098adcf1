"""The warm pool's bookkeeping, against a stand-in sandbox manager (the seam: real boots are covered
by tests/e2e/test_pool.py). Aspects: it fills to size one boot at a time; a claim hands out the
oldest ready sandbox once and sets the request's env; an empty pool says so; sizes are clamped to
the memory budget; a shrunk pool, a template rebuilt under a new digest and a dead sandbox are
drained; a failed boot backs off instead of spinning; targets survive a restart, and adoption keeps
running warm sandboxes up to size and removes the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from space.errors import InvalidRequest, NotFound, PoolEmpty, RuntimeFailure
from space.node.sandboxes.manager import LocalSandbox
from space.node.sandboxes.warm import BACKOFF_START, PoolKey, WarmPool
from tests.waiting import await_for as _await_for

pytestmark = pytest.mark.anyio

KEY = PoolKey("base", 1.0, 512)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclasses.dataclass
class FakeTemplate:
    digest: str


class FakeTemplates:
    def __init__(self) -> None:
        self.digest = "d1"

    async def get(self, name: str) -> FakeTemplate | None:
        return FakeTemplate(self.digest) if name == "base" else None


class FakeManager:
    """Just what WarmPool uses of SandboxManager, in memory."""

    def __init__(self) -> None:
        self.templates = FakeTemplates()
        self.sandboxes: dict[str, LocalSandbox] = {}
        self.deleted: list[str] = []
        self.frozen: set[str] = set()
        self.fail_boots = 0
        self.concurrent = 0
        self.max_concurrent = 0
        self.default_disk_mb: int | None = 1024

    async def create(self, sid: str, *, template: str, cpu: float, memory_mb: int, warm: bool,
                     disk_mb: int | None = None) -> LocalSandbox:
        self.concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            # A boot yields to the loop once, as a real one does (so overlapping boots would show).
            loop = asyncio.get_running_loop()
            turn = loop.create_future()
            loop.call_soon(turn.set_result, None)
            await turn
            if self.fail_boots:
                self.fail_boots -= 1
                raise RuntimeFailure("boot failed")
            sb = LocalSandbox(id=sid, template=template, template_digest=self.templates.digest, cpu=cpu,
                              memory_mb=memory_mb, env={}, user="user", instance_id=f"{sid}-i",
                              status="running", warm=warm, disk_mb=disk_mb)
            self.sandboxes[sid] = sb
            return sb
        finally:
            self.concurrent -= 1

    async def delete(self, sid: str) -> None:
        self.deleted.append(sid)
        self.sandboxes.pop(sid, None)

    def bind(self, sid: str, env: dict[str, str]) -> LocalSandbox:
        sb = self.sandboxes.get(sid)
        if sb is None or not sb.warm or sb.status != "running":
            raise NotFound("gone")
        sb.warm = False
        sb.env = dict(env)
        return sb

    def freeze_warm(self, sid: str) -> None:
        self.frozen.add(sid)

    def thaw_warm(self, sid: str) -> None:
        self.frozen.discard(sid)

    def get_warm(self, sid: str) -> LocalSandbox | None:
        sb = self.sandboxes.get(sid)
        return sb if sb is not None and sb.warm else None

    def list_all(self) -> list[LocalSandbox]:
        return list(self.sandboxes.values())

    def warm(self) -> list[str]:
        return [s.id for s in self.sandboxes.values() if s.warm]


def make(tmp_path: Path, manager: FakeManager, memory_mb: int = 8192) -> WarmPool:
    return WarmPool(manager, tmp_path / "warm.json", memory_mb=memory_mb)  # type: ignore[arg-type]


async def running(pool: WarmPool, fn: Any) -> None:
    task = asyncio.create_task(pool.run())
    try:
        await fn()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pool.close()


def target(size: int, **kw: Any) -> dict[str, Any]:
    return {"template": "base", "cpu": 1.0, "memory_mb": 512, "size": size, **kw}


async def test_fills_one_at_a_time_and_claims_oldest_once(tmp_path: Path) -> None:
    m = FakeManager()
    pool = make(tmp_path, m)
    pool.set_targets([target(3)])

    async def check() -> None:
        await await_for(lambda: _ready(pool, 3), 10, "3 ready")
        assert m.max_concurrent == 1
        # Waiting costs no CPU, but for the next one to be claimed: it waits thawed.
        head, *rest = pool._keys[KEY].ready
        assert head not in m.frozen and set(rest) <= m.frozen
        order = list(pool._keys[KEY].ready)
        sb = pool.claim(KEY, {"A": "1"})
        assert sb.id == order[0] and not sb.warm and sb.env == {"A": "1"}
        assert sb.disk_mb == m.default_disk_mb  # warm ones boot with the node's default disk limit
        # Refilled, and the claimed one never comes back.
        await await_for(lambda: _ready(pool, 3), 10, "refill")
        assert sb.id not in pool._keys[KEY].ready
        pool.heat()
        head, *rest = pool._keys[KEY].ready
        assert head not in m.frozen and set(rest) <= m.frozen
        with pytest.raises(PoolEmpty):
            pool.claim(PoolKey("base", 2.0, 512), {})

    await running(pool, check)


async def test_sizes_are_clamped_to_the_memory_budget(tmp_path: Path) -> None:
    pool = make(tmp_path, FakeManager(), memory_mb=4096)  # budget 2048 MiB
    status = pool.set_targets([target(10), target(1, memory_mb=1024)])
    by_mem = {s["memory_mb"]: s for s in status}
    assert by_mem[512]["effective_size"] == 4 and by_mem[512]["size"] == 10
    assert by_mem[1024]["effective_size"] == 0
    with pytest.raises(InvalidRequest):
        pool.set_targets([target(-1)])
    with pytest.raises(InvalidRequest):
        pool.set_targets([{"template": "base"}])


async def test_shrink_stale_digest_and_dead_are_drained(tmp_path: Path) -> None:
    m = FakeManager()
    pool = make(tmp_path, m)
    pool.set_targets([target(3)])

    async def check() -> None:
        await await_for(lambda: _ready(pool, 3), 10, "3 ready")
        pool.set_targets([target(1)])
        await await_for(lambda: len(m.warm()) == 1, 10, "shrunk to 1")
        old = m.warm()[0]
        m.templates.digest = "d2"  # the template was rebuilt
        pool._wake.set()
        await await_for(lambda: m.warm() and m.warm()[0] != old and _ready(pool, 1), 10, "replaced")
        assert all(s.template_digest == "d2" for s in m.sandboxes.values() if s.warm)
        victim = m.warm()[0]
        m.sandboxes[victim].status = "dead"
        pool._wake.set()
        await await_for(lambda: victim in m.deleted and _ready(pool, 1), 10, "dead one replaced")

    await running(pool, check)


async def test_a_failing_boot_backs_off(tmp_path: Path) -> None:
    m = FakeManager()
    m.fail_boots = 1000
    pool = make(tmp_path, m)
    pool.set_targets([target(1)])

    async def check() -> None:
        await await_for(lambda: pool.status()[0]["failures"] >= 2, 10, "two failures")
        st = pool.status()[0]
        assert st["last_error"] == "boot failed" and st["ready"] == 0
        # Each failure doubles the wait before the next boot of that key.
        state = pool._keys[KEY]
        assert state.backoff >= BACKOFF_START * 2 ** (st["failures"] - 1)
        assert state.retry_at > time.monotonic()

    await running(pool, check)


async def test_targets_persist_and_adoption_keeps_up_to_size(tmp_path: Path) -> None:
    m = FakeManager()
    first = make(tmp_path, m)
    first.set_targets([target(2)])
    for i in range(3):
        await m.create(f"s{i}", template="base", cpu=1.0, memory_mb=512, warm=True)
    m.sandboxes["s2"].status = "dead"
    await m.create("owned", template="base", cpu=1.0, memory_mb=512, warm=False)

    again = make(tmp_path, m)
    assert again.status()[0]["size"] == 2
    await again.adopt()
    assert sorted(again._keys[KEY].ready) == ["s0", "s1"]
    assert m.deleted == ["s2"] and "owned" in m.sandboxes


async def await_for(predicate: Any, timeout: float, what: str) -> None:
    async def check() -> bool:
        return bool(predicate())
    await _await_for(check, timeout, what)


def _ready(pool: WarmPool, n: int) -> bool:
    st = pool._keys.get(KEY)
    return st is not None and len(st.ready) >= n
