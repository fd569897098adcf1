"""The limits every sandbox runs with (the OCI spec the helper writes) and how its death is told.

- processes: RLIMIT_NPROC (soft = hard, so the guest cannot raise it) scaled with the memory
  limit, the daemon exempt from it (CAP_SYS_RESOURCE, which it keeps from its commands); the
  host pids cgroup bounds the sentry's own tasks; memory and CPU as asked
- an OOM kill is read from the instance's memory cgroup on cgroup v1 (``memory.oom_control``) and
  on cgroup v2 (``memory.events``), both ``oom_kill N``
"""

from __future__ import annotations

from pathlib import Path

from space.runtime.base import InstanceSpec
from space.runtime.cgroups import CgroupsV1, CgroupsV2
from space.runtime.oci import HOST_PIDS, build_spec, guest_processes


def spec(memory_mb: int) -> InstanceSpec:
    return InstanceSpec(sandbox_id="s1", instance_id="s1-abcde", rootfs=Path("/r"), workdir=Path("/w"),
                        guest_dir=Path("/g"), channel_dir=Path("/c"), cpu=1.0, memory_mb=memory_mb,
                        hostname="s1")


def test_processes_are_bounded_with_the_memory() -> None:
    for memory_mb in (128, 256, 512, 4096, 1 << 20):
        doc = build_spec(spec(memory_mb))
        nproc = [r for r in doc["process"]["rlimits"] if r["type"] == "RLIMIT_NPROC"]
        assert nproc == [{"type": "RLIMIT_NPROC", "hard": guest_processes(memory_mb),
                          "soft": guest_processes(memory_mb)}]
        assert doc["linux"]["resources"]["pids"] == {"limit": HOST_PIDS}
        assert doc["linux"]["resources"]["memory"] == {"limit": memory_mb << 20}
        # Of the two capabilities that lift RLIMIT_NPROC in gVisor, only CAP_SYS_RESOURCE is
        # given, to the daemon alone: no command keeps it (tests/security/test_quota_probes.py).
        for caps in doc["process"]["capabilities"].values():
            assert "CAP_SYS_ADMIN" not in caps and "CAP_SYS_RESOURCE" in caps
    assert guest_processes(128) == 32 and guest_processes(512) == 64
    assert guest_processes(512) < guest_processes(4096) <= 32768


def test_an_oom_kill_is_read_on_cgroup_v1_and_v2(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    (v1 / "memory" / "space" / "s1-abcde").mkdir(parents=True)
    control = v1 / "memory" / "space" / "s1-abcde" / "memory.oom_control"
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    assert CgroupsV1(v1).oom_kills("s1-abcde") == 0
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert CgroupsV1(v1).oom_kills("s1-abcde") == 1

    v2 = tmp_path / "v2"
    (v2 / "space" / "s1-abcde").mkdir(parents=True)
    events = v2 / "space" / "s1-abcde" / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\noom_group_kill 0\n")
    assert CgroupsV2(v2).oom_kills("s1-abcde") == 0
    events.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert CgroupsV2(v2).oom_kills("s1-abcde") == 2
    assert CgroupsV2(v2).oom_kills("gone-00000") == 0


def test_a_verb_that_meets_a_full_pool_says_insufficient_storage() -> None:
    import asyncio
    import errno

    import pytest

    from space.errors import InsufficientStorage
    from space.node.helper.verbs import _full_is_storage

    async def full(ctx: object, args: object, call: object) -> dict[str, object]:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    async def other(ctx: object, args: object, call: object) -> dict[str, object]:
        raise OSError(errno.EACCES, "Permission denied")

    with pytest.raises(InsufficientStorage) as exc:
        asyncio.run(_full_is_storage("rootfs.configure_net", full)(None, None, None))  # type: ignore[arg-type]
    assert exc.value.status == 507 and exc.value.details["verb"] == "rootfs.configure_net"
    with pytest.raises(PermissionError):
        asyncio.run(_full_is_storage("x", other)(None, None, None))  # type: ignore[arg-type]
