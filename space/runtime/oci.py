"""OCI runtime spec for a sandbox instance (config.json of the bundle)."""

from __future__ import annotations

from typing import Any

from space.runtime.base import InstanceSpec

GUEST_MOUNT = "/opt/space/guest"
GUEST_ARGV = ["/usr/bin/python3", "-I", "-S", f"{GUEST_MOUNT}/boot.py"]
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CPU_PERIOD_US = 100_000
#: Host tasks (the sentry's and gofer's threads, systrap's stubs) of one sandbox: bounds a guest
#: that makes the sentry spawn host threads (measured idle: 13-30).
HOST_PIDS = 4096


def guest_processes(memory_mb: int) -> int:
    """The most processes one user may have inside a sandbox (``RLIMIT_NPROC``, enforced by the
    gVisor kernel per real uid on every fork/clone, capabilities CAP_SYS_ADMIN and
    CAP_SYS_RESOURCE excepted, which no sandbox has): a fork bomb meets EAGAIN at this count
    instead of growing until the memory limit kills the whole sandbox. Scaled with the memory
    limit, so that this many small processes still fit in it: measured, a shell's fork bomb held
    at 128 processes still filled 512 MiB (a process costs the sentry ~4 MiB), so 8 MiB each."""
    return max(32, min(memory_mb // 8, 32768))
#: Root inside the sandbox gets the usual container set: enough to switch users, chown and install
#: packages; the gVisor kernel, not capabilities, is the isolation boundary.
CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]
#: The guest daemon (PID 1) also holds CAP_SYS_RESOURCE: gVisor counts every task, threads
#: included, against its creator's real uid for RLIMIT_NPROC and exempts a creator with this
#: capability. Without it, the daemon's own threads and the commands it starts share root's count
#: with the tenant's root processes: a busy API fails the tenant's forks, and a root fork bomb
#: leaves the daemon unable to start a thread or a ``kill``. The daemon drops it from its bounding
#: set before it starts anything (``space/guest/guest_caps.py``), so no command ever holds it.
DAEMON_CAPABILITIES = [*CAPABILITIES, "CAP_SYS_RESOURCE"]


def build_spec(spec: InstanceSpec) -> dict[str, Any]:
    resources: dict[str, Any] = {
        "memory": {"limit": spec.memory_mb * 1024 * 1024},
        "cpu": {"quota": max(1000, int(spec.cpu * CPU_PERIOD_US)), "period": CPU_PERIOD_US},
        "pids": {"limit": HOST_PIDS},
    }
    if spec.cpu_shares is not None:
        resources["cpu"]["shares"] = spec.cpu_shares
    nproc = guest_processes(spec.memory_mb)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "args": GUEST_ARGV,
            "cwd": "/",
            "env": [f"PATH={_PATH}", "LANG=C.UTF-8", f"SPACE_SANDBOX_ID={spec.sandbox_id}"],
            "user": {"uid": 0, "gid": 0},
            "capabilities": {k: DAEMON_CAPABILITIES for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": False,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576, "soft": 1048576},
                        {"type": "RLIMIT_NPROC", "hard": nproc, "soft": nproc}],
        },
        "root": {"path": str(spec.rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": GUEST_MOUNT, "type": "bind", "source": str(spec.guest_dir),
             "options": ["rbind", "ro"]},
        ],
        "linux": {
            "namespaces": [
                {"type": t} if t != "network" or spec.netns is None else {"type": t, "path": str(spec.netns)}
                for t in ("pid", "network", "ipc", "uts", "mount")
            ],
            "resources": resources,
            "cgroupsPath": f"/space/{spec.instance_id}",
        },
    }
