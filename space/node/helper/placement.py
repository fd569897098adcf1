"""Each sandbox's shim, placed in cgroups of SPACE's own, outside the node agent's.

A sandbox outlives its node agent: a restarted agent (``systemctl restart``, a DaemonSet rollout,
a crashed container) adopts what runs. runsc moves each instance's sentry and gofer into the
instance's own cgroups (``/space/<instance>``); the shim, which holds the guest's channel, is the
agent's child and starts in the agent's cgroups. Whoever stops the agent by its cgroup -- runc
kills every process left in a container's cgroup when the container goes, systemd's
``KillMode=control-group`` does the same for a service -- would take the shims with it, and every
sandbox would lose its channel. So the helper moves each shim, before the instance starts, into
``/space/shims`` in every cgroup hierarchy the host has mounted.

The agent names the pid, and the agent is not trusted with the host's cgroups: the helper moves a
process only if it is the calling agent's own child (its parent is the caller the kernel named
through ``SO_PEERCRED``), runs as the agent's uid and is a shim. A parent's unreaped child keeps its
pid, so the pid cannot be another process's by the time it is moved.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from space.errors import Conflict, RuntimeFailure
from space.node.storage.mountinfo import mounts

#: The shims' cgroup, relative to each hierarchy's root. In cgroup v2 it is a leaf beside the
#: instances' groups (``/space`` itself holds no process: it delegates controllers to them).
SHIMS = Path("space") / "shims"
#: How long a shim may take to show its command line (seconds; it is on a sandbox's start path).
_EXEC_WAIT = 0.5
#: What a shim's command line carries (``python -m space.runtime.shim``).
_SHIM_MODULE = b"space.runtime.shim"


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy: where, and its kind (``cgroup`` v1 or ``cgroup2``)."""

    mountpoint: Path
    fstype: str


def hierarchies() -> list[Hierarchy]:
    """The cgroup hierarchies this process sees mounted, one mount point each (v1 controllers
    mounted twice, or co-mounted behind symlinks, count once: by the mount's source identity)."""
    seen: set[tuple[str, int]] = set()
    out = []
    for m in mounts():
        if m.fstype not in ("cgroup", "cgroup2"):
            continue
        try:
            st = os.stat(m.target)
        except OSError:
            continue
        key = (m.fstype, st.st_dev)
        if key in seen:
            continue
        seen.add(key)
        out.append(Hierarchy(Path(m.target), m.fstype))
    return out


def check_shim(pid: int, *, parent: int, uid: int) -> None:
    """Conflict unless ``pid`` is a shim, child of ``parent``, running as ``uid``."""
    proc = Path(f"/proc/{pid}")
    deadline = time.monotonic() + _EXEC_WAIT
    try:
        while True:
            status = (proc / "status").read_text()
            cmdline = (proc / "cmdline").read_bytes()
            # Empty while the child is still between its fork and its exec: its parent's Popen
            # returns as the exec commits, a moment before the new command line is in place.
            if cmdline or time.monotonic() > deadline:
                break
            time.sleep(0.001)
    except OSError:
        raise Conflict(f"process {pid} is gone", pid=pid) from None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    ppid = fields.get("PPid", "").strip()
    uids = fields.get("Uid", "").split()
    if ppid != str(parent):
        raise Conflict(f"process {pid} is not the caller's child", pid=pid)
    if len(uids) != 4 or any(u != str(uid) for u in uids):
        raise Conflict(f"process {pid} does not run as the node agent", pid=pid)
    argv = cmdline.split(b"\0")
    if b"-m" not in argv or argv[argv.index(b"-m") + 1:argv.index(b"-m") + 2] != [_SHIM_MODULE]:
        raise Conflict(f"process {pid} is not a shim", pid=pid)


def place_shim(pid: int, found: list[Hierarchy] | None = None) -> list[str]:
    """Move ``pid`` into :data:`SHIMS` of every hierarchy; the mount points it was moved in.

    RuntimeFailure names the hierarchy that refused (the first; the move is not undone: a shim
    half out of the agent's cgroups is no worse off than one wholly in them)."""
    moved = []
    for h in hierarchies() if found is None else found:
        group = h.mountpoint / SHIMS
        try:
            _make_group(h.mountpoint, SHIMS)
            with open(group / "cgroup.procs", "w") as f:
                f.write(str(pid))
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                raise Conflict(f"process {pid} is gone", pid=pid) from None
            # ENOENT on a write: the group is outside this process's cgroup namespace (a container
            # with a private one): the node must run in the host's (see space.node.main).
            raise RuntimeFailure(f"cannot move the shim into {group}: {exc.strerror}",
                                 hierarchy=str(h.mountpoint)) from None
        moved.append(str(h.mountpoint))
    return moved


def _make_group(root: Path, rel: Path) -> None:
    """Make ``root/rel`` level by level. A new v1 cpuset group starts with no CPUs and no memory
    nodes, and takes no process until it has some: it gets its parent's."""
    group = root
    for part in rel.parts:
        parent, group = group, group / part
        with contextlib.suppress(FileExistsError):
            group.mkdir()
        for name in ("cpuset.cpus", "cpuset.mems"):
            mine = group / name
            if mine.exists() and not mine.read_text().strip():
                mine.write_text((parent / name).read_text())


#: setns(2)'s namespace type of a cgroup namespace.
_CLONE_NEWCGROUP = 0x02000000


def enter_host_cgroup_namespace(init: Path = Path("/proc/1")) -> bool:
    """Join the cgroup namespace of the host's init, if this process is in another one and sees
    the host's processes (a Kubernetes pod with ``hostPID``: on cgroup v2 hosts its containers
    get a cgroup namespace of their own). Whether it moved.

    Inside its own namespace the node could move no process to a cgroup outside the pod's -- not
    runsc its sandboxes, not the helper the shims (the kernel answers ENOENT) -- and a sandbox
    would die with the pod. Called before the node starts a thread or a process: a namespace is
    a thread's, and processes inherit their creator's."""
    try:
        if os.stat(init / "ns" / "cgroup").st_ino == os.stat("/proc/self/ns/cgroup").st_ino:
            return False
        fd = os.open(init / "ns" / "cgroup", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no host PID namespace, or no /proc/1 of ours to read: nothing to join
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWCGROUP) != 0:
            err = ctypes.get_errno()
            raise RuntimeFailure(f"cannot join the host's cgroup namespace: {os.strerror(err)}")
    finally:
        os.close(fd)
    return True


def remove_empty_shim_groups(found: list[Hierarchy] | None = None) -> None:
    """Remove the shims' cgroups that no process is in any more (a node's teardown)."""
    for h in hierarchies() if found is None else found:
        with contextlib.suppress(OSError):  # busy (another node's shims), or never made
            (h.mountpoint / SHIMS).rmdir()
