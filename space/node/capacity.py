"""What this node may give its sandboxes: CPUs and memory as its own cgroup limits them.

A node agent in a container (a Kubernetes DaemonSet pod, a systemd slice with ``CPUQuota=``) sees
the host's CPUs in ``os.cpu_count()`` and the host's RAM in ``/proc/meminfo``; placing sandboxes by
those would overcommit the machine's share the operator gave SPACE. The limits are read from the
agent's cgroup and every ancestor (the tightest wins), on cgroup v2 (``cpu.max``, ``memory.max``)
and v1 (``cpu.cfs_quota_us``/``cpu.cfs_period_us``, ``memory.limit_in_bytes``), and bounded by the
CPUs this process may run on and the RAM the machine has.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

#: v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages); anything past this is none.
_UNLIMITED_BYTES = 1 << 60


@dataclasses.dataclass(frozen=True)
class Capacity:
    cpus: float
    memory_mb: int


def node_capacity(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> Capacity:
    """This process's capacity (``proc`` and ``cgroup_root`` are parameters for tests)."""
    cpus = float(_affinity_cpus())
    memory = _meminfo_bytes(proc / "meminfo")
    for kind, base, path in _cgroups(proc / "self" / "cgroup", cgroup_root):
        for d in _with_ancestors(path, base):
            quota = _cpu_limit(d, kind)
            if quota is not None:
                cpus = min(cpus, quota)
            limit = _memory_limit(d, kind)
            if limit is not None:
                memory = min(memory, limit)
    return Capacity(cpus=round(cpus, 3), memory_mb=memory >> 20)


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _meminfo_bytes(path: Path) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{path} has no MemTotal")


def _cgroups(self_cgroup: Path, root: Path) -> list[tuple[str, Path, Path]]:
    """``(version, hierarchy root, directory)`` of this process's mounted cpu and memory cgroups."""
    out: list[tuple[str, Path, Path]] = []
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        ident, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        rel = rel.lstrip("/")
        if ident == "0" and controllers == "":
            # Unified hierarchy: on a pure v2 host at the root, on a hybrid host under unified/.
            for base in (root, root / "unified"):
                if (base / "cgroup.controllers").exists():
                    out.append(("v2", base, base / rel))
                    break
        else:
            for name in controllers.split(","):
                if name in ("cpu", "memory") and (root / name).is_dir():
                    out.append(("v1", root / name, root / name / rel))
    return out


def _with_ancestors(path: Path, stop: Path) -> list[Path]:
    """``path`` and its parents up to (and including) ``stop``, where ``path`` exists."""
    out = [path]
    while path != stop and stop in path.parents:
        path = path.parent
        out.append(path)
    return [p for p in out if p.is_dir()]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpu_limit(d: Path, kind: str) -> float | None:
    if kind == "v2":
        text = _read(d / "cpu.max")
        if not text:
            return None
        quota, _, period = text.partition(" ")
        if quota == "max":
            return None
        q, p = int(quota), int(period or "100000")
    else:
        quota_text, period_text = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if quota_text is None or period_text is None:
            return None
        q, p = int(quota_text), int(period_text)
        if q < 0:  # -1: no limit
            return None
    return q / p if p > 0 and q > 0 else None


def _memory_limit(d: Path, kind: str) -> int | None:
    text = _read(d / ("memory.max" if kind == "v2" else "memory.limit_in_bytes"))
    if not text or text == "max":
        return None
    value = int(text)
    return value if 0 < value < _UNLIMITED_BYTES else None

