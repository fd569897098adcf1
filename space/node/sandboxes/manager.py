"""The sandbox manager: the node's live truth about every sandbox it holds.

A sandbox on a node is a directory ``sandboxes/<id>/`` in the btrfs pool with ``rootfs`` (a writable
snapshot of the template), ``state.json`` (what this node promised) and one runtime instance. Every
method is idempotent so that a control plane that crashed mid-call can simply call again.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog

from space import ids
from space.errors import (
    InvalidState,
    KeyUnavailable,
    NotFound,
    RuntimeFailure,
    SnapshotCorrupt,
    SpaceError,
    Unavailable,
)
from space.kms import DataKeys, KeyRef
from space.node.network import port_proxy
from space.node.network.egress import Egress
from space.node.network.namespaces import SandboxNet
from space.node.sandboxes import startup
from space.node.sandboxes.backups import Backups
from space.node.sandboxes.guest_client import GuestConnection
from space.node.storage import backup_chain, shipping, snapshots
from space.node.storage.artifacts import (
    Manifest,
    Sealing,
    SealingSpec,
    read_manifest,
    rewrap_snapshot,
    snapshot_binding,
)
from space.node.storage.pool import Pool
from space.node.templates import objects as template_objects
from space.node.templates.store import TemplateStore, spec_digest
from space.objauth import ManifestKeys
from space.objstore import ObjectStore
from space.runtime.base import InstanceSpec, RuntimeDriver

log = structlog.get_logger("space.node.sandboxes.manager")

#: How many moved-away sandboxes a node remembers (for the ``moved`` event of their streams).
MAX_DEPARTED = 10_000

STATE_FILE = "state.json"
#: Deleted sandboxes' directories while their removal finishes in the background.
TRASH = "trash"
#: CPU weight of a warm-pool sandbox until it is claimed (1/16 of a claimed one): its boot and its
#: idle runtime yield to every sandbox in use, and to the node agent and API on the hot path.
WARM_CPU_SHARES = 64
#: Where a sandbox finds its own environment (JSON object), written by :meth:`SandboxManager.publish_env`.
SANDBOX_ENV_FILE = "/run/space/env.json"
DEFAULT_CPU_SHARES = 1024


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
    #: starting | running | paused | dead | stopping
    status: str = "starting"
    created_at: float = dataclasses.field(default_factory=time.time)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Why the instance died (status "dead"): "oom", "exited" or None while alive.
    death: str | None = None
    #: The last snapshot the root was reset to (rollback, fork, restore, recovery) and the caller's
    #: token for that request, so that a retried request is not applied twice.
    source_snapshot: str | None = None
    applied: str | None = None
    #: Its disk limit: MiB its root may write beyond the template it shares (None: no limit of its
    #: own, only the node's reserve). A property of the sandbox: every new root it gets (a
    #: rollback, a restore here or on another node, a fork of it) is born with it.
    disk_mb: int | None = None
    #: A warm-pool sandbox nobody has been given yet: invisible to the node API and the data
    #: plane until :meth:`SandboxManager.bind` hands it out (once; it never goes back).
    warm: bool = False
    #: When it was handed out from the warm pool (None: created for its owner directly).
    claimed_at: float | None = None
    #: Frozen by this node's self-fencing (:mod:`space.node.sandboxes.fencing`): only the control
    #: plane's ``unfence`` lets it run again (as ``fenced_from`` says), nothing else resumes it.
    fenced: bool = False
    fenced_from: str | None = None
    #: Paused by the cgroup freezer alone (:meth:`RuntimeDriver.hold`): resuming it is a thaw.
    #: False for one the runtime itself holds paused (a checkpoint needed its sentry), and for
    #: records of agents before this field, which paused through the runtime: resuming it is
    #: ``runsc resume`` as well.
    held: bool = False

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
        objects: ObjectStore | None = None,
        egress: Egress | None = None,
        default_disk_mb: int | None = None,
    ) -> None:
        self.pool = pool
        #: The disk limit of a sandbox whose creator names none (warm ones included), in MiB.
        self.default_disk_mb = default_disk_mb
        #: Network isolation and the egress gateway; None runs sandboxes with loopback only.
        self.egress = egress
        self.templates = templates
        self.driver = driver
        self.guest_dir = guest_dir
        self.channel_dir = channel_dir
        self.guest_timeout = guest_timeout
        self.objects = objects
        #: The data keys this node wraps and opens snapshots' keys with (None: no key providers,
        #: so an encrypted snapshot is refused with key_unavailable).
        self.data_keys: DataKeys | None = None
        self._sandboxes: dict[str, LocalSandbox] = {}
        self._guests: dict[str, GuestConnection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: Old instances being removed in the background (after a rollback or recovery).
        self._reaping: set[asyncio.Task[None]] = set()
        #: Template specs by digest (what a sandbox's template says about env, workdir, start).
        self._specs: dict[str, dict[str, Any]] = {}
        #: Sandboxes removed from here because they now run on another node: streams of theirs
        #: that end say so (``moved``) instead of reporting an error. Bounded: a hint, not a registry.
        self._departed: dict[str, str] = {}
        #: Sandboxes a delete is removing: a check of one that finds its instance gone records nothing
        #: (its directory is being moved away).
        self._deleting: set[str] = set()
        #: Continuous disk backup of the sandboxes the control plane configured (run by the agent).
        self.backups = Backups(self)
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
        """The sandboxes that belong to someone (warm-pool sandboxes are not listed)."""
        return [sb for sb in self._sandboxes.values() if not sb.warm]

    def list_all(self) -> builtins.list[LocalSandbox]:
        return list(self._sandboxes.values())

    def get(self, sandbox_id: str) -> LocalSandbox:
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.warm:
            # A warm sandbox has no owner yet: nobody may reach it, so none is ever handed out used.
            raise NotFound(f"sandbox {sandbox_id} is not on this node", sandbox_id=sandbox_id)
        return sb

    def get_warm(self, sandbox_id: str) -> LocalSandbox | None:
        sb = self._sandboxes.get(sandbox_id)
        return sb if sb is not None and sb.warm else None

    def bind(self, sandbox_id: str, env: dict[str, str]) -> LocalSandbox:
        """Hand a warm sandbox to its owner: it gets the request's env and becomes visible.

        The state file is written before this returns, so a node that crashes right after never
        puts it back in the pool.
        """
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or not sb.warm or sb.status != "running":
            raise NotFound(f"no ready warm sandbox {sandbox_id}", sandbox_id=sandbox_id)
        sb.warm = False
        sb.env = dict(env)
        sb.claimed_at = time.time()
        self._save(sb)
        return sb

    def activate(self, sandbox_id: str) -> None:
        """Wake a claimed warm sandbox: thawed, at the normal CPU weight (idempotent). Recovery does
        it too, for a node that stopped between a claim and this."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.warm and sb.instance_id and sb.status == "running":
            self.driver.thaw(sb.instance_id)
            self.driver.set_cpu_shares(sb.instance_id, DEFAULT_CPU_SHARES)

    def freeze_warm(self, sandbox_id: str) -> None:
        """Freeze a warm sandbox while it waits: it costs no CPU (:meth:`activate` thaws it)."""
        sb = self.get_warm(sandbox_id)
        if sb is not None and sb.instance_id and sb.status == "running":
            self.driver.freeze(sb.instance_id)

    def thaw_warm(self, sandbox_id: str) -> None:
        """Thaw a warm sandbox ahead of its claim, still at the warm CPU weight: a sentry waking
        from the freezer burns ~20 ms of CPU at once, which must not land on a create."""
        sb = self.get_warm(sandbox_id)
        if sb is not None and sb.instance_id and sb.status == "running":
            self.driver.thaw(sb.instance_id)

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
            live = instances.get(sb.instance_id) if sb.instance_id else None
            if live in ("running", "created", "paused"):
                assert sb.instance_id
                known.add(sb.instance_id)
                if (self.driver.take_fence_mark(self._workdir(sb)) and not sb.fenced and not sb.warm
                        and sb.status != "stopping"):
                    # Its shim froze it while no agent ran (the lease ran out): fenced, as if by us.
                    sb.fenced, sb.fenced_from = True, ("paused" if live == "paused" else "running")
                    log.warning("sandbox.fenced", sandbox=sb.id, was=sb.fenced_from, by="shim")
                if sb.fenced:
                    # Only the control plane's unfence lets it run again; never thawed here.
                    self.driver.freeze(sb.instance_id)
                    sb.status = "paused"
                    self._save(sb)
                elif sb.status == "paused" and sb.held:
                    self.driver.freeze(sb.instance_id)  # paused by the freezer: it stays so
                elif sb.status != "stopping":
                    sb.status = "paused" if live == "paused" else "running"
                    sb.held = False
                if sb.status == "running" and not sb.warm:
                    # Claimed just before a stop, before it was woken: it must not stay frozen.
                    self.driver.thaw(sb.instance_id)
                    self.driver.set_cpu_shares(sb.instance_id, DEFAULT_CPU_SHARES)
            elif sb.status != "stopping":
                sb.status = "dead"
            self._sandboxes[sb.id] = sb
            for trash in d.glob("trash-*"):  # a rollback's old root, whose removal was cut short
                await self.pool.delete_subvolume(trash)
            log.info("sandbox.recovered", sandbox=sb.id, status=sb.status, instance=sb.instance_id)
        if self.egress is not None:
            nets = [n for n in (self.egress.network.adopt(self._dir(sid)) for sid in self._sandboxes) if n]
            await self.egress.network.readmit(nets)
            await self.egress.network.sweep({n.netns for n in nets})
            await self.reapply_egress()
            self.egress.network.keep_spares()  # the first create after a start need not make one
        for inst in instances:
            if inst not in known:
                log.warning("instance.orphan_removed", instance=inst)
                await self.driver.stop(inst, self.channel_dir)
        # Sentries of launches cut short, which runsc has no record of: they hold the pool busy.
        await self.driver.sweep(known)
        trash = self.pool.root / TRASH
        for leftover in sorted(trash.iterdir()) if trash.exists() else []:
            # Deleted sandboxes whose removal a stop cut short.
            await self.pool.delete_subvolume(leftover)
        self.backups.recover()

    # -- lifecycle ---------------------------------------------------------------------------

    async def create(
        self,
        sandbox_id: str,
        *,
        template: str,
        cpu: float,
        memory_mb: int,
        env: dict[str, str] | None = None,
        warm: bool = False,
        disk_mb: int | None = None,
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
                warm=warm,
                disk_mb=disk_mb,
            )
            self._sandboxes[sandbox_id] = sb
            self._save(sb)
            rootfs = d / "rootfs"
            if not await self.pool.is_subvolume(rootfs):
                await self._new_root(sb, info.path)
            await self._boot(sb, t0=t0)
            if sb.env:
                await self.publish_env(sb)
            if warm:
                try:  # a warm sandbox's first command should not pay for the first exec
                    await startup.prime(self._guests[sandbox_id], sb.user)
                except (SpaceError, TimeoutError) as exc:
                    log.warning("sandbox.prime_failed", sandbox=sandbox_id, error=str(exc))
            log.info("sandbox.created", sandbox=sandbox_id, **sb.timings)
            return sb

    async def _new_root(self, sb: LocalSandbox, src: Path) -> None:
        """The sandbox's root as a writable snapshot of ``src``, born with its disk limit."""
        limit = sb.disk_mb << 20 if sb.disk_mb is not None else None
        await self.pool.snapshot(src, self._dir(sb.id) / "rootfs", sandbox_root=True, limit_bytes=limit)

    async def set_disk_limit(self, sandbox_id: str, disk_mb: int | None) -> None:
        """Change a sandbox's disk limit (a claimed warm sandbox gets its owner's): its root now,
        and every root it gets later."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.disk_mb == disk_mb:
            return
        await self.pool.set_disk_limit(self._dir(sandbox_id) / "rootfs",
                                       disk_mb << 20 if disk_mb is not None else None)
        sb.disk_mb = disk_mb
        self._save(sb)

    async def publish_env(self, sb: LocalSandbox) -> None:
        """Write the sandbox's own environment to :data:`SANDBOX_ENV_FILE` in it, for services its
        template started before the sandbox had one (a warm sandbox gets it when it is claimed):
        every command gets it anyway, but e.g. ``code-interpreter-v1``'s kernels were already
        running. Only when there is one, so a create without env costs nothing more."""
        payload = json.dumps(sb.env, sort_keys=True).encode()

        async def body() -> AsyncIterator[bytes]:
            yield payload

        conn = await self.guest(sb.id)
        await conn.upload("fs.write", body(), path=SANDBOX_ENV_FILE, mode=0o644)

    async def template_spec(self, sb: LocalSandbox) -> dict[str, Any]:
        """The spec of the template ``sb`` was made from ({} when this node no longer has it)."""
        spec = self._specs.get(sb.template_digest)
        if spec is None:
            found = [t for t in await self.templates.list()
                     if t.name == sb.template and t.digest == sb.template_digest]
            spec = dict(found[0].spec) if found else {}
            self._specs[sb.template_digest] = spec
        return spec

    async def exec_defaults(self, sb: LocalSandbox) -> tuple[dict[str, str], str | None]:
        """What every command in ``sb`` gets unless it says otherwise: (env, working directory),
        the template's env under the sandbox's own."""
        env, _user, workdir = startup.template_defaults(await self.template_spec(sb))
        return {**env, **sb.env}, workdir

    async def _boot(self, sb: LocalSandbox, *, image: Path | None = None, t0: float | None = None) -> None:
        """Start a new runtime instance on ``rootfs`` (cold, or from a memory image) and connect
        to its guest; a cold boot then runs the template's start command until it is ready. On
        failure the sandbox is left ``dead`` (a retry boots again)."""
        t1 = time.perf_counter()
        assert sb.instance_id
        net = None
        if self.egress is not None:
            net = await self.egress.network.ready(self._dir(sb.id))
            if image is None:  # a restored root has it already (and its open files must not change)
                ca = self.egress.ca_cert()
                await self.pool.priv.call("rootfs.configure_net", {
                    "sandbox": sb.id, "ca_pem": ca.decode() if ca is not None else None})
        t_net = time.perf_counter()
        spec = InstanceSpec(
            sandbox_id=sb.id,
            instance_id=sb.instance_id,
            rootfs=self._dir(sb.id) / "rootfs",
            workdir=self._workdir(sb),
            guest_dir=self.guest_dir,
            channel_dir=self.channel_dir,
            cpu=sb.cpu,
            memory_mb=sb.memory_mb,
            hostname=sb.id[:12],
            cpu_shares=WARM_CPU_SHARES if sb.warm else None,
            netns=net.netns_path if net is not None else None,
            net_index=net.index if net is not None else None,
        )
        try:
            if image is None:
                handle = await self.driver.start(spec)
            else:
                handle = await self.driver.restore(spec, image)
            t2 = time.perf_counter()
            sb.channel = str(handle.channel)
            conn = await GuestConnection.connect(str(handle.channel), timeout=self.guest_timeout, label=sb.id)
            self._guests[sb.id] = conn
            t_guest = time.perf_counter()
            if image is None:  # from memory, the start command is already running
                await startup.start_and_wait(conn, await self.template_spec(sb))
            if self.egress is not None and not sb.warm:
                await self.egress.apply(sb.id, self._dir(sb.id), net)
        except BaseException:
            sb.status = "dead"
            sb.death = "boot_failed"
            self._save(sb)
            raise
        t3 = time.perf_counter()
        sb.status = "running"
        sb.death = None
        sb.timings = {
            **({"snapshot_ms": round((t1 - t0) * 1000, 2)} if t0 is not None else {}),
            **({"network_ms": round((t_net - t1) * 1000, 2)} if net is not None else {}),
            ("runtime_restore_ms" if image is not None else "runtime_start_ms"): round((t2 - t_net) * 1000, 2),
            "guest_ready_ms": round((t_guest - t2) * 1000, 2),
            "guest_boot_ms": float(conn.hello.get("boot_ms", 0.0)),
            **({"start_ready_ms": round((t3 - t_guest) * 1000, 2)} if t3 - t_guest > 0.001 else {}),
        }
        self._save(sb)

    def departure(self, sandbox_id: str) -> str | None:
        """Why ``sandbox_id`` left this node, if it was moved elsewhere (``"moved"``)."""
        return self._departed.get(sandbox_id)

    async def delete(self, sandbox_id: str, *, reason: str | None = None) -> None:
        """Remove the sandbox from this node. ``reason="moved"``: it runs on another node now,
        and streams still attached here end with a ``moved`` event."""
        if reason is not None:
            if len(self._departed) >= MAX_DEPARTED:
                self._departed.pop(next(iter(self._departed)))
            self._departed[sandbox_id] = reason
        await self.backups.stop(sandbox_id)
        async with self._lock(sandbox_id):
            sb = self._sandboxes.get(sandbox_id)
            if sb is None:
                # Not in memory: maybe a leftover directory from a crash mid-create.
                await self.pool.delete_subvolume(self._dir(sandbox_id))
                return
            self._deleting.add(sandbox_id)
            try:
                await self._destroy(sb, defer=True)
                self._sandboxes.pop(sandbox_id, None)
            finally:
                self._deleting.discard(sandbox_id)
        self._locks.pop(sandbox_id, None)

    async def _destroy(self, sb: LocalSandbox, *, defer: bool = False) -> None:
        """Remove the sandbox's instance and files. With ``defer`` the instance is killed and its
        directory moved to the pool's trash at once, and the slow part (``runsc delete``, over a
        second, and deleting the subvolumes) runs in the background: the id is free right away."""
        sb.status = "stopping"
        with contextlib.suppress(OSError):
            self._save(sb)
        # Proxied requests to its servers end now, not when TCP keepalive gives up on them.
        await port_proxy.reset(sb.id)
        conn = self._guests.pop(sb.id, None)
        if conn is not None:
            await conn.close()
        d = self._dir(sb.id)
        if not defer or not d.exists():
            if sb.instance_id:
                await self.driver.stop(sb.instance_id, self._workdir(sb))
            await self._release_network(sb.id)
            await self.pool.delete_subvolume(d)
            log.info("sandbox.destroyed", sandbox=sb.id)
            return
        old = sb.instance_id
        if old:
            await self.driver.kill(old, self._workdir(sb))
        await self._release_network(sb.id)
        trash = self.pool.root / TRASH / f"{sb.id}-{ids.token(4)}"
        trash.parent.mkdir(exist_ok=True)
        await asyncio.to_thread(os.rename, d, trash)

        async def reap() -> None:
            try:
                if old:
                    await self.driver.stop(old, trash / "instances" / old)
                await self.pool.delete_subvolume(trash)
                log.info("sandbox.destroyed", sandbox=sb.id)
            except SpaceError as exc:  # the next start's recover() finishes the job
                log.warning("sandbox.reap_failed", sandbox=sb.id, error=str(exc))

        task = asyncio.create_task(reap())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def close(self) -> None:
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)
        for conn in list(self._guests.values()):
            await conn.close()
        self._guests.clear()

    # -- the guest channel --------------------------------------------------------------------

    async def guest(self, sandbox_id: str) -> GuestConnection:
        """The live channel to the sandbox's guest daemon, reconnecting through the shim if needed."""
        return await self._guest(self.get(sandbox_id))

    async def _guest(self, sb: LocalSandbox) -> GuestConnection:
        sandbox_id = sb.id
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
            conn = await GuestConnection.connect(sb.channel, timeout=self.guest_timeout, label=sandbox_id)
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
        cause = await self.driver.death_cause(sb.instance_id) or "exited"
        if sb.id in self._deleting or self._sandboxes.get(sb.id) is not sb:
            # Being deleted, or deleted, while we asked (a delete kills the instance, then moves
            # its directory away): there is no record left to mark dead.
            raise NotFound(f"sandbox {sb.id} is not on this node", sandbox_id=sb.id)
        sb.status = "dead"
        sb.death = cause
        self._save(sb)
        conn = self._guests.pop(sb.id, None)
        if conn is not None:
            await conn.close()
        log.warning("sandbox.died", sandbox=sb.id, instance=sb.instance_id, cause=sb.death)
        raise dead_error(sb)

    async def monitor(self, every: float = 2.0) -> None:
        """Notice dead instances without waiting for a caller: a sandbox whose guest channel is
        gone is asked about; the control plane's reconcile then sees ``dead`` and recovers it."""
        while True:
            await asyncio.sleep(every)
            unsure: builtins.list[LocalSandbox] = []
            for sb in builtins.list(self._sandboxes.values()):
                if sb.status not in ("running", "paused") or self._lock(sb.id).locked():
                    continue
                conn = self._guests.get(sb.id)
                if conn is not None and not conn.closed:
                    continue
                if sb.status == "running":
                    with contextlib.suppress(SpaceError):
                        await self._guest(sb)  # (re)connects, and finds out if the instance died
                else:
                    unsure.append(sb)  # a paused guest cannot answer: ask the runtime
            if unsure:
                live = await self.driver.list_instances()  # one call for all of them
                for sb in unsure:
                    if live.get(sb.instance_id or "") not in ("running", "created", "paused"):
                        with contextlib.suppress(SpaceError):
                            await self.check_alive(sb, settle=1.0)

    async def activity(self, sandbox_id: str) -> dict[str, Any]:
        conn = await self.guest(sandbox_id)
        return await conn.request("activity")

    # -- pause / resume ----------------------------------------------------------------------

    async def pause(self, sandbox_id: str) -> LocalSandbox:
        async with self._lock(sandbox_id):
            sb = self.get(sandbox_id)
            if sb.status == "paused":
                return sb
            self._require(sb, "running", "pause")
            assert sb.instance_id
            await self.driver.hold(sb.instance_id)
            sb.status, sb.held = "paused", True
            self._save(sb)
            log.info("sandbox.paused", sandbox=sandbox_id)
            return sb

    async def fence(self, sandbox_id: str) -> LocalSandbox:
        """Freeze the sandbox because this node lost its lease: it may be restored elsewhere."""
        async with self._lock(sandbox_id):
            sb = self.get(sandbox_id)
            if sb.fenced or sb.status not in ("running", "paused"):
                return sb
            sb.fenced_from = sb.status
            if sb.status == "running":
                assert sb.instance_id
                # The freezer alone, not `runsc pause`: its shim may have frozen the instance
                # already, and a frozen sentry would never answer runsc.
                self.driver.freeze(sb.instance_id)
                sb.status = "paused"
            sb.fenced = True
            self._save(sb)
            log.warning("sandbox.fenced", sandbox=sandbox_id, was=sb.fenced_from)
            return sb

    async def take_fence_marks(self) -> builtins.list[str]:
        """Fence the sandboxes whose shims froze them because the lease ran out (the agent was
        stopped or slow meanwhile): the control plane then says which are still this node's."""
        taken = [sb for sb in tuple(self._sandboxes.values())
                 if sb.instance_id and self.driver.take_fence_mark(self._workdir(sb))]
        # A warm sandbox has no owner yet, so no copy elsewhere: frozen is how it waits anyway.
        marked = [sb.id for sb in taken if sb.status in ("running", "paused") and not sb.fenced and not sb.warm]
        for sid in marked:
            await self.fence(sid)
        if marked:
            log.warning("node.fenced_by_shims", sandboxes=marked)
        return marked

    async def unfence(self, sandbox_id: str) -> LocalSandbox:
        """The control plane says this node still owns the sandbox: it goes on as it was."""
        async with self._lock(sandbox_id):
            sb = self.get(sandbox_id)
            if not sb.fenced:
                return sb
            if sb.fenced_from == "running" and sb.status == "paused":
                assert sb.instance_id
                self.driver.thaw(sb.instance_id)
                if await self.driver.state(sb.instance_id) == "paused":  # fenced with `runsc pause` (older agents)
                    await self.driver.resume(sb.instance_id)
                sb.status = "running"
            sb.fenced, sb.fenced_from = False, None
            self._save(sb)
            log.info("sandbox.unfenced", sandbox=sandbox_id, status=sb.status)
            return sb

    async def resume(self, sandbox_id: str) -> LocalSandbox:
        async with self._lock(sandbox_id):
            sb = self.get(sandbox_id)
            if sb.status == "running":
                return sb
            if sb.fenced:
                raise InvalidState(f"sandbox {sandbox_id} is fenced on this node (it lost contact with the "
                                   "control plane): only the control plane can release it", state="fenced",
                                   allowed=[])
            self._require(sb, "paused", "resume")
            assert sb.instance_id
            if sb.held:
                self.driver.thaw(sb.instance_id)
            else:
                await self.driver.resume(sb.instance_id)
            sb.status, sb.held = "running", False
            self._save(sb)
            log.info("sandbox.resumed", sandbox=sandbox_id)
            return sb

    @staticmethod
    def _require_unfenced(sb: LocalSandbox, what: str) -> None:
        """A fenced copy may have been restored elsewhere: nothing here may run it again (a new
        instance) or let its guest run (a checkpoint thaws it) until the control plane releases it."""
        if sb.fenced:
            raise InvalidState(f"cannot {what} sandbox {sb.id}: it is fenced on this node (it lost contact with "
                               "the control plane); only the control plane can release it", state="fenced",
                               allowed=[])

    def _require(self, sb: LocalSandbox, status: str, what: str) -> None:
        if sb.status == "dead":
            raise dead_error(sb)
        if sb.status != status:
            raise InvalidState(f"cannot {what} sandbox {sb.id}: it is {sb.status} on its node",
                               state=sb.status, allowed=[])

    # -- snapshots ---------------------------------------------------------------------------

    async def take_snapshot(self, sandbox_id: str, snap_id: str, kind: str, *,
                            stay_paused: bool = False) -> snapshots.LocalSnapshot:
        """A read-only snapshot of the root; ``full`` adds the memory image, taken while the guest
        is frozen so that memory and disk agree. Idempotent by ``snap_id``."""
        snapshots.check_kind(kind)
        async with self._lock(sandbox_id):
            sb = self.get(sandbox_id)
            done = snapshots.read(self.pool, sandbox_id, snap_id)
            if done is not None:
                return done
            self._require_unfenced(sb, "snapshot")
            if sb.status not in ("running", "paused"):
                self._require(sb, "running", "snapshot")
            d = snapshots.snapshot_dir(self.pool, sandbox_id, snap_id)
            await self.pool.delete_subvolume(d)  # an interrupted attempt's leftovers
            await snapshots.check_room(self.pool, f"a {kind} snapshot of {sandbox_id}")
            d.mkdir(parents=True)
            t0 = time.perf_counter()
            freeze_ms = 0.0
            try:
                if kind == "disk":
                    if stay_paused and sb.status == "running":
                        # A suspend: nothing writes to the root once it is taken.
                        assert sb.instance_id
                        await self.driver.hold(sb.instance_id)
                        sb.status, sb.held = "paused", True
                        self._save(sb)
                    await self.pool.snapshot(self._dir(sandbox_id) / "rootfs", d / "rootfs", readonly=True)
                else:
                    assert sb.instance_id
                    if sb.status == "paused" and sb.held:
                        # The checkpoint needs the sentry, which the freezer stops too: the runtime
                        # holds the guest instead (it runs for the few ms between the two, before
                        # anything is taken, so memory and disk still agree).
                        self.driver.thaw(sb.instance_id)
                        await self.driver.pause(sb.instance_id)
                        sb.held = False
                        self._save(sb)
                    was_running = sb.status == "running"
                    if self.egress is not None:
                        # gVisor cannot save an established TCP connection (nor one in TIME_WAIT):
                        # every TCP peer of a sandbox is the gateway, which resets them first.
                        await self.egress.reset(sandbox_id, self.net(sandbox_id))
                        await port_proxy.reset(sandbox_id)  # and so does the node's port proxy
                    if was_running:
                        await self.driver.pause(sb.instance_id)
                    f0 = time.perf_counter()
                    try:
                        await self.pool.snapshot(self._dir(sandbox_id) / "rootfs", d / "rootfs", readonly=True)
                        await self.driver.checkpoint(sb.instance_id, d / "checkpoint")
                    finally:
                        if was_running and not stay_paused:
                            await self.driver.resume(sb.instance_id)
                        elif was_running:
                            sb.status = "paused"
                            self._save(sb)
                    freeze_ms = (time.perf_counter() - f0) * 1000
            except BaseException:
                await asyncio.shield(self.pool.delete_subvolume(d))
                raise
            snap = snapshots.LocalSnapshot(
                id=snap_id, sandbox_id=sandbox_id, kind=kind, created_at=snapshots.now(),
                template=sb.template, template_digest=sb.template_digest, cpu=sb.cpu,
                memory_mb=sb.memory_mb, env=sb.env, user=sb.user, disk_mb=sb.disk_mb,
                image_bytes=snapshots.tree_bytes(d / "checkpoint") if kind == "full" else 0,
                freeze_ms=round(freeze_ms, 2), took_ms=round((time.perf_counter() - t0) * 1000, 2),
            )
            snapshots.commit(self.pool, snap)
            log.info("snapshot.taken", sandbox=sandbox_id, snapshot=snap_id, kind=kind,
                     ms=snap.took_ms, freeze_ms=snap.freeze_ms)
            return snap

    async def delete_snapshot(self, sandbox_id: str, snap_id: str) -> None:
        async with self._lock(sandbox_id):
            await snapshots.remove(self.pool, sandbox_id, snap_id)

    def list_snapshots(self, sandbox_id: str) -> builtins.list[snapshots.LocalSnapshot]:
        return snapshots.list_local(self.pool, sandbox_id)

    async def snapshot_size(self, sandbox_id: str, snap_id: str) -> int | None:
        """Bytes the snapshot holds that nothing else shares, plus its memory image."""
        snap = snapshots.get(self.pool, sandbox_id, snap_id)
        own = await self.pool.exclusive_bytes(snapshots.rootfs_of(self.pool, sandbox_id, snap_id))
        return None if own is None else own + snap.image_bytes

    # -- rollback, recovery, fork ------------------------------------------------------------

    async def rollback(self, sandbox_id: str, snap_id: str, *, token: str | None = None,
                       source: str | None = None, disk_mb: int | None = None) -> LocalSandbox:
        """Put the sandbox back to a snapshot, in place, under a new runtime instance: the files
        (disk snapshot: processes start afresh) or the whole machine (full snapshot). Works on a
        dead sandbox too: that is crash recovery. ``source``: the sandbox the snapshot belongs to
        (default: this one). ``token``: a retried request with the same token is not re-applied."""
        async with self._lock(sandbox_id):
            sb = self.get(sandbox_id)
            if token is not None and sb.applied == token and sb.status == "running":
                return sb
            self._require_unfenced(sb, "roll back")
            owner = source or sandbox_id
            snap = snapshots.get(self.pool, owner, snap_id)
            t0 = time.perf_counter()
            rootfs = self._dir(sandbox_id) / "rootfs"
            # The old instance is killed now and removed in the background (runsc delete takes
            # over a second); its root moves aside first, so the new root takes its place at once.
            trash = self._dir(sandbox_id) / f"trash-{sb.instance_id or 'none'}"
            await self._stop_instance(sb, defer_to=trash if rootfs.exists() else None)
            await self.pool.delete_subvolume(rootfs)
            if disk_mb is not None:
                sb.disk_mb = disk_mb
            await self._new_root(sb, snapshots.rootfs_of(self.pool, owner, snap_id))
            sb.instance_id = ids.instance_id(sandbox_id)
            sb.source_snapshot = snap_id
            sb.applied = token
            self._save(sb)
            image = snapshots.image_of(self.pool, owner, snap_id) if snap.kind == "full" else None
            await self._boot(sb, image=image, t0=t0)
            log.info("sandbox.rolled_back", sandbox=sandbox_id, snapshot=snap_id, kind=snap.kind, **sb.timings)
            return sb

    async def reboot(self, sandbox_id: str, *, token: str | None = None) -> LocalSandbox:
        """A new instance on the sandbox's current files (crash recovery without any snapshot)."""
        async with self._lock(sandbox_id):
            sb = self.get(sandbox_id)
            if token is not None and sb.applied == token and sb.status == "running":
                return sb
            self._require_unfenced(sb, "reboot")
            t0 = time.perf_counter()
            await self._stop_instance(sb)
            sb.instance_id = ids.instance_id(sandbox_id)
            sb.applied = token
            self._save(sb)
            await self._boot(sb, t0=t0)
            log.info("sandbox.rebooted", sandbox=sandbox_id, **sb.timings)
            return sb

    async def fork(self, sandbox_id: str, source_id: str, snap_id: str, *,
                   disk_mb: int | None = None) -> LocalSandbox:
        """A new sandbox from another's snapshot: its root a snapshot of the snapshot (shared
        extents), its memory the snapshot's image when it has one. Idempotent like create."""
        async with self._lock(sandbox_id):
            existing = self._sandboxes.get(sandbox_id)
            if existing is not None and existing.status == "running":
                return existing
            if existing is not None:
                await self._destroy(existing)
            snap = snapshots.get(self.pool, source_id, snap_id)
            t0 = time.perf_counter()
            d = self._dir(sandbox_id)
            d.mkdir(parents=True, exist_ok=True)
            sb = LocalSandbox(
                id=sandbox_id, template=snap.template, template_digest=snap.template_digest,
                cpu=snap.cpu, memory_mb=snap.memory_mb, env=dict(snap.env), user=snap.user,
                instance_id=ids.instance_id(sandbox_id), source_snapshot=snap_id,
                disk_mb=disk_mb if disk_mb is not None else snap.disk_mb,
            )
            self._sandboxes[sandbox_id] = sb
            self._save(sb)
            await self._new_root(sb, snapshots.rootfs_of(self.pool, source_id, snap_id))
            image = snapshots.image_of(self.pool, source_id, snap_id) if snap.kind == "full" else None
            await self._boot(sb, image=image, t0=t0)
            log.info("sandbox.forked", sandbox=sandbox_id, source=source_id, snapshot=snap_id, **sb.timings)
            return sb

    async def adopt_snapshot(self, sandbox_id: str, snap: snapshots.LocalSnapshot) -> LocalSandbox:
        """Register a sandbox whose only content is a snapshot just brought to this node (a restore
        from object storage); :meth:`rollback` then boots it."""
        async with self._lock(sandbox_id):
            existing = self._sandboxes.get(sandbox_id)
            if existing is not None:
                return existing
            sb = LocalSandbox(
                id=sandbox_id, template=snap.template, template_digest=snap.template_digest,
                cpu=snap.cpu, memory_mb=snap.memory_mb, env=dict(snap.env), user=snap.user,
                status="dead", death="suspended", disk_mb=snap.disk_mb,
            )
            self._sandboxes[sandbox_id] = sb
            self._save(sb)
            return sb

    # -- continuous backup (space.node.sandboxes.backups decides when) -------------------------

    async def root_generation(self, sandbox_id: str) -> int:
        """The generation of the sandbox's root (its pending writes committed first)."""
        async with self._lock(sandbox_id):
            self.get(sandbox_id)
            return await self.pool.generation(self._dir(sandbox_id) / "rootfs")

    async def backup_snapshot(self, sandbox_id: str, dest: Path) -> LocalSandbox:
        """A read-only snapshot of the running (or paused) sandbox's root at ``dest``: no freeze,
        the same atomic btrfs snapshot a scheduled disk snapshot is."""
        async with self._lock(sandbox_id):
            sb = self.get(sandbox_id)
            if sb.status not in ("running", "paused"):
                self._require(sb, "running", "back up")
            await self.pool.snapshot(self._dir(sandbox_id) / "rootfs", dest, readonly=True)
            return sb

    async def ship_backup_link(self, sandbox_id: str, *, prefix: str, tenant: str, chain: str, seq: int,
                               root: Path, parent: Path, bytes_per_s: float | None,
                               sealing: SealingSpec | None = None) -> Manifest:
        """Ship one backup link (its template first, so that any node can receive the chain)."""
        sealed = None if sealing is None else sealing.bind(self.data_keys)
        objects, keys = self._objects()
        sb = self.get(sandbox_id)
        published = await self.templates.publish(objects, sb.template, sb.template_digest)
        snap = snapshots.LocalSnapshot(
            id=backup_chain.link_id(chain, seq), sandbox_id=sandbox_id, kind="disk", created_at=snapshots.now(),
            template=sb.template, template_digest=sb.template_digest, cpu=sb.cpu, memory_mb=sb.memory_mb,
            env=sb.env, user=sb.user, disk_mb=sb.disk_mb)
        public, private = shipping.snapshot_meta(snap)
        meta = {"template_spec": published.spec, "template": published.ref(), "sandbox_id": sandbox_id,
                "snapshot": public}
        return await backup_chain.upload_link(objects, prefix, self.pool, tenant=tenant, sandbox_id=sandbox_id,
                                              chain=chain, seq=seq, root=root, parent=parent, meta=meta,
                                              keys=keys, bytes_per_s=bytes_per_s, sealing=sealed, private=private)

    async def restore_backup(self, sandbox_id: str, *, prefix: str, chain: str, seq: int, tenant: str,
                             token: str | None = None, disk_mb: int | None = None,
                             on_progress: shipping.Progress | None = None,
                             sealing: SealingSpec | None = None) -> LocalSandbox:
        """Bring a sandbox back on this node from its disk backup: links ``0..seq`` of ``chain``
        received and verified, the last one its root; it boots afresh (processes restarted)."""
        existing = self._sandboxes.get(sandbox_id)
        if existing is not None and existing.status == "running" and (token is None or existing.applied == token):
            return existing
        self._departed.pop(sandbox_id, None)
        sealed = None if sealing is None else sealing.bind(self.data_keys)
        objects, keys = self._objects()
        snap_id = backup_chain.link_id(chain, seq)
        work = self._dir(sandbox_id) / "restore-chain"
        try:
            first = await backup_chain.read_link(objects, prefix, tenant=tenant, sandbox_id=sandbox_id, chain=chain,
                                                 seq=0, keys=keys)
            await self._ensure_template_of(first, what=f"backup {chain}", on_progress=on_progress)
            root, last = await backup_chain.receive_chain(objects, prefix, self.pool, work, tenant=tenant,
                                                          sandbox_id=sandbox_id, chain=chain, upto=seq, keys=keys,
                                                          first=first, sealing=sealed)
            raw = shipping.described_snapshot(last)
            fields = {k: v for k, v in raw.items() if k in snapshots.LocalSnapshot.__dataclass_fields__}
            snap = snapshots.LocalSnapshot(**{**fields, "id": snap_id, "sandbox_id": sandbox_id, "kind": "disk"})
            d = snapshots.snapshot_dir(self.pool, sandbox_id, snap_id)
            await self.pool.delete_subvolume(d)
            d.mkdir(parents=True)
            await self.pool.snapshot(root, d / "rootfs", readonly=True)
            snapshots.commit(self.pool, snap)
            await self.pool.delete_subvolume(work)
            await self.adopt_snapshot(sandbox_id, snap)
            return await self.rollback(sandbox_id, snap_id, token=token, disk_mb=disk_mb)
        except BaseException:
            if sandbox_id not in self._sandboxes or self._sandboxes[sandbox_id].status != "running":
                await asyncio.shield(self._forget_dir(sandbox_id))
            raise

    async def rewrap(self, *, tenant: str, sandbox_id: str, snapshot_id: str, prefix: str, to: KeyRef) -> KeyRef | None:
        """A shipped snapshot's (or backup link's) data key wrapped under ``to``, its manifest
        rewritten (a tenant's key rotation); None if there was nothing to do."""
        if self.data_keys is None:
            raise KeyUnavailable(f"this node has no key providers configured to re-wrap under {to.provider} "
                                 f"key {to.key_id}", key=to.key_id, provider=to.provider)
        objects, keys = self._objects()
        binding = snapshot_binding(tenant=tenant, sandbox_id=sandbox_id, snapshot_id=snapshot_id, prefix=prefix)
        return await rewrap_snapshot(objects, prefix, keys=keys, binding=binding, data_keys=self.data_keys, to=to)

    async def _ensure_template_of(self, manifest: Manifest, *, what: str,
                                  on_progress: shipping.Progress | None = None, **details: Any) -> None:
        """The template a shipped snapshot or backup sits on, on this node (from its stream)."""
        spec = manifest.meta.get("template_spec") or {}
        if not isinstance(spec, dict) or not spec:
            raise SnapshotCorrupt(f"{what}: its manifest names no template", **details)
        name, digest, stream = template_objects.parse_ref(manifest.meta.get("template"), where=f"{what}'s manifest")
        if (name, digest) != (spec.get("name"), spec_digest(spec)):
            raise SnapshotCorrupt(f"{what}: its manifest's template {name}@{digest[:16]} is not "
                                  "the one its spec describes", **details)
        await self.templates.ensure(spec, on_progress=on_progress, stream=stream)

    # -- suspend / restore through object storage --------------------------------------------

    def _objects(self) -> tuple[ObjectStore, ManifestKeys]:
        if self.objects is None:
            raise Unavailable("this node has no object store configured")
        # One keyring per node: the template store's (it cannot have an object store without it).
        assert self.templates.keys is not None
        return self.objects, self.templates.keys

    async def suspend(self, sandbox_id: str, snap_id: str, prefix: str,
                      on_progress: shipping.Progress | None = None, *, kind: str = "full",
                      tenant: str, sealing: SealingSpec | None = None) -> dict[str, Any]:
        """Freeze, take a snapshot (``full``: with memory; ``disk``: the files only) and ship it
        (template first, then artifacts, then manifest). The sandbox stays paused here: the caller
        evicts it once the snapshot is recorded."""
        sealed = None if sealing is None else sealing.bind(self.data_keys)  # refused before anything is done
        await self.take_snapshot(sandbox_id, snap_id, kind, stay_paused=True)
        return await self._upload(sandbox_id, snap_id, prefix, on_progress=on_progress, tenant=tenant, sealing=sealed)

    async def upload_snapshot(self, sandbox_id: str, snap_id: str, prefix: str,
                              on_progress: shipping.Progress | None = None, *, tenant: str,
                              sealing: SealingSpec | None = None) -> dict[str, Any]:
        """Ship one of the sandbox's snapshots to object storage (its template first), its manifest
        sealed for this tenant, sandbox, snapshot and prefix (its artifacts encrypted with
        ``sealing``)."""
        return await self._upload(sandbox_id, snap_id, prefix, on_progress=on_progress, tenant=tenant,
                                  sealing=None if sealing is None else sealing.bind(self.data_keys))

    async def _upload(self, sandbox_id: str, snap_id: str, prefix: str, *, on_progress: shipping.Progress | None,
                      tenant: str, sealing: Sealing | None) -> dict[str, Any]:
        objects, keys = self._objects()
        snap = snapshots.get(self.pool, sandbox_id, snap_id)
        published = await self.templates.publish(objects, snap.template, snap.template_digest,
                                                 on_progress=on_progress)
        root = self.pool.template_path(snap.template, snap.template_digest)
        binding = snapshot_binding(tenant=tenant, sandbox_id=sandbox_id, snapshot_id=snap_id, prefix=prefix)
        return await shipping.upload(objects, prefix, self.pool, snap, root,
                                     {"template_spec": published.spec, "template": published.ref(),
                                      "sandbox_id": sandbox_id},
                                     on_progress=on_progress, keys=keys, binding=binding, sealing=sealing)

    async def fetch_snapshot(self, sandbox_id: str, snap_id: str, prefix: str,
                             on_progress: shipping.Progress | None = None, *, tenant: str,
                             owner: str | None = None, sealing: SealingSpec | None = None) -> snapshots.LocalSnapshot:
        """Bring a shipped snapshot of ``owner`` (default: this sandbox) onto this node, into
        ``sandbox_id``'s directory: its manifest verified (sealed for exactly that tenant, owner,
        snapshot and prefix), then the template stream it names, then its artifacts."""
        objects, keys = self._objects()
        binding = snapshot_binding(tenant=tenant, sandbox_id=owner or sandbox_id, snapshot_id=snap_id, prefix=prefix)
        manifest = await read_manifest(objects, prefix, keys=keys, binding=binding)
        await self._ensure_template_of(manifest, what=f"snapshot {snap_id}", on_progress=on_progress,
                                       snapshot_id=snap_id)
        return await shipping.download(objects, prefix, self.pool, sandbox_id, snap_id, on_progress=on_progress,
                                       keys=keys, binding=binding, manifest=manifest,
                                       sealing=None if sealing is None else sealing.bind(self.data_keys))

    async def restore(self, sandbox_id: str, snap_id: str, prefix: str, *, token: str | None = None,
                      on_progress: shipping.Progress | None = None, disk_mb: int | None = None,
                      tenant: str, owner: str | None = None, sealing: SealingSpec | None = None) -> LocalSandbox:
        """Bring a suspended sandbox back on this node (or make a new one, ``sandbox_id``, of
        ``owner``'s shipped snapshot): its template (materialized if missing, one download shared
        by concurrent restores), its shipped snapshot (verified before use), then a restore of its
        memory. On failure nothing of it is left on this node."""
        existing = self._sandboxes.get(sandbox_id)
        if existing is not None and existing.status == "running" and (token is None or existing.applied == token):
            return existing
        self._departed.pop(sandbox_id, None)  # back here (moved back, restored here)
        try:
            snap = await self.fetch_snapshot(sandbox_id, snap_id, prefix, on_progress=on_progress, tenant=tenant,
                                             owner=owner, sealing=sealing)
            await self.adopt_snapshot(sandbox_id, snap)
            return await self.rollback(sandbox_id, snap_id, token=token, disk_mb=disk_mb)
        except BaseException:
            if sandbox_id not in self._sandboxes or self._sandboxes[sandbox_id].status != "running":
                await asyncio.shield(self._forget_dir(sandbox_id))
            raise

    async def _forget_dir(self, sandbox_id: str) -> None:
        await self.backups.stop(sandbox_id)
        sb = self._sandboxes.pop(sandbox_id, None)
        if sb is not None and sb.instance_id:
            await self.driver.stop(sb.instance_id, self._workdir(sb))
        await self._release_network(sandbox_id)
        await self.pool.delete_subvolume(self._dir(sandbox_id))

    async def _release_network(self, sandbox_id: str) -> None:
        """The gateway forgets the sandbox and its namespace goes (its instance is already dead)."""
        if self.egress is None:
            return
        d = self._dir(sandbox_id)
        await self.egress.forget(sandbox_id, self.egress.network.load(d))
        await self.egress.network.detach(d)

    async def reapply_egress(self) -> None:
        """Tell a (re)started gateway about every sandbox it serves (secrets this agent still
        holds; the control plane re-pushes those it lost)."""
        if self.egress is None:
            return
        for sid, sb in list(self._sandboxes.items()):
            if not sb.warm and sb.status in ("running", "paused"):
                try:
                    await self.egress.apply(sid, self._dir(sid), self.egress.network.load(self._dir(sid)))
                except SpaceError as exc:
                    log.warning("sandbox.egress_reapply_failed", sandbox=sid, error=str(exc))

    async def keep_reserve(self, every: float = 2.0) -> None:
        """Keep the pool's reserve out of every sandbox's reach as templates, snapshots and
        deletions change what is free (:meth:`Pool.refresh_reserve`)."""
        while self.pool.quotas:
            await asyncio.sleep(every)
            try:
                await self.pool.refresh_reserve()
            except SpaceError as exc:
                log.warning("pool.reserve_refresh_failed", error=str(exc))

    async def watch_gateway(self, every: float = 2.0) -> None:
        """Restart the egress gateway should it die, and give it back what it knew."""
        if self.egress is None:
            return
        while True:
            await asyncio.sleep(every)
            try:
                if await self.egress.gateway.alive():
                    continue
            except SpaceError as exc:
                log.error("gateway.check_failed", error=str(exc))
                continue
            log.warning("gateway.died")
            try:
                await self.egress.gateway.ensure()
                await self.reapply_egress()
            except SpaceError as exc:
                log.error("gateway.restart_failed", error=str(exc))

    def net(self, sandbox_id: str) -> SandboxNet | None:
        return self.egress.network.load(self._dir(sandbox_id)) if self.egress is not None else None

    async def set_egress(self, sandbox_id: str, *, tenant: str, policy: dict[str, Any] | None,
                         secrets: builtins.list[dict[str, Any]] | None,
                         tenant_policy: dict[str, Any] | None = None,
                         ceiling: builtins.list[str] | None = None) -> None:
        """Record and apply a sandbox's egress policy and secrets (a running one's next connection
        obeys it). ``secrets`` None keeps the ones it has."""
        if self.egress is None:
            return
        d = self._dir(sandbox_id)
        d.mkdir(parents=True, exist_ok=True)
        self.egress.configure(sandbox_id, d, tenant=tenant, policy=policy, tenant_policy=tenant_policy,
                              ceiling=ceiling, secrets=secrets)
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and sb.status in ("running", "paused", "starting"):
            await self.egress.apply(sandbox_id, d, self.egress.network.load(d))

    async def _stop_instance(self, sb: LocalSandbox, *, defer_to: Path | None = None) -> None:
        """Stop the sandbox's instance. With ``defer_to``: kill it, move its root there, and leave
        the slow part (runsc delete, removing the old root) to a background task."""
        conn = self._guests.pop(sb.id, None)
        if conn is not None:
            await conn.close()
        old, workdir = sb.instance_id, (self._workdir(sb) if sb.instance_id else None)
        sb.status = "dead"
        sb.channel = None
        self._save(sb)
        if old is None or workdir is None:
            return
        if defer_to is None:
            await self.driver.stop(old, workdir)
            await asyncio.to_thread(shutil.rmtree, workdir, True)
            return
        await self.driver.kill(old, workdir)
        await self.pool.delete_subvolume(defer_to)  # a retry's leftover of the same instance
        await asyncio.to_thread(os.rename, self._dir(sb.id) / "rootfs", defer_to)

        async def reap() -> None:
            try:
                await self.driver.stop(old, workdir)
                await asyncio.to_thread(shutil.rmtree, workdir, True)
                await self.pool.delete_subvolume(defer_to)
            except SpaceError as exc:  # the next start's recover() finishes the job
                log.warning("instance.reap_failed", instance=old, error=str(exc))

        task = asyncio.create_task(reap())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)



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
