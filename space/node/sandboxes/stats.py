"""Resource usage of a sandbox's runtime instance, read from its cgroups (v1, as on these hosts).

runsc puts the whole instance (sentry, gofer, every process of the workload) in the cgroups named
by the OCI spec's ``cgroupsPath`` (``/space/<instance>``), so the kernel's accounting of those
cgroups is the sandbox's usage. CPU is a rate: two readings ``window`` seconds apart.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Final

CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
#: The memory limit the kernel shows for a cgroup without one (a page-rounded LONG_MAX).
_NO_LIMIT: Final = 1 << 62


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _memory_stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out


async def sample(instance_id: str, *, cpu_count: float, memory_mb: int, window: float = 0.2,
                 root: Path = CGROUP_ROOT) -> dict[str, Any]:
    """``{"cpu_used_pct", "cpu_count", "mem_used", "mem_total", "mem_cache", "at"}`` (bytes; CPU
    percent of the sandbox's own CPUs, 0-100). Fields the host does not show are None."""
    cpuacct = root / "cpuacct" / "space" / instance_id / "cpuacct.usage"
    memory = root / "memory" / "space" / instance_id
    t0, u0 = time.monotonic(), _read_int(cpuacct)
    await asyncio.sleep(window)
    t1, u1 = time.monotonic(), _read_int(cpuacct)
    pct: float | None = None
    if u0 is not None and u1 is not None and t1 > t0:
        pct = min(100.0, max(0.0, (u1 - u0) / 1e9 / (t1 - t0) / max(cpu_count, 0.01) * 100))
    limit = _read_int(memory / "memory.limit_in_bytes")
    stat = _memory_stat(memory / "memory.stat")
    return {
        "at": time.time(),
        "cpu_count": cpu_count,
        "cpu_used_pct": None if pct is None else round(pct, 2),
        "mem_used": _read_int(memory / "memory.usage_in_bytes"),
        "mem_total": limit if limit is not None and limit < _NO_LIMIT else memory_mb << 20,
        "mem_cache": stat.get("total_cache", stat.get("cache")),
    }
