"""Privileged runtime verbs: ``runsc`` run/restore/pause/resume/checkpoint/kill/delete/state/list.

The helper, not its caller, writes the OCI spec a sandbox runs with (``space.runtime.oci``): the
caller gives scalars -- sandbox and instance ids, CPU, memory, a network index, a snapshot to
restore -- and the helper derives the root, the guest mount, the network namespace and the cgroup
from them, so no caller can make runsc bind-mount a host path into a sandbox or join a foreign
namespace. Bundles live in ``<data>/bundles/<instance>`` (root only). Every verb on an existing
instance needs its exact id on disk (runsc would otherwise accept a unique prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from space.errors import Conflict, InsufficientStorage, InvalidPath, InvalidRequest, NotFound, RuntimeFailure
from space.node.helper import placement, privileged
from space.node.helper.verbs import Call, HelperContext, check, is_id, verb
from space.node.helper.verbs_net import MAX_INDEX, NodeNet
from space.runtime.base import InstanceSpec
from space.runtime.cgroups import Cgroups, host
from space.runtime.oci import build_spec

log = structlog.get_logger(__name__)

INSTANCE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,100}-[a-z0-9]{5}")
#: How runsc is started for ``run`` and ``restore``, in a private mount namespace of its own:
#: - runsc 20240729 refuses --network=sandbox in any namespace on this kernel: its "root network
#:   namespace" test looks for a file under /proc/sys/net that newer kernels show in every
#:   namespace (gVisor #10704); an empty read-only /proc/sys/net hides it (RUNTIME_NOTES);
#: - the sandbox's root is bind-mounted onto the bundle from the descriptor the helper opened and
#:   checked (``$1``), then that descriptor is closed: runsc never walks the agent-owned path, so a
#:   directory swapped for a symlink after the check cannot become a sandbox's root.
#: Both mounts live only in that namespace (the sandbox's processes keep it; the host never sees it).
LAUNCHER = (
    "unshare", "--mount", "--propagation", "private", "bash", "-c",
    'root=$1 bundle=$2; shift 2; mount -t tmpfs -o ro,size=4k tmpfs /proc/sys/net'
    ' && mount --bind "/proc/self/fd/$root" "$bundle/rootfs" && exec {root}<&- "$@"',
    "runsc-launch",
)
_SUBVOLUME_INO = 256


def is_instance(value: str) -> bool:
    return INSTANCE_RE.fullmatch(value) is not None


class Runsc:
    """runsc with the node's fixed global flags (a restore with other flags returns 0 and the
    sandbox then dies: RUNTIME_NOTES)."""

    def __init__(self, ctx: HelperContext) -> None:
        self.root = ctx.data_dir / "runsc"
        self.bundles = ctx.data_dir / "bundles"
        self.argv0 = ctx.runsc
        #: The instances' cgroups (cgroupsPath ``/space/<instance>`` in the OCI spec), v1 or v2.
        self.cgroups = ctx.cgroups if ctx.cgroups is not None else host()
        self.flags = [f"--root={self.root}", f"--platform={ctx.platform}",
                      # keeps guest writes in the btrfs root, so snapshots see them
                      "--overlay2=none",
                      # the guest gets gVisor's own network stack on its namespace's link
                      "--network=sandbox"]

    def cmd(self, *args: str) -> list[str]:
        return [self.argv0, *self.flags, *args]

    def known(self) -> set[str]:
        """Container ids runsc keeps state for under our root (``<sandbox>_sandbox:<id>.state``)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return set()
        return {n.removesuffix(".state").partition("_sandbox:")[2] for n in names
                if n.endswith(".state") and "_sandbox:" in n}

    def exists(self, instance: str) -> bool:
        return (self.root / f"{instance}_sandbox:{instance}.state").exists()

    def recorded_status(self, instance: str) -> str:
        try:
            return str(json.loads((self.root / f"{instance}_sandbox:{instance}.state").read_text())
                       .get("status") or "running")
        except (OSError, ValueError):
            return "running"


