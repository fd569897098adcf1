"""Finding 3: every pool, whatever its kind, is a mount the host never honours setuid bits or device
nodes on (``nosuid,nodev``).

A sandbox's root lives in the pool, and a guest root can ``chmod 4755`` a copy of a shell there (and
a received stream can carry device nodes). A loop pool was mounted ``nosuid``; a ``DIRECTORY`` pool
(the data dir on the host's btrfs) was no mount at all, and a ``MOUNTED`` one (the operator's) kept
whatever flags it had. Each kind is opened here and its mount flags read; then a setuid-root binary
planted in the pool is run by an unprivileged host user, who must stay who they are.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from space.node.storage.mountinfo import mounts
from space.node.storage.pool import Pool, PoolKind
from tests.node.poolkit import PoolFactory, run_async
from tests.security.helper_fixtures import agent_pools, anyio_backend

__all__ = ["agent_pools", "anyio_backend"]

pytestmark = pytest.mark.runtime

NOBODY = 65534


def flags(path: Path) -> tuple[str, ...]:
    """The per-mount options of the top mount at ``path``, read from mountinfo here (not by the
    code under test)."""
    found = [line.split()[5] for line in Path("/proc/self/mountinfo").read_text().splitlines()
             if line.split()[4] == str(path)]
    assert found, f"{path} is not a mount"
    return tuple(found[-1].split(","))


def plant_setuid_id(directory: Path) -> Path:
    """A setuid-root copy of ``id``, as a guest root can leave in its root."""
    planted = directory / "suid-id"
    shutil.copy2("/usr/bin/id", planted)
    planted.chmod(0o4755)
    assert planted.stat().st_uid == 0 and planted.stat().st_mode & 0o4000
    return planted


def euid_when_run_by_nobody(binary: Path) -> str:
    done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", str(binary), "-u"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_loop_pool_is_nosuid_and_nodev_and_a_setuid_file_in_it_gives_nothing(agent_pools: PoolFactory) -> None:
    pool = agent_pools("loop")
    assert pool.kind is PoolKind.LOOP
    assert {"nosuid", "nodev"} <= set(flags(pool.root)), flags(pool.root)
    area = pool.root / "sandboxes"
    area.chmod(0o755)  # nobody may reach it here (the agent's 0750 is not what is tested)
    assert euid_when_run_by_nobody(plant_setuid_id(area)) == str(NOBODY)


def test_an_adopted_mount_without_the_flags_gets_them(agent_pools: PoolFactory) -> None:
    pool = agent_pools("adopted")
    # What an older node left mounted (noatime only), adopted by the next start.
    subprocess.run(["umount", str(pool.root)], check=True)
    subprocess.run(["mount", "-t", "btrfs", "-o", "noatime", str(pool.device), str(pool.root)], check=True)
    assert "nosuid" not in flags(pool.root)

    again = agent_pools("adopted")

    assert again.kind is PoolKind.LOOP
    assert {"nosuid", "nodev"} <= set(flags(again.root)), flags(again.root)


def test_a_directory_pool_is_a_nosuid_nodev_mount_of_its_own(agent_pools: PoolFactory) -> None:
    outer = agent_pools("outer")
    data_dir = outer.root / "sandboxes" / "nested-node"  # a data dir on the host's btrfs
    subprocess.run(["mount", "-o", "remount,bind,suid,dev", str(outer.root)], check=True)  # the host's own
    try:
        pool = run_async(Pool.open(data_dir))
        assert pool.kind is PoolKind.DIRECTORY
        assert {"nosuid", "nodev"} <= set(flags(pool.root)), "a DIRECTORY pool is not a nosuid,nodev mount"
        (outer.root / "sandboxes").chmod(0o755)
        data_dir.chmod(0o755)
        area = pool.root / "sandboxes"
        area.chmod(0o755)
        assert euid_when_run_by_nobody(plant_setuid_id(area)) == str(NOBODY)
        assert run_async(Pool.open(data_dir)).kind is PoolKind.DIRECTORY  # re-opened: the same, no second bind
        assert len([m for m in mounts() if m.target == str(pool.root)]) == 1
        run_async(pool.teardown())
        assert not [m for m in mounts() if m.target == str(pool.root)], "teardown left the bind"
    finally:
        for m in reversed([m for m in mounts() if m.target == str(data_dir / "pool")]):
            subprocess.run(["umount", m.target], check=False)


def test_a_mounted_pool_is_made_nosuid_and_nodev(agent_pools: PoolFactory, tmp_path: Path) -> None:
    # Someone else's btrfs mounted at <data>/pool, with the default flags (suid, dev).
    other = agent_pools("other")
    subprocess.run(["umount", str(other.root)], check=True)
    data_dir = tmp_path / "node"
    (data_dir / "pool").mkdir(parents=True)
    subprocess.run(["mount", "-t", "btrfs", str(other.device), str(data_dir / "pool")], check=True)
    try:
        pool = run_async(Pool.open(data_dir))
        assert pool.kind is PoolKind.MOUNTED
        assert {"nosuid", "nodev"} <= set(flags(pool.root)), flags(pool.root)
        run_async(pool.teardown())
        assert [m for m in mounts() if m.target == str(pool.root)], "a MOUNTED pool stays mounted"
    finally:
        subprocess.run(["umount", str(data_dir / "pool")], check=False)
        subprocess.run(["mount", "-t", "btrfs", str(other.device), str(other.root)], check=True)
