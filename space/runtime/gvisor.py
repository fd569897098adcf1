"""The gVisor driver: ``runsc`` with the systrap platform, the guest daemon as PID 1.

The guest's stdin/stdout pipes are created here and their host ends handed to a per-instance shim
(``space.runtime.shim``) that outlives the node agent; the guest ends go to ``runsc run --detach``,
which the root helper's ``runtime.*`` verbs run (:mod:`space.node.helper.verbs_runtime`: they write
the OCI spec from this driver's scalars and keep runsc's global flags fixed). The cgroup freezer and
CPU weight writes stay here, through :mod:`space.runtime.cgroups` (v1 or v2): they are on the claim
hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import structlog

from space import childenv
from space.errors import InvalidPath, RuntimeFailure
from space.node.helper import privileged
from space.node.helper.backend import Privileged
from space.runtime.base import InstanceHandle, InstanceSpec
from space.runtime.cgroups import Cgroups, host

log = structlog.get_logger("space.runtime.gvisor")

SHIM_PIDFILE = "shim.pid"
#: Left in the instance's workdir by its shim when it froze the instance (the lease ran out).
FENCE_MARK = "fenced"
#: How long :meth:`GVisorDriver.hold` waits for the kernel to stop every task of the instance.
HOLD_WAIT = 2.0


class GVisorDriver:
    name = "gvisor"

    def __init__(self, priv: Privileged, pool_root: Path, *, runsc: str = "runsc",
                 lease_file: Path | None = None, cgroups: Cgroups | None = None) -> None:
        self.priv = priv
        #: Where the instances' cgroup files are (None: this host's, detected once).
        self.cgroups = cgroups if cgroups is not None else host()
        self.pool_root = pool_root
        self.runsc = runsc
        #: Where the node agent publishes its lease's end: each shim freezes its instance once it
        #: passes (space.runtime.shim.LeaseWatch). None: the node has no lease (``space serve``).
        self.lease_file = lease_file

    async def version(self) -> str:
        res = await privileged.run(self.runsc, "--version")  # needs no privilege
        return res.text.splitlines()[0] if res.stdout else "unknown"

    def _snapshot_of(self, image: Path) -> tuple[str, str]:
        """(sandbox, snapshot) of a memory image directory ``sandboxes/<s>/snapshots/<n>/checkpoint``."""
        try:
            parts = image.relative_to(self.pool_root).parts
        except ValueError:
            parts = ()
        if len(parts) != 5 or parts[0] != "sandboxes" or parts[2] != "snapshots" or parts[4] != "checkpoint":
            raise InvalidPath(f"{image} is not a snapshot's memory image in the pool")
        return parts[1], parts[3]

    async def start(self, spec: InstanceSpec) -> InstanceHandle:
        return await self._launch(spec, None)

    async def restore(self, spec: InstanceSpec, image: Path) -> InstanceHandle:
        # A restore gets the restoring process's stdio as the guest's fresh stdin/stdout pipes
        # (RUNTIME_NOTES), so the new shim holds the channel exactly as after a cold start.
        return await self._launch(spec, self._snapshot_of(image))

    async def _launch(self, spec: InstanceSpec, image: tuple[str, str] | None) -> InstanceHandle:
        if spec.rootfs != self.pool_root / "sandboxes" / spec.sandbox_id / "rootfs":
            raise InvalidPath(f"{spec.rootfs} is not the root of sandbox {spec.sandbox_id}")
        spec.workdir.mkdir(parents=True, exist_ok=True)
        channel = spec.channel_dir / f"{spec.instance_id}.sock"
        with contextlib.suppress(FileNotFoundError):
            channel.unlink()
        args = {"kind": "run" if image is None else "restore", "sandbox": spec.sandbox_id,
                "instance": spec.instance_id, "cpu": spec.cpu, "memory_mb": spec.memory_mb,
                "cpu_shares": spec.cpu_shares, "net": spec.net_index}
        if image is not None:
            args["image_sandbox"], args["image_snapshot"] = image

        to_guest_r, to_guest_w = os.pipe()
        from_guest_r, from_guest_w = os.pipe()
        try:
            # A fork+exec of a tiny process: quicker inline than through a thread.
            shim = subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-s", "-S", "-m", "space.runtime.shim",
                 "--socket", str(channel),
                 "--to-guest-fd", str(to_guest_w),
                 "--from-guest-fd", str(from_guest_r),
                 "--pidfile", str(spec.workdir / SHIM_PIDFILE),
                 *self._fence_args(spec)],
                pass_fds=(to_guest_w, from_guest_r),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(spec.workdir / "shim.log", "ab"),  # noqa: SIM115, ASYNC230 -- handed to the child
                start_new_session=True,  # survives the node agent
                cwd="/",
                env=childenv.build("shim", {"PYTHONPATH": _package_root()}),
            )
            args["shim_pid"] = shim.pid  # the helper moves it out of this process's cgroups
            guest_log = open(spec.workdir / "guest.log", "ab")  # noqa: SIM115, ASYNC230
            try:
                await self.priv.call("runtime.launch", args, fds={
                    "stdin": to_guest_r, "stdout": from_guest_w, "stderr": guest_log.fileno()})
            except RuntimeFailure as exc:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(shim.pid, signal.SIGTERM)
                tail = _tail(spec.workdir / "guest.log")
                raise RuntimeFailure(f"{exc.message}: {tail}", instance=spec.instance_id) from None
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(shim.pid, signal.SIGTERM)
                raise
            finally:
                guest_log.close()
        finally:
            for fd in (to_guest_r, to_guest_w, from_guest_r, from_guest_w):
                os.close(fd)
        log.info(f"instance.{'started' if image is None else 'restored'}", instance=spec.instance_id,
                 shim_pid=shim.pid)
        return InstanceHandle(instance_id=spec.instance_id, channel=channel, shim_pid=shim.pid)

    def _fence_args(self, spec: InstanceSpec) -> list[str]:
        if self.lease_file is None:
            return []
        return ["--lease-file", str(self.lease_file),
                "--freeze-file", str(self.cgroups.freeze_file(spec.instance_id)),
                "--freeze-value", self.cgroups.freeze_value(True),
                "--fence-mark", str(spec.workdir / FENCE_MARK)]

    def take_fence_mark(self, workdir: Path) -> bool:
        """Whether the instance's shim froze it because the node's lease ran out (and forget that)."""
        try:
            (workdir / FENCE_MARK).unlink()
        except FileNotFoundError:
            return False
        return True

    async def pause(self, instance_id: str) -> None:
        await self.priv.call("runtime.pause", {"instance": instance_id})
        # `runsc pause` stops the guest but the sentry keeps polling (~30 ms of CPU per second on
        # systrap); frozen as well, a paused sandbox costs nothing until it is resumed.
        self.freeze(instance_id)

    async def resume(self, instance_id: str) -> None:
        self.thaw(instance_id)
        await self.priv.call("runtime.resume", {"instance": instance_id})

    async def hold(self, instance_id: str) -> None:
        # One write and the kernel's freeze: ~1 ms against `runsc pause`'s ~25 ms (a process of
        # its own and a round trip to the sentry), the share a pause was waiting on.
        self.freeze(instance_id)
        deadline = time.monotonic() + HOLD_WAIT
        delay = 0.0002
        while not self._fully_frozen(instance_id):
            if time.monotonic() > deadline:
                # A task in an uninterruptible wait (disk I/O) stops when it returns; none runs.
                log.warning("instance.freeze_slow", instance=instance_id, waited_s=HOLD_WAIT)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _fully_frozen(self, instance_id: str) -> bool:
        try:
            return self.cgroups.fully_frozen(instance_id)
        except FileNotFoundError:
            return True  # the instance is gone: nothing of it runs

    async def checkpoint(self, instance_id: str, image: Path) -> None:
        """Save the instance's memory into ``image`` and leave it as it was (running or paused)."""
        sandbox, snapshot = self._snapshot_of(image)
        frozen = self._frozen(instance_id)
        if frozen:  # a paused sandbox: the sentry must answer (it stays paused by runsc meanwhile)
            self.thaw(instance_id)
        try:
            await self.priv.call("runtime.checkpoint",
                                 {"instance": instance_id, "sandbox": sandbox, "snapshot": snapshot})
        finally:
            if frozen:
                self.freeze(instance_id)

    def set_cpu_shares(self, instance_id: str, shares: int) -> None:
        # One small cgroup write, synchronous on purpose: it is on the create hot path (a claim),
        # and awaiting a thread would cost more than the write.
        try:
            self.cgroups.set_cpu_weight(instance_id, shares)
        except OSError as exc:
            log.warning("instance.cpu_shares_failed", instance=instance_id, error=str(exc))

    def freeze(self, instance_id: str) -> None:
        # The freezer, not `runsc pause`: a paused systrap sandbox still burns ~30 ms of CPU per
        # second polling (docs/notes/density.md); a frozen one burns none.
        self._freezer(instance_id, frozen=True)

    def thaw(self, instance_id: str) -> None:
        self._freezer(instance_id, frozen=False)

    def _frozen(self, instance_id: str) -> bool:
        return self.cgroups.is_frozen(instance_id)

    def _freezer(self, instance_id: str, *, frozen: bool) -> None:
        try:
            if frozen:
                self.cgroups.freeze(instance_id)
            else:
                self.cgroups.thaw(instance_id)
        except FileNotFoundError:
            pass  # the instance is gone (or never had its cgroup): nothing to freeze or thaw
        except OSError as exc:
            log.warning("instance.freezer_failed", instance=instance_id, frozen=frozen, error=str(exc))

    async def kill(self, instance_id: str, workdir: Path) -> None:
        """Kill every process of the instance now (fast); :meth:`stop` still has to remove it."""
        await _stop_shim(workdir)
        await self.priv.call("runtime.kill", {"instance": instance_id})

    async def stop(self, instance_id: str, workdir: Path) -> None:
        await _stop_shim(workdir)
        await self.priv.call("runtime.delete", {"instance": instance_id})

    async def state(self, instance_id: str) -> str | None:
        status = (await self.priv.call("runtime.state", {"instance": instance_id}))["status"]
        return None if status is None else str(status)

    async def death_cause(self, instance_id: str) -> str | None:
        # The host OOM killer takes the whole sandbox (RUNTIME_NOTES); its memcg counts the kill and
        # outlives the instance until `runsc delete`.
        return "oom" if self.cgroups.oom_kills(instance_id) > 0 else None

    async def list_instances(self) -> dict[str, str]:
        instances = (await self.priv.call("runtime.list"))["instances"]
        return {str(k): str(v) for k, v in instances.items()}

    async def sweep(self, keep: set[str]) -> list[str]:
        return [str(i) for i in (await self.priv.call("runtime.sweep", {"keep": sorted(keep)}))["killed"]]


def _package_root() -> str:
    # The shim runs with -S (no site-packages) and imports only space.runtime.shim and the stdlib.
    return str(Path(__file__).resolve().parents[2])


def _kill_pidfile(pidfile: Path) -> int | None:
    """SIGTERM the shim named by ``pidfile``; its pid, or None when there is none to signal."""
    try:
        pid = int(pidfile.read_text().strip())
        # Never signal a recycled pid: it must still be our shim.
        if b"space.runtime.shim" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return None
    return pid


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")  # a zombie is gone: it only waits to be reaped


async def _stop_shim(workdir: Path, wait: float = 2.0) -> None:
    """Stop the instance's shim and wait (bounded) until it is gone: a shim fences its instance
    when the node's lease runs out, and must not freeze it while runsc kills or removes it (a
    frozen sentry cannot take the kill)."""
    pid = _kill_pidfile(workdir / SHIM_PIDFILE)
    deadline = time.monotonic() + wait
    while pid is not None and _running(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


def _tail(path: Path, n: int = 800) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return ""