#: The names runsc gives the processes it leaves running: a sandbox's sentry and its gofer.
_RUNSC_PROCESSES = ("runsc-sandbox", "runsc-gofer")


def runsc_processes(r: Runsc) -> dict[int, str]:
    """pid -> instance of every sentry and gofer under this node's runsc root, found in /proc.

    runsc finds only the instances it has a state file for. A launch cut short after runsc started
    the sandbox but before it wrote that file leaves a sentry and gofer no ``runsc`` command knows;
    the sentry holds the guest log open in the pool, so the pool can then not be unmounted."""
    root_flag, bundle_flag = f"--root={r.root}", f"--bundle={r.bundles}/"
    found: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "cmdline"), "rb") as f:
                argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if not argv or argv[0] not in _RUNSC_PROCESSES or root_flag not in argv:
            continue
        bundled = [a.removeprefix(bundle_flag) for a in argv if a.startswith(bundle_flag)]
        instance = bundled[0] if bundled else argv[-1]
        if is_instance(instance):
            found[int(entry.name)] = instance
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie holds no files and no mounts any more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


async def kill_strays(r: Runsc, *, only: Collection[str] | None = None, keep: Collection[str] = ()) -> list[str]:
    """SIGKILL the sentries and gofers of instances in ``only`` (None: every instance) that are not
    in ``keep``, wait until they are gone and remove their cgroups (and the empty cgroups of every
    instance in ``only``); the instances whose processes it killed."""
    victims = {pid: inst for pid, inst in runsc_processes(r).items()
               if (only is None or inst in only) and inst not in keep}
    kill_thawed(r.cgroups, victims)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while (left := [p for p in victims if _alive(p)]) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    instances = sorted(set(victims.values()))
    # A cgroup goes only once its last task has been reaped, which its new parent does when it will.
    while _remove_cgroups(r.cgroups, instances) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if only is not None:
        # runsc makes the cgroups before it starts the sentry: a start killed in between leaves
        # them empty, and no runsc command removes them.
        _remove_cgroups(r.cgroups, sorted(set(only) - set(instances)))
    if victims:
        log.warning("runtime.strays_killed", instances=instances, pids=sorted(victims), left=left)
    return instances


def kill_thawed(cgroups: Cgroups, victims: Mapping[int, str]) -> None:
    """SIGKILL each pid, then thaw its instance's cgroup: a task frozen by the v1 freezer (a sandbox
    its shim fenced when the node's lease ran out) dies of its SIGKILL only once thawed, and would
    otherwise outlive a node's teardown (v2 lets a fatal signal through a freeze; thawing there
    costs one write). Killed first, so that thawed it runs nothing of its own."""
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    for inst in sorted(set(victims.values())):
        _thaw(cgroups, inst)


def _remove_cgroups(cgroups: Cgroups, instances: list[str]) -> list[Path]:
    """Remove the instances' cgroups; those still busy."""
    busy = []
    for inst in instances:
        for group in cgroups.instance_groups(inst):
            try:
                group.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # a task is still in it
                busy.append(group)
    return busy


def _thaw(cgroups: Cgroups, instance: str) -> None:
    with contextlib.suppress(OSError):
        cgroups.thaw(instance)


