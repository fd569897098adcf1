"""Resource usage of a sandbox's runtime instance, read from its cgroups (v1 or v2:
:mod:`space.runtime.cgroups` knows which files).

runsc puts the whole instance (sentry, gofer, every process of the workload) in the cgroups named
by the OCI spec's ``cgroupsPath`` (``/space/<instance>``), so the kernel's accounting of those
cgroups is the sandbox's usage. CPU is a rate: two readings ``window`` seconds apart.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from space.runtime.cgroups import Cgroups, host


async def sample(instance_id: str, *, cpu_count: float, memory_mb: int, window: float = 0.2,
                 cgroups: Cgroups | None = None) -> dict[str, Any]:
    """``{"cpu_used_pct", "cpu_count", "mem_used", "mem_total", "mem_cache", "at"}`` (bytes; CPU
    percent of the sandbox's own CPUs, 0-100). Fields the host does not show are None; without a
    memory limit in the cgroup, ``mem_total`` is the sandbox's size."""
    cg = cgroups if cgroups is not None else host()
    t0, u0 = time.monotonic(), cg.usage(instance_id).cpu_ns
    await asyncio.sleep(window)
    t1, now = time.monotonic(), cg.usage(instance_id)
    u1 = now.cpu_ns
    pct: float | None = None
    if u0 is not None and u1 is not None and t1 > t0:
        pct = min(100.0, max(0.0, (u1 - u0) / 1e9 / (t1 - t0) / max(cpu_count, 0.01) * 100))
    return {
        "at": time.time(),
        "cpu_count": cpu_count,
        "cpu_used_pct": None if pct is None else round(pct, 2),
        "mem_used": now.memory_bytes,
        "mem_total": now.memory_limit if now.memory_limit is not None else memory_mb << 20,
        "mem_cache": now.cache_bytes,
    }
