"""The warm pool: sandboxes booted ahead of demand, so that a create only has to claim one.

For each *key* (template, cpu, memory) the control plane asks for, the node keeps ``size`` sandboxes
booted from the template's newest digest, each on its own writable snapshot with its guest daemon
connected. They wait frozen (cgroup freezer: no CPU at all) and at a low CPU weight, except the
next one to be claimed, which waits thawed so that no create pays for waking a sentry. A create
claims that one (:meth:`WarmPool.claim`): the sandbox gets its owner's env and becomes visible —
nothing else has to happen on the hot path. A refill loop boots
replacements in the background, one at a time, so that refilling never takes both cores from the
sandboxes that are already working.

Safety rules, each enforced in one place:

- A warm sandbox is unreachable until claimed (:meth:`SandboxManager.get` does not see it), and a
  claimed one never comes back (``warm`` is cleared on disk before the claim answers). So a pool
  never hands out a sandbox anyone has used.
- The targets are persisted next to the pool, so a restarted node refills before the control plane
  calls again; warm sandboxes found running after a restart are adopted, others are removed.
- A template rebuilt under a new digest drains the old warm sandboxes: they would hand out the old
  files.
- The pool's memory is bounded: the sum of ``size * memory_mb`` over all keys is at most
  :data:`MEMORY_BUDGET` of the node's memory; sizes beyond it are clamped and reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Final

import structlog

from space import ids
from space.errors import InvalidRequest, PoolEmpty, SpaceError
from space.node.capacity import node_capacity
from space.node.sandboxes.manager import LocalSandbox, SandboxManager

log = structlog.get_logger("space.node.sandboxes.warm")

#: Fraction of the node's memory that warm sandboxes' limits may add up to.
MEMORY_BUDGET: Final = 0.5
#: Largest size one key may ask for, whatever the memory.
MAX_SIZE: Final = 64
#: Backoff after a failed boot, doubling up to the maximum (a broken template must not spin).
BACKOFF_START: Final = 1.0
BACKOFF_MAX: Final = 60.0
#: A refill waits until claims pause this long (a burst of creates claims without boots competing
#: for the CPU and the node agent's loop), but never defers more than REFILL_MAX_DEFER under a
#: steady stream of claims.
REFILL_QUIET: Final = 0.25
REFILL_MAX_DEFER: Final = 1.0


@dataclasses.dataclass(frozen=True, order=True)
class PoolKey:
    template: str
    cpu: float
    memory_mb: int

    @property
    def label(self) -> str:
        return f"{self.template}/{self.cpu:g}cpu/{self.memory_mb}MiB"


@dataclasses.dataclass
class _KeyState:
    size: int = 0
    #: What the budget allows of ``size``.
    effective: int = 0
    ready: deque[str] = dataclasses.field(default_factory=deque)
    #: The next to be claimed (``ready[0]``), kept thawed; the others wait frozen.
    hot: str | None = None
    booting: int = 0
    claimed: int = 0
    booted: int = 0
    failures: int = 0
    last_error: str | None = None
    retry_at: float = 0.0
    backoff: float = BACKOFF_START
    boot_ms: deque[float] = dataclasses.field(default_factory=lambda: deque(maxlen=20))


def node_memory_mb() -> int:
    """The memory this node may give sandboxes: its cgroup's limit, at most the machine's."""
    return node_capacity().memory_mb


class WarmPool:
    def __init__(
        self,
        manager: SandboxManager,
        state_file: Path,
        *,
        memory_mb: int | None = None,
        concurrency: int = 1,
    ) -> None:
        self.manager = manager
        self.state_file = state_file
        self.memory_mb = memory_mb if memory_mb is not None else node_memory_mb()
        self.concurrency = max(1, concurrency)
        self._keys: dict[PoolKey, _KeyState] = {}
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_claim = 0.0
        #: When the current run of deferrals began (None: not deferring).
        self._deferring_since: float | None = None
        self._load()

    # -- targets -------------------------------------------------------------------------------

    @property
    def budget_mb(self) -> int:
        return int(self.memory_mb * MEMORY_BUDGET)

    def set_targets(self, targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Replace every target (keys left out go to 0 and are drained); returns :meth:`status`."""
        wanted: dict[PoolKey, int] = {}
        for t in targets:
            try:
                key = PoolKey(str(t["template"]), float(t["cpu"]), int(t["memory_mb"]))
                size = int(t["size"])
            except (KeyError, TypeError, ValueError):
                raise InvalidRequest(f"a warm pool target needs template, cpu, memory_mb and size: {t!r}") from None
            if not 0 <= size <= MAX_SIZE:
                raise InvalidRequest(f"warm pool size must be between 0 and {MAX_SIZE}", size=size)
            wanted[key] = size
        for key in set(self._keys) | set(wanted):
            self._keys.setdefault(key, _KeyState()).size = wanted.get(key, 0)
        self._apply_budget()
        self._persist()
        self._wake.set()
        return self.status()

    def _apply_budget(self) -> None:
        """Clamp sizes so the pool's memory limits fit the budget (keys in a stable order)."""
        left = self.budget_mb
        for key in sorted(self._keys):
            st = self._keys[key]
            st.effective = max(0, min(st.size, left // key.memory_mb))
            left -= st.effective * key.memory_mb

    def _load(self) -> None:
        try:
            raw = json.loads(self.state_file.read_text())
            targets = raw.get("targets", [])
        except FileNotFoundError:
            return
        except (OSError, ValueError, AttributeError):
            log.warning("warm.unreadable_targets", file=str(self.state_file))
            return
        for t in targets:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                key = PoolKey(str(t["template"]), float(t["cpu"]), int(t["memory_mb"]))
                self._keys.setdefault(key, _KeyState()).size = int(t["size"])
        self._apply_budget()

    def _persist(self) -> None:
        targets = [{"template": k.template, "cpu": k.cpu, "memory_mb": k.memory_mb, "size": st.size}
                   for k, st in sorted(self._keys.items()) if st.size > 0]
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps({"targets": targets}))
        os.replace(tmp, self.state_file)

    def status(self) -> list[dict[str, Any]]:
        out = []
        for key, st in sorted(self._keys.items()):
            if st.size == 0 and not st.ready and not st.booting:
                continue
            boot = sorted(st.boot_ms)
            out.append({
                "template": key.template, "cpu": key.cpu, "memory_mb": key.memory_mb,
                "size": st.size, "effective_size": st.effective, "ready": len(st.ready),
                "booting": st.booting, "claimed": st.claimed, "booted": st.booted, "failures": st.failures,
                "last_error": st.last_error,
                "boot_ms_p50": round(boot[len(boot) // 2], 1) if boot else None,
            })
        return out

    # -- the hot path --------------------------------------------------------------------------

    def claim(self, key: PoolKey, env: dict[str, str]) -> LocalSandbox:
        """Hand out the oldest ready warm sandbox of ``key`` (no await: nothing can interleave)."""
        st = self._keys.get(key)
        while st is not None and st.ready:
            sid = st.ready.popleft()
            try:
                sb = self.manager.bind(sid, env)
            except SpaceError:
                continue  # died while waiting: the refill loop removes it
            st.claimed += 1
            st.hot = None
            self._last_claim = time.monotonic()
            self._wake.set()
            log.info("warm.claimed", sandbox=sid, key=key.label, ready=len(st.ready))
            return sb
        raise PoolEmpty(f"no warm sandbox of {key.label} is ready on this node", template=key.template)

    # -- refilling -----------------------------------------------------------------------------

    async def adopt(self) -> None:
        """After the manager's recovery: keep warm sandboxes that still run, remove the rest."""
        for sb in self.manager.list_all():
            if not sb.warm:
                continue
            key = PoolKey(sb.template, float(sb.cpu), int(sb.memory_mb))
            st = self._keys.get(key)
            if sb.status == "running" and st is not None and len(st.ready) < st.effective:
                st.ready.append(sb.id)
                self.manager.freeze_warm(sb.id)  # (idempotent: it may be frozen already)
                log.info("warm.adopted", sandbox=sb.id, key=key.label)
            else:
                await self._discard(sb.id, "not needed after restart")
        self.heat()

    async def run(self) -> None:
        """Keep every key at its size: boot what is missing, drain what is extra or stale."""
        while True:
            self._wake.clear()
            delay = 1.0
            try:
                delay = await self._step()
            except Exception:
                log.exception("warm.step_failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)

    async def _step(self) -> float:
        """One pass over the keys; returns how soon the next pass is due."""
        now = time.monotonic()
        quiet_in = self._last_claim + REFILL_QUIET - now
        if quiet_in > 0:
            self._deferring_since = self._deferring_since or now
            if now - self._deferring_since >= REFILL_MAX_DEFER:
                quiet_in = 0.0  # claims keep coming: refill anyway
        else:
            self._deferring_since = None
        delay = 1.0
        for key, st in list(self._keys.items()):
            info = await self.manager.templates.get(key.template)
            current = info.digest if info is not None else None
            # Drop the dead, the stale (template rebuilt) and the extra (size lowered).
            keep: deque[str] = deque()
            for sid in st.ready:
                sb = self.manager.get_warm(sid)
                if sb is None:
                    continue
                if sb.status != "running":
                    await self._discard(sid, f"instance {sb.status}")
                elif sb.template_digest != current:
                    await self._discard(sid, "template changed")
                elif len(keep) >= st.effective:
                    await self._discard(sid, "pool shrank")
                else:
                    keep.append(sid)
            st.ready = keep
            self._heat(st)
            if current is None or now < st.retry_at:
                continue
            if quiet_in > 0:
                delay = min(delay, quiet_in)
                continue
            missing = st.effective - len(st.ready) - st.booting
            while missing > 0 and len(self._tasks) < self.concurrency:
                st.booting += 1
                task = asyncio.create_task(self._boot(key, st))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                missing -= 1
            if st.size == 0 and not st.ready and not st.booting:
                del self._keys[key]
        return max(0.01, delay)

    async def _boot(self, key: PoolKey, st: _KeyState) -> None:
        sid = ids.sandbox_id()
        t0 = time.perf_counter()
        try:
            await self.manager.create(sid, template=key.template, cpu=key.cpu, memory_mb=key.memory_mb,
                                      disk_mb=self.manager.default_disk_mb,
                                      warm=True)
        except SpaceError as exc:
            st.failures += 1
            st.last_error = exc.message
            st.retry_at = time.monotonic() + st.backoff
            log.warning("warm.boot_failed", key=key.label, error=exc.message, retry_in=st.backoff)
            st.backoff = min(BACKOFF_MAX, st.backoff * 2)
            await self._discard(sid, "boot failed")
            return
        finally:
            st.booting -= 1
            self._wake.set()
        self.manager.freeze_warm(sid)
        st.backoff = BACKOFF_START
        st.last_error = None
        st.booted += 1
        st.boot_ms.append((time.perf_counter() - t0) * 1000)
        st.ready.append(sid)
        self._heat(st)
        log.info("warm.ready", sandbox=sid, key=key.label, ready=len(st.ready),
                 boot_ms=round(st.boot_ms[-1], 1))

    def heat(self) -> None:
        """Thaw the next sandbox to be claimed of every key (after a claim took the previous one)."""
        for st in self._keys.values():
            self._heat(st)

    def _heat(self, st: _KeyState) -> None:
        if st.ready and st.hot != st.ready[0]:
            st.hot = st.ready[0]
            self.manager.thaw_warm(st.hot)

    async def _discard(self, sandbox_id: str, why: str) -> None:
        log.info("warm.discarded", sandbox=sandbox_id, reason=why)
        with contextlib.suppress(SpaceError):
            await self.manager.delete(sandbox_id)

    async def close(self) -> None:
        """Stop refilling (warm sandboxes stay: the next start adopts them)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