def open_dir(base: Path | int, *parts: str, subvolume: bool = False, flags: int = os.O_PATH) -> int:
    """A descriptor of ``base/parts...`` (``O_PATH`` unless ``flags`` say otherwise), walked one
    component at a time without following a symlink: every component must be a real directory
    (the last a subvolume root when asked). ``base`` is a path or a directory descriptor. The
    caller closes it.

    There is deliberately no variant that returns a path: the agent owns the plain directories of
    the pool and may swap any of them for a symlink the moment a check is done, so what was checked
    is handed on as this descriptor (to a tool as ``/proc/self/fd/N``, to ``*at`` calls as a dir fd),
    never as a name root would walk again.
    """
    if isinstance(base, int):
        fd = os.dup(base)
        os.set_inheritable(fd, False)
    else:
        fd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            mode = flags if i == len(parts) - 1 else os.O_PATH
            try:
                nxt = os.open(part, mode | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                raise NotFound(f"{'/'.join(parts)} does not exist in the pool") from None
            except (NotADirectoryError, OSError):
                raise InvalidPath(f"{'/'.join(parts)}: {part} is not a directory") from None
            os.close(fd)
            fd = nxt
        if not parts and flags != os.O_PATH:
            raise ValueError("open_dir: flags apply to the last component; give at least one")
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or (subvolume and st.st_ino != _SUBVOLUME_INO):
            raise InvalidPath(f"{'/'.join(parts)} is not a subvolume")
    except BaseException:
        os.close(fd)
        raise
    return fd


def fd_path(fd: int) -> str:
    """How a tool run with ``pass_fds=(fd,)`` names what ``fd`` is open on (a magic link the kernel
    resolves to that very directory, whatever was renamed or swapped since)."""
    return f"/proc/self/fd/{fd}"


def _existing(r: Runsc, instance: str) -> None:
    if not r.exists(instance):
        raise NotFound(f"runtime instance {instance} not found", instance=instance)


@dataclass(frozen=True)
class InstanceArgs:
    instance: str = field(metadata=check(is_instance, "an instance id"))


@dataclass(frozen=True)
class LaunchArgs:
    kind: str = field(metadata=check(lambda v: v in ("run", "restore"), "run or restore"))
    sandbox: str = field(metadata=check(is_id, "a sandbox id"))
    instance: str = field(metadata=check(is_instance, "an instance id"))
    cpu: float = field(metadata=check(lambda v: 0.01 <= v <= 64, "0.01..64"))
    memory_mb: int = field(metadata=check(lambda v: 64 <= v <= 1 << 20, "64..1048576"))
    cpu_shares: int | None = field(default=None, metadata=check(lambda v: 2 <= v <= 262144, "2..262144"))
    net: int | None = field(default=None, metadata=check(lambda v: 1 <= v <= MAX_INDEX, f"1..{MAX_INDEX}"))
    #: restore: the snapshot whose memory image to restore (``sandboxes/<sandbox>/snapshots/<snapshot>``)
    image_sandbox: str | None = field(default=None, metadata=check(is_id, "a sandbox id"))
    image_snapshot: str | None = field(default=None, metadata=check(is_id, "a snapshot id"))
    #: The instance's shim (the caller's child), moved out of the caller's cgroups first (placement).
    shim_pid: int | None = field(default=None, metadata=check(lambda v: 1 < v < 1 << 22, "a pid"))


@verb("runtime.launch", LaunchArgs, cap=300, fds=("stdin", "stdout", "stderr"))
async def runtime_launch(ctx: HelperContext, a: LaunchArgs, call: Call) -> dict[str, Any]:
    """Boot (``run``) or restore an instance of ``sandbox`` over its root, the guest's pipes and log
    as the passed fds; it lives on in runsc's own sessions."""
    r = Runsc(ctx)
    if not a.instance.startswith(a.sandbox + "-"):
        raise Conflict(f"instance {a.instance} is not one of sandbox {a.sandbox}")
    if any(k == a.instance or k.startswith(a.instance) or a.instance.startswith(k) for k in r.known()):
        raise Conflict(f"instance id {a.instance} collides with an existing one", instance=a.instance)
    if set(call.fds) != {"stdin", "stdout", "stderr"}:
        raise InvalidRequest("runtime.launch needs the fds stdin, stdout and stderr")
    restore = a.kind == "restore"
    if restore != (a.image_sandbox is not None and a.image_snapshot is not None):
        raise InvalidRequest("a restore and only a restore names its image (image_sandbox, image_snapshot)")
    if a.shim_pid is not None:
        _place_shim(ctx, a.shim_pid, call.peer_pid)
    held = [open_dir(ctx.pool, "sandboxes", a.sandbox, "rootfs", subvolume=True)]
    try:
        if restore:
            assert a.image_sandbox is not None and a.image_snapshot is not None
            held.append(open_dir(ctx.pool, "sandboxes", a.image_sandbox, "snapshots", a.image_snapshot,
                                 "checkpoint"))
        return await _launch(ctx, r, a, call, held[0], held[1] if restore else None)
    finally:
        for fd in held:
            os.close(fd)


def _place_shim(ctx: HelperContext, pid: int, caller: int) -> None:
    """The shim out of the agent's cgroups, so that the sandbox outlives whatever stops the agent
    by its cgroup. A host that refuses (a private cgroup namespace) still runs the sandbox: it
    then lives only as long as the agent's cgroup, and says so."""
    placement.check_shim(pid, parent=caller, uid=0 if ctx.agent_uid is None else ctx.agent_uid)
    try:
        placement.place_shim(pid)
    except RuntimeFailure as exc:
        log.warning("runtime.shim_not_placed", pid=pid, error=exc.message,
                    consequence="the sandbox stops with the node agent's cgroup")


async def _launch(ctx: HelperContext, r: Runsc, a: LaunchArgs, call: Call, rootfs_fd: int,
                  image_fd: int | None) -> dict[str, Any]:
    # The memory image as the descriptor checked above: runsc resolves the magic link to it.
    extra = ["--image-path", fd_path(image_fd)] if image_fd is not None else []
    netns = Path(f"/var/run/netns/{NodeNet(ctx).sandbox(a.net)['netns']}") if a.net is not None else None
    for d in (r.root, r.bundles):  # runsc's state and the specs: root's alone
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)
    bundle = r.bundles / a.instance
    shutil.rmtree(bundle, ignore_errors=True)
    bundle.mkdir(mode=0o700)
    (bundle / "rootfs").mkdir(mode=0o700)  # the mount point of the root (see LAUNCHER)
    spec = InstanceSpec(sandbox_id=a.sandbox, instance_id=a.instance, rootfs=bundle / "rootfs", workdir=bundle,
                        guest_dir=ctx.guest, channel_dir=bundle, cpu=a.cpu, memory_mb=a.memory_mb,
                        hostname=a.sandbox[:12], cpu_shares=a.cpu_shares, netns=netns)
    (bundle / "config.json").write_text(json.dumps(build_spec(spec)))
    argv = [*LAUNCHER, str(rootfs_fd), str(bundle),
            *r.cmd(a.kind, "--detach", *extra, "--bundle", str(bundle),
                   "--pid-file", str(bundle / "sandbox.pid"), a.instance)]
    proc = await privileged.spawn(
        *argv, stdin=call.fds["stdin"], stdout=call.fds["stdout"], stderr=call.fds["stderr"],
        start_new_session=True, pass_fds=(rootfs_fd,) if image_fd is None else (rootfs_fd, image_fd))
    try:
        rc = await proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await asyncio.shield(_delete(r, a.instance))
        raise
    if rc != 0:
        # A failed restore can leave a half-made container behind: never leave it.
        await _delete(r, a.instance)
        raise RuntimeFailure(f"runsc {a.kind} failed (exit {rc})", instance=a.instance, returncode=rc)
    _delegate_cgroup(ctx, r.cgroups, a.instance)
    pid = (bundle / "sandbox.pid").read_text().strip()
    return {"instance": a.instance, "sandbox_pid": int(pid) if pid.isdigit() else None}


