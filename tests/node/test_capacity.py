"""Node capacity comes from the agent's cgroup limits (v1 and v2, the tightest ancestor), never
more than the machine has."""

from __future__ import annotations

import os
from pathlib import Path

from space.node.capacity import node_capacity

GIB = 1 << 30


def fake_proc(tmp: Path, cgroup_lines: str, mem_gib: int = 64) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    (proc / "meminfo").write_text(f"MemTotal:       {mem_gib * 1024 * 1024} kB\nMemFree: 1 kB\n")
    return proc


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_v2_limits_of_the_pod_and_its_parent(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "cgroup.controllers", "cpu memory")
    pod = root / "kubepods" / "pod1"
    write(root / "kubepods" / "cpu.max", "max 100000")
    write(root / "kubepods" / "memory.max", str(8 * GIB))
    write(pod / "cpu.max", "150000 100000")
    write(pod / "memory.max", "max")
    cap = node_capacity(fake_proc(tmp_path, "0::/kubepods/pod1\n"), root)
    assert cap.cpus == min(1.5, len(os.sched_getaffinity(0)))
    assert cap.memory_mb == 8 * 1024  # the parent's limit binds


def test_v1_limits(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "cpu" / "slice" / "cpu.cfs_quota_us", "50000")
    write(root / "cpu" / "slice" / "cpu.cfs_period_us", "100000")
    write(root / "memory" / "slice" / "memory.limit_in_bytes", str(2 * GIB))
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712")  # v1's "no limit"
    cap = node_capacity(fake_proc(tmp_path, "4:memory:/slice\n1:cpu,cpuacct:/slice\n"), root)
    assert (cap.cpus, cap.memory_mb) == (0.5, 2048)


def test_no_limits_means_the_machine(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "cpu" / "cpu.cfs_quota_us", "-1")
    write(root / "cpu" / "cpu.cfs_period_us", "100000")
    cap = node_capacity(fake_proc(tmp_path, "1:cpu:/\n", mem_gib=3), root)
    assert (cap.cpus, cap.memory_mb) == (float(len(os.sched_getaffinity(0))), 3 * 1024)


def test_this_machine() -> None:
    cap = node_capacity()
    assert 0 < cap.cpus <= (os.cpu_count() or 1)
    with open("/proc/meminfo") as f:
        total_mb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) // 1024
    assert 0 < cap.memory_mb <= total_mb
