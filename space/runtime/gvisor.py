"""The gVisor driver: ``runsc`` with the systrap platform, the guest daemon as PID 1.

The guest's stdin/stdout pipes are created here and their host ends handed to a per-instance shim
(``space.runtime.shim``) that outlives the node agent; ``runsc run --detach`` gets the guest ends.
Every runsc call gets the same global flags (RUNTIME_NOTES: a restore with different flags returns 0
and the sandbox then dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import structlog

from space.errors import InsufficientStorage, RuntimeFailure
from space.node import privileged
from space.runtime.base import InstanceHandle, InstanceSpec
from space.runtime.oci import build_spec

log = structlog.get_logger("space.runtime.gvisor")

SHIM_PIDFILE = "shim.pid"

#: runsc 20240729 refuses --network=sandbox in any namespace on this kernel: its "root network
#: namespace" test looks for a file under /proc/sys/net that newer kernels show in every namespace
#: (gVisor #10704). A private mount namespace with an empty read-only /proc/sys/net hides it from
#: the runsc process that sets the sandbox up (RUNTIME_NOTES); the sandbox itself is unaffected.
NETSTACK_WRAPPER = (
    "unshare", "--mount", "--propagation", "private", "sh", "-c",
    'mount -t tmpfs -o ro,size=4k tmpfs /proc/sys/net && exec "$@"', "runsc-netstack",
)


class GVisorDriver:
    name = "gvisor"

    def __init__(self, state_root: Path, *, runsc: str = "runsc", platform: str = "systrap") -> None:
        self.state_root = state_root
        self.runsc = runsc
        # --overlay2=none keeps guest writes in the btrfs root (so snapshots see them).
        # --network=sandbox: the guest gets gVisor's own network stack on its namespace's link.
        self.global_flags = [
            f"--root={state_root}",
            f"--platform={platform}",
            "--overlay2=none",
            "--network=sandbox",
        ]
        state_root.mkdir(parents=True, exist_ok=True)

    def _cmd(self, *args: str) -> list[str]:
        return [self.runsc, *self.global_flags, *args]

    async def version(self) -> str:
        res = await privileged.run(self.runsc, "--version")
        return res.text.splitlines()[0] if res.stdout else "unknown"

    async def start(self, spec: InstanceSpec) -> InstanceHandle:
        return await self._launch(spec, "run", [])

    async def restore(self, spec: InstanceSpec, image: Path) -> InstanceHandle:
        # A restore gets the restoring process's stdio as the guest's fresh stdin/stdout pipes
        # (RUNTIME_NOTES), so the new shim holds the channel exactly as after a cold start.
        return await self._launch(spec, "restore", ["--image-path", str(image)])

    async def _launch(self, spec: InstanceSpec, verb: str, extra: list[str]) -> InstanceHandle:
        spec.workdir.mkdir(parents=True, exist_ok=True)
        bundle = spec.workdir / "bundle"
        bundle.mkdir(exist_ok=True)
        (bundle / "config.json").write_text(json.dumps(build_spec(spec)))
        channel = spec.channel_dir / f"{spec.instance_id}.sock"
        with contextlib.suppress(FileNotFoundError):
            channel.unlink()

        to_guest_r, to_guest_w = os.pipe()
        from_guest_r, from_guest_w = os.pipe()
        try:
            # A fork+exec of a tiny process: quicker inline than through a thread.
            shim = subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-s", "-S", "-m", "space.runtime.shim",
                 "--socket", str(channel),
                 "--to-guest-fd", str(to_guest_w),
                 "--from-guest-fd", str(from_guest_r),
                 "--pidfile", str(spec.workdir / SHIM_PIDFILE)],
                pass_fds=(to_guest_w, from_guest_r),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(spec.workdir / "shim.log", "ab"),  # noqa: SIM115, ASYNC230 -- handed to the child
                start_new_session=True,  # survives the node agent
                cwd="/",
                env=_shim_env(),
            )
            guest_log = open(spec.workdir / "guest.log", "ab")  # noqa: SIM115, ASYNC230
            try:
                proc = await asyncio.create_subprocess_exec(
                    *NETSTACK_WRAPPER,
                    *self._cmd(verb, "--detach", *extra, "--bundle", str(bundle),
                               "--pid-file", str(spec.workdir / "sandbox.pid"), spec.instance_id),
                    stdin=to_guest_r,
                    stdout=from_guest_w,
                    stderr=guest_log,
                    start_new_session=True,
                )
                rc = await proc.wait()
            finally:
                guest_log.close()
        finally:
            for fd in (to_guest_r, to_guest_w, from_guest_r, from_guest_w):
                os.close(fd)
        if rc != 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(shim.pid, signal.SIGTERM)
            tail = _tail(spec.workdir / "guest.log")
            # A failed restore can leave a half-made container behind: never leave it.
            await privileged.run(*self._cmd("delete", "--force", spec.instance_id), check=False, timeout=60)
            raise RuntimeFailure(f"runsc {verb} failed (exit {rc}): {tail}", instance=spec.instance_id)
        log.info(f"instance.{'started' if verb == 'run' else 'restored'}", instance=spec.instance_id,
                 shim_pid=shim.pid)
        return InstanceHandle(instance_id=spec.instance_id, channel=channel, shim_pid=shim.pid)

    async def pause(self, instance_id: str) -> None:
        await privileged.run(*self._cmd("pause", instance_id), timeout=60)
        # `runsc pause` stops the guest but the sentry keeps polling (~30 ms of CPU per second on
        # systrap); frozen as well, a paused sandbox costs nothing until it is resumed.
        self.freeze(instance_id)

    async def resume(self, instance_id: str) -> None:
        self.thaw(instance_id)
        await privileged.run(*self._cmd("resume", instance_id), timeout=60)

    async def checkpoint(self, instance_id: str, image: Path) -> None:
        """Save the instance's memory into ``image`` and leave it as it was (running or paused).

        A failed ``--leave-running`` checkpoint leaves the sandbox alive (RUNTIME_NOTES); a plain one
        would kill it, which is why we never use it.
        """
        image.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 -- one mkdir
        frozen = self._frozen(instance_id)
        if frozen:  # a paused sandbox: the sentry must answer (it stays paused by runsc meanwhile)
            self.thaw(instance_id)
        try:
            await privileged.run(*self._cmd("checkpoint", "--leave-running", "--image-path", str(image),
                                            instance_id), timeout=1800)
        except RuntimeFailure as exc:
            if "no space left" in f"{exc.message} {exc.details.get('stderr', '')}".lower():
                raise InsufficientStorage(f"no room in the pool for the memory image of {instance_id}",
                                          instance=instance_id) from None
            raise
        finally:
            if frozen:
                self.freeze(instance_id)

    def set_cpu_shares(self, instance_id: str, shares: int) -> None:
        # One small cgroup write, synchronous on purpose: it is on the create hot path (a claim),
        # and awaiting a thread would cost more than the write.
        path = Path("/sys/fs/cgroup/cpu/space") / instance_id / "cpu.shares"
        try:
            path.write_text(str(shares))
        except OSError as exc:
            log.warning("instance.cpu_shares_failed", instance=instance_id, error=str(exc))

    def freeze(self, instance_id: str) -> None:
        # The freezer, not `runsc pause`: a paused systrap sandbox still burns ~30 ms of CPU per
        # second polling (docs/notes/density.md); a frozen one burns none.
        self._freezer(instance_id, "FROZEN")

    def thaw(self, instance_id: str) -> None:
        self._freezer(instance_id, "THAWED")

    def _frozen(self, instance_id: str) -> bool:
        try:
            return (_FREEZER / instance_id / "freezer.state").read_text().strip() != "THAWED"
        except OSError:
            return False

    @staticmethod
    def _has_processes(instance_id: str) -> bool:
        try:
            return bool((_FREEZER / instance_id / "cgroup.procs").read_text().strip())
        except OSError:
            return False

    def _recorded_status(self, instance_id: str) -> str:
        for f in self.state_root.glob(f"*_sandbox:{instance_id}.state"):
            try:
                return str(json.loads(f.read_text()).get("status") or "running")
            except (OSError, ValueError):
                break
        return "running"

    def _instances_on_disk(self) -> set[str]:
        """Container ids runsc keeps state for under our root (``<sandbox>_sandbox:<id>.state``)."""
        try:
            names = [p.name for p in self.state_root.iterdir()]
        except FileNotFoundError:
            return set()
        return {n.removesuffix(".state").partition("_sandbox:")[2] for n in names
                if n.endswith(".state") and "_sandbox:" in n}

    def _freezer(self, instance_id: str, state: str) -> None:
        path = _FREEZER / instance_id / "freezer.state"
        try:
            path.write_text(state)
        except FileNotFoundError:
            pass  # the instance is gone (or never had its cgroup): nothing to freeze or thaw
        except OSError as exc:
            log.warning("instance.freezer_failed", instance=instance_id, state=state, error=str(exc))

    async def kill(self, instance_id: str) -> None:
        """Kill every process of the instance now (fast); :meth:`stop` still has to remove it."""
        self.thaw(instance_id)  # a frozen sentry cannot take the kill
        await privileged.run(*self._cmd("kill", "--all", instance_id, "KILL"), check=False, timeout=30)

    async def stop(self, instance_id: str, workdir: Path) -> None:
        # Killing first makes delete fast; both are idempotent for a missing container.
        self.thaw(instance_id)
        await privileged.run(*self._cmd("kill", "--all", instance_id, "KILL"), check=False, timeout=30)
        res = await privileged.run(*self._cmd("delete", "--force", instance_id), check=False, timeout=60)
        if res.returncode != 0 and await self.state(instance_id) is not None:
            raise RuntimeFailure(f"runsc delete failed: {res.stderr.decode(errors='replace').strip()[-500:]}",
                                 instance=instance_id)
        _kill_pidfile(workdir / SHIM_PIDFILE)

    async def state(self, instance_id: str) -> str | None:
        if self._frozen(instance_id):
            # `runsc state` asks the sandbox, and a frozen one cannot answer: its cgroup can say
            # whether it lives, and runsc's own record whether it was paused (or is a warm one).
            return self._recorded_status(instance_id) if self._has_processes(instance_id) else None
        res = await privileged.run(*self._cmd("state", instance_id), check=False, timeout=30)
        if res.returncode != 0:
            return None
        try:
            return str(json.loads(res.text).get("status", "unknown"))
        except ValueError:
            return "unknown"

    async def death_cause(self, instance_id: str) -> str | None:
        # The host OOM killer takes the whole sandbox (RUNTIME_NOTES); its memcg counts the kill and
        # outlives the instance until `runsc delete`.
        oom = Path("/sys/fs/cgroup/memory/space") / instance_id / "memory.oom_control"
        try:
            for line in oom.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return "oom"
        except (OSError, ValueError):
            pass
        return None

    async def list_instances(self) -> dict[str, str]:
        known = self._instances_on_disk()
        if any(self._frozen(i) for i in known):
            # `runsc list` would wait on the frozen ones forever: ask one by one instead.
            out = {}
            for i in sorted(known):
                st = await self.state(i)
                if st is not None:
                    out[i] = st
            return out
        res = await privileged.run(*self._cmd("list", "--format=json"), check=False, timeout=30)
        if res.returncode != 0 or not res.text.strip():
            return {}
        try:
            items = json.loads(res.text) or []
        except ValueError:
            return {}
        return {str(i["id"]): str(i.get("status", "unknown")) for i in items}


#: The freezer cgroups of our instances (cgroupsPath ``/space/<instance>`` in the OCI spec).
_FREEZER = Path("/sys/fs/cgroup/freezer/space")


def _shim_env() -> dict[str, str]:
    # The shim imports only space.runtime.shim and the stdlib: give it the package path, nothing else.
    pkg_root = str(Path(__file__).resolve().parents[2])
    return {"PYTHONPATH": pkg_root, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def _kill_pidfile(pidfile: Path) -> None:
    try:
        pid = int(pidfile.read_text().strip())
        # Never signal a recycled pid: it must still be our shim.
        if b"space.runtime.shim" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return
    except (OSError, ValueError):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)


def _tail(path: Path, n: int = 800) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return ""