def _delegate_cgroup(ctx: HelperContext, cgroups: Cgroups, instance: str) -> None:
    """The instance's cgroup files the agent writes itself (freezer and CPU weight: v1's
    ``freezer.state`` and ``cpu.shares``, v2's ``cgroup.freeze`` and ``cpu.weight``) to its uid:
    freezing, thawing and re-weighting are on the claim hot path, where a helper round trip would
    cost more than the write. The files alone: never a directory, so the agent can make no group."""
    if ctx.agent_uid is None or ctx.agent_uid == 0:
        return
    for path in cgroups.delegated_files(instance):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # no such controller here: the agent's write then fails and is logged
        try:
            os.fchown(fd, ctx.agent_uid, -1)
        finally:
            os.close(fd)


async def _delete(r: Runsc, instance: str) -> int:
    """``runsc delete --force``, then whatever of the instance runsc did not know about."""
    res = await privileged.run(*r.cmd("delete", "--force", instance), check=False, timeout=60)
    await kill_strays(r, only={instance})
    shutil.rmtree(r.bundles / instance, ignore_errors=True)
    return res.returncode


@verb("runtime.pause", InstanceArgs, cap=60)
async def runtime_pause(ctx: HelperContext, a: InstanceArgs, call: Call) -> dict[str, Any]:
    r = Runsc(ctx)
    _existing(r, a.instance)
    await privileged.run(*r.cmd("pause", a.instance), timeout=60)
    return {}


