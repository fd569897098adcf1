"""The sandbox manager: the node's live truth about every sandbox it holds.

A sandbox on a node is a directory ``sandboxes/<id>/`` in the btrfs pool with ``rootfs`` (a writable
snapshot of the template), ``state.json`` (what this node promised) and one runtime instance. Every
method is idempotent so that a control plane that crashed mid-call can simply call again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import structlog

from space import ids
from space.errors import InvalidState, NotFound, RuntimeFailure, SpaceError, Unavailable
from space.node.guest_client import GuestConnection
from space.node.pool import Pool
from space.node.templates import TemplateStore
from space.runtime.base import InstanceSpec, RuntimeDriver

log = structlog.get_logger("space.node.sandboxes")

STATE_FILE = "state.json"


@dataclasses.dataclass
class LocalSandbox:
    id: str
    template: str
    template_digest: str
    cpu: float
    memory_mb: int
    env: dict[str, str]
    user: str | None
    instance_id: str | None = None
    channel: str | None = None
    #: starting | running | dead | stopping
    status: str = "starting"
    created_at: float = dataclasses.field(default_factory=time.time)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Why the instance died (status "dead"): "oom", "exited" or None while alive.
    death: str | None = None

    def public(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SandboxManager:
    def __init__(
        self,
        pool: Pool,
        templates: TemplateStore,
        driver: RuntimeDriver,
        *,
        guest_dir: Path,
        channel_dir: Path,
        guest_timeout: float = 15.0,
    ) -> None:
        self.pool = pool
        self.templates = templates
        self.driver = driver
        self.guest_dir = guest_dir
        self.channel_dir = channel_dir
        self.guest_timeout = guest_timeout
        self._sandboxes: dict[str, LocalSandbox] = {}
        self._guests: dict[str, GuestConnection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        channel_dir.mkdir(parents=True, exist_ok=True)

    # -- bookkeeping -------------------------------------------------------------------------

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _dir(self, sandbox_id: str) -> Path:
        return self.pool.sandbox_dir(sandbox_id)

    def _save(self, sb: LocalSandbox) -> None:
        d = self._dir(sb.id)
        tmp = d / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(sb.public()))
        os.replace(tmp, d / STATE_FILE)

    def _workdir(self, sb: LocalSandbox) -> Path:
        assert sb.instance_id
        return self._dir(sb.id) / "instances" / sb.instance_id

    def list(self) -> list[LocalSandbox]:
        return list(self._sandboxes.values())

    def get(self, sandbox_id: str) -> LocalSandbox:
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise NotFound(f"sandbox {sandbox_id} is not on this node", sandbox_id=sandbox_id)
        return sb

    # -- recovery ----------------------------------------------------------------------------

    async def recover(self) -> None:
        """Rebuild the live picture after a (re)start: adopt running instances, reap orphans."""
        instances = await self.driver.list_instances()
        known: set[str] = set()
        root = self.pool.root / "sandboxes"
        for d in sorted(root.iterdir()) if root.exists() else []:
            try:
                raw = json.loads((d / STATE_FILE).read_text())
                fields = {f.name for f in dataclasses.fields(LocalSandbox)}
                sb = LocalSandbox(**{k: v for k, v in raw.items() if k in fields})
            except (OSError, ValueError, TypeError):
                log.warning("sandbox.unreadable_state", dir=str(d))
                continue
            if sb.instance_id and instances.get(sb.instance_id) in ("running", "created", "paused"):
                known.add(sb.instance_id)
                sb.status = "running" if sb.status != "stopping" else "stopping"
            elif sb.status != "stopping":
                sb.status = "dead"
            self._sandboxes[sb.id] = sb
            log.info("sandbox.recovered", sandbox=sb.id, status=sb.status, instance=sb.instance_id)
        for inst in instances:
            if inst not in known:
                log.warning("instance.orphan_removed", instance=inst)
                await self.driver.stop(inst, self.channel_dir)

    # -- lifecycle ---------------------------------------------------------------------------

    async def create(
        self,
        sandbox_id: str,
        *,
        template: str,
        cpu: float,
        memory_mb: int,
        env: dict[str, str] | None = None,
    ) -> LocalSandbox:
        async with self._lock(sandbox_id):
            existing = self._sandboxes.get(sandbox_id)
            if existing is not None and existing.status == "running":
                try:
                    await self.guest(sandbox_id)
                    return existing
                except SpaceError:
                    log.warning("sandbox.create_retry_unhealthy", sandbox=sandbox_id)
            if existing is not None:
                await self._destroy(existing)

            t0 = time.perf_counter()
            info = await self.templates.get(template)
            if info is None:
                raise NotFound(f"template {template!r} is not on this node", template=template)
            d = self._dir(sandbox_id)
            d.mkdir(parents=True, exist_ok=True)
            sb = LocalSandbox(
                id=sandbox_id,
                template=template,
                template_digest=info.digest,
                cpu=cpu,
                memory_mb=memory_mb,
                env=dict(env or {}),
                user=_template_user(info),
                instance_id=ids.instance_id(sandbox_id),
            )
            self._sandboxes[sandbox_id] = sb
            self._save(sb)
            rootfs = d / "rootfs"
            if not await self.pool.is_subvolume(rootfs):
                await self.pool.snapshot(info.path, rootfs)
            t1 = time.perf_counter()
            try:
                handle = await self.driver.start(
                    InstanceSpec(
                        sandbox_id=sandbox_id,
                        instance_id=sb.instance_id or "",
                        rootfs=rootfs,
                        workdir=self._workdir(sb),
                        guest_dir=self.guest_dir,
                        channel_dir=self.channel_dir,
                        cpu=cpu,
                        memory_mb=memory_mb,
                        hostname=sandbox_id[:12],
                    )
                )
                t2 = time.perf_counter()
                sb.channel = str(handle.channel)
                conn = await GuestConnection.connect(str(handle.channel), timeout=self.guest_timeout)
                self._guests[sandbox_id] = conn
            except BaseException:
                sb.status = "dead"
                self._save(sb)
                raise
            t3 = time.perf_counter()
            sb.status = "running"
            sb.timings = {
                "snapshot_ms": round((t1 - t0) * 1000, 2),
                "runtime_start_ms": round((t2 - t1) * 1000, 2),
                "guest_ready_ms": round((t3 - t2) * 1000, 2),
                "guest_boot_ms": float(conn.hello.get("boot_ms", 0.0)),
            }
            self._save(sb)
            log.info("sandbox.created", sandbox=sandbox_id, **sb.timings)
            return sb

    async def delete(self, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            sb = self._sandboxes.get(sandbox_id)
            if sb is None:
                # Not in memory: maybe a leftover directory from a crash mid-create.
                await self.pool.delete_subvolume(self._dir(sandbox_id))
                return
            await self._destroy(sb)
            self._sandboxes.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)

    async def _destroy(self, sb: LocalSandbox) -> None:
        sb.status = "stopping"
        with contextlib.suppress(OSError):
            self._save(sb)
        conn = self._guests.pop(sb.id, None)
        if conn is not None:
            await conn.close()
        if sb.instance_id:
            await self.driver.stop(sb.instance_id, self._workdir(sb))
        await self.pool.delete_subvolume(self._dir(sb.id))
        log.info("sandbox.destroyed", sandbox=sb.id)

    async def close(self) -> None:
        for conn in list(self._guests.values()):
            await conn.close()
        self._guests.clear()

    # -- the guest channel --------------------------------------------------------------------

    async def guest(self, sandbox_id: str) -> GuestConnection:
        """The live channel to the sandbox's guest daemon, reconnecting through the shim if needed."""
        sb = self.get(sandbox_id)
        if sb.status == "dead":
            raise dead_error(sb)
        if sb.status != "running":
            raise InvalidState(
                f"sandbox {sandbox_id} is {sb.status} on its node",
                state=sb.status,
                allowed=["delete"],
            )
        conn = self._guests.get(sandbox_id)
        if conn is not None and not conn.closed:
            return conn
        if not sb.channel:
            raise Unavailable(f"sandbox {sandbox_id} has no guest channel")
        # A dropped channel usually means the instance died: ask the runtime before waiting.
        await self.check_alive(sb)
        if not os.path.exists(sb.channel):  # noqa: ASYNC240 -- one stat; the shim left, the guest's stdout closed
            await self.check_alive(sb, settle=3.0)
            raise Unavailable(f"sandbox {sb.id}'s guest channel is gone")
        try:
            conn = await GuestConnection.connect(sb.channel, timeout=self.guest_timeout)
        except SpaceError:
            await self.check_alive(sb, settle=3.0)
            raise
        self._guests[sandbox_id] = conn
        return conn

    async def check_alive(self, sb: LocalSandbox, *, settle: float = 0.0) -> None:
        """Raise (and remember) a dead-sandbox error if the runtime instance is no longer running.

        ``settle``: the guest channel drops a moment before the runtime reports the instance
        stopped; a caller that just lost the channel waits up to this long for the verdict.
        """
        if sb.status == "dead":
            raise dead_error(sb)
        if not sb.instance_id:
            return
        deadline = time.monotonic() + settle
        while True:
            state = await self.driver.state(sb.instance_id)
            if state not in ("running", "created", "paused"):
                break
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.1)
        sb.status = "dead"
        sb.death = await self.driver.death_cause(sb.instance_id) or "exited"
        self._save(sb)
        conn = self._guests.pop(sb.id, None)
        if conn is not None:
            await conn.close()
        log.warning("sandbox.died", sandbox=sb.id, instance=sb.instance_id, cause=sb.death)
        raise dead_error(sb)

    async def activity(self, sandbox_id: str) -> dict[str, Any]:
        conn = await self.guest(sandbox_id)
        return await conn.request("activity")



def dead_error(sb: LocalSandbox) -> RuntimeFailure:
    """The error every call on a dead sandbox gets; ``sandbox_dead`` lets the control plane record it."""
    if sb.death == "oom":
        why = f"ran out of memory (limit {sb.memory_mb} MiB) and was killed"
    else:
        why = "stopped: its runtime instance exited"
    return RuntimeFailure(f"sandbox {sb.id} {why}", sandbox_dead=True, cause=sb.death or "exited")


def _template_user(info: Any) -> str | None:
    spec = getattr(info, "spec", None) or {}
    user = spec.get("user") if isinstance(spec, dict) else None
    return str(user) if user else None