@verb("runtime.resume", InstanceArgs, cap=60)
async def runtime_resume(ctx: HelperContext, a: InstanceArgs, call: Call) -> dict[str, Any]:
    r = Runsc(ctx)
    _existing(r, a.instance)
    await privileged.run(*r.cmd("resume", a.instance), timeout=60)
    return {}


@dataclass(frozen=True)
class CheckpointArgs:
    instance: str = field(metadata=check(is_instance, "an instance id"))
    sandbox: str = field(metadata=check(is_id, "a sandbox id"))
    snapshot: str = field(metadata=check(is_id, "a snapshot id"))


@verb("runtime.checkpoint", CheckpointArgs, cap=1800)
async def runtime_checkpoint(ctx: HelperContext, a: CheckpointArgs, call: Call) -> dict[str, Any]:
    """The instance's memory into ``sandboxes/<sandbox>/snapshots/<snapshot>/checkpoint``, leaving
    it as it was: a failed ``--leave-running`` checkpoint leaves the sandbox alive (RUNTIME_NOTES);
    a plain one would kill it. The caller thaws a frozen instance first."""
    r = Runsc(ctx)
    _existing(r, a.instance)
    if not a.instance.startswith(a.sandbox + "-"):
        raise Conflict(f"instance {a.instance} is not one of sandbox {a.sandbox}")
    snap = open_dir(ctx.pool, "sandboxes", a.sandbox, "snapshots", a.snapshot)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir("checkpoint", 0o750, dir_fd=snap)
        # A real directory, not something planted there; from here on only this descriptor names it.
        image = open_dir(snap, "checkpoint", flags=os.O_RDONLY)
    finally:
        os.close(snap)
    try:
        _check_fresh_image_dir(image, a.snapshot)
    except BaseException:
        os.close(image)
        raise
    try:
        try:
            await privileged.run(*r.cmd("checkpoint", "--leave-running", "--image-path", fd_path(image), a.instance),
                                 timeout=1800, pass_fds=(image,))
        except RuntimeFailure as exc:
            if "no space left" in f"{exc.message} {exc.details.get('stderr', '')}".lower():
                raise InsufficientStorage(f"no room in the pool for the memory image of {a.instance}",
                                          instance=a.instance) from None
            raise
        _give_image(ctx, image)
    finally:
        os.close(image)
    return {}


def _check_fresh_image_dir(image: int, snapshot: str) -> None:
    """runsc writes the image as root by name inside this directory: it must be root's and empty
    (one the agent was given after an earlier checkpoint could hold its symlinks)."""
    st = os.fstat(image)
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise Conflict(f"the image directory of snapshot {snapshot} is not root's alone: a checkpoint goes into a "
                       "fresh one", snapshot=snapshot)
    fresh = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=image)
    try:
        left = os.listdir(fresh)
    finally:
        os.close(fresh)
    if left:
        raise Conflict(f"the image directory of snapshot {snapshot} is not empty", snapshot=snapshot,
                       entries=sorted(left)[:5])


def _give_image(ctx: HelperContext, image: int) -> None:
    """The memory image (the directory ``image`` is open on) to the agent, which ships it (runsc
    wrote it as root, 0644); the sandbox's directory, not the image's mode, keeps everyone else out."""
    if ctx.agent_uid is None or ctx.agent_uid == 0:
        return
    os.fchown(image, ctx.agent_uid, -1)
    # Opened afresh through the descriptor (never by name): btrfs lists through an fd only the
    # entries it had when that fd was opened, and runsc wrote the image after.
    fresh = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=image)
    try:
        for name in os.listdir(fresh):
            st = os.stat(name, dir_fd=fresh, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                os.chown(name, ctx.agent_uid, -1, dir_fd=fresh, follow_symlinks=False)
    finally:
        os.close(fresh)


@verb("runtime.kill", InstanceArgs, cap=30)
async def runtime_kill(ctx: HelperContext, a: InstanceArgs, call: Call) -> dict[str, Any]:
    """Kill every process of the instance now; idempotent."""
    r = Runsc(ctx)
    if r.exists(a.instance):
        _thaw(r.cgroups, a.instance)  # a frozen sentry cannot take the kill
        await privileged.run(*r.cmd("kill", "--all", a.instance, "KILL"), check=False, timeout=30)
    return {}


@verb("runtime.delete", InstanceArgs, cap=90)
async def runtime_delete(ctx: HelperContext, a: InstanceArgs, call: Call) -> dict[str, Any]:
    """Kill and remove the instance and its bundle; idempotent (a missing one is not an error)."""
    r = Runsc(ctx)
    if not r.exists(a.instance):
        killed = await kill_strays(r, only={a.instance})
        shutil.rmtree(r.bundles / a.instance, ignore_errors=True)
        return {"deleted": bool(killed)}
    _thaw(r.cgroups, a.instance)
    await privileged.run(*r.cmd("kill", "--all", a.instance, "KILL"), check=False, timeout=30)
    if await _delete(r, a.instance) != 0 and await _state(r, a.instance) is not None:
        raise RuntimeFailure(f"runsc delete of {a.instance} failed", instance=a.instance)
    return {"deleted": True}


async def _state(r: Runsc, instance: str) -> str | None:
    if not r.exists(instance):
        return None
    if r.cgroups.is_frozen(instance):
        # `runsc state` asks the sandbox, and a frozen one cannot answer: its cgroup says whether
        # it lives, and runsc's own record whether it was paused (or is a warm one).
        return r.recorded_status(instance) if r.cgroups.has_processes(instance) else None
    res = await privileged.run(*r.cmd("state", instance), check=False, timeout=30)
    if res.returncode != 0:
        return None
    try:
        return str(json.loads(res.text).get("status", "unknown"))
    except ValueError:
        return "unknown"


@verb("runtime.state", InstanceArgs, cap=30, audit=False)
async def runtime_state(ctx: HelperContext, a: InstanceArgs, call: Call) -> dict[str, Any]:
    return {"status": await _state(Runsc(ctx), a.instance)}


@dataclass(frozen=True)
class NoArgs:
    pass


@dataclass(frozen=True)
class SweepArgs:
    #: The instances whose processes stay (those the node adopted).
    keep: list[str] = field(default_factory=list, metadata=check(is_instance, "a list of instance ids"))


@verb("runtime.sweep", SweepArgs, cap=60)
async def runtime_sweep(ctx: HelperContext, a: SweepArgs, call: Call) -> dict[str, Any]:
    """Kill the sentries and gofers under this node's runsc root of every instance not in ``keep``
    and not in runsc's own records (those go through ``runtime.delete``); the instances killed."""
    r = Runsc(ctx)
    return {"killed": await kill_strays(r, keep=set(a.keep) | r.known())}


@verb("runtime.list", NoArgs, cap=60, audit=False)
async def runtime_list(ctx: HelperContext, _: NoArgs, call: Call) -> dict[str, Any]:
    r = Runsc(ctx)
    known = r.known()
    if any(r.cgroups.is_frozen(i) for i in known):
        # `runsc list` would wait on the frozen ones forever: ask one by one instead.
        out = {}
        for i in sorted(known):
            st = await _state(r, i)
            if st is not None:
                out[i] = st
        return {"instances": out}
    res = await privileged.run(*r.cmd("list", "--format=json"), check=False, timeout=30)
    if res.returncode != 0 or not res.text.strip():
        return {"instances": {}}
    try:
        items = json.loads(res.text) or []
    except ValueError:
        return {"instances": {}}
    return {"instances": {str(i["id"]): str(i.get("status", "unknown")) for i in items}}
