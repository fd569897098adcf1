"""Per-sandbox disk limits and the pool's reserve, on a real loop btrfs pool with simple quotas.

Aspects: a sandbox root is born with its limit (one ioctl) and is charged only for what it writes,
not for the template it shares; past its limit a write fails with EDQUOT in that root alone; a
read-only snapshot of it does not uncharge it; a new root from that snapshot (a rollback, a fork)
is born with the limit again; the limit can be changed (a claimed warm sandbox); all roots together
never take the pool's reserve, and as free space changes outside them the cap follows.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.node.storage.pool import Pool
from space.node.storage.snapshots import MIN_FREE_BYTES
from tests.node.poolkit import PoolFactory, run_async

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]

MIB = 1 << 20
RESERVE = 512 * MIB


def fill(path: Path, limit_mb: int, chunk: int = MIB) -> tuple[int, int | None]:
    """Write up to ``limit_mb`` MiB of incompressible data into ``path``, synced: (bytes written,
    errno of the write that failed or None)."""
    block = os.urandom(chunk)
    written = 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:  # a new file needs room for its metadata too
        return 0, exc.errno
    try:
        while written < limit_mb * MIB:
            written += os.write(fd, block)
        os.fsync(fd)
    except OSError as exc:
        return written, exc.errno
    finally:
        os.close(fd)
    return written, None


def commit(pool: Pool) -> None:
    """A transaction commit: quota usage and free space as btrfs reports them are the last commit's."""
    subprocess.run(["btrfs", "filesystem", "sync", str(pool.root)], check=True, capture_output=True)


def cleaned(pool: Pool) -> None:
    """Wait for the cleaner to drop deleted subvolumes (their extents are freed only then)."""
    subprocess.run(["btrfs", "subvolume", "sync", str(pool.root)], check=True, capture_output=True)


@pytest.fixture
def pool(pool_factory: PoolFactory) -> Iterator[Pool]:
    p = pool_factory("quota", size_gb=3)
    res = run_async(p.enable_quotas(RESERVE))
    assert res["enabled"], res
    yield p


@pytest.fixture
def template(pool: Pool) -> Path:
    """A read-only template holding 40 MiB, written before any sandbox exists."""
    t = pool.root / "templates" / "t@0"
    run_async(pool.create_subvolume(t))
    assert fill(t / "data", 40) == (40 * MIB, None)
    run_async(pool.set_readonly(t))
    return t


async def test_a_root_is_charged_only_for_what_it_writes(pool: Pool, template: Path) -> None:
    a, b = pool.root / "sandboxes" / "a" / "rootfs", pool.root / "sandboxes" / "b" / "rootfs"
    await pool.snapshot(template, a, sandbox_root=True, limit_bytes=64 * MIB)
    await pool.snapshot(template, b, sandbox_root=True, limit_bytes=None)
    # The template's 40 MiB are shared, not charged: 60 MiB of its own fit under 64.
    assert fill(a / "first", 60) == (60 * MIB, None)
    written, err = fill(a / "more", 100)
    assert err == errno.EDQUOT and written < 8 * MIB, (written, err)
    # ... in that root only: its neighbour writes on.
    assert fill(b / "data", 100) == (100 * MIB, None)
    # A snapshot shares a's extents and does not uncharge it (squota charges the writer for life).
    snap = pool.root / "sandboxes" / "a" / "snapshots" / "s1" / "rootfs"
    await pool.snapshot(a, snap, readonly=True)
    commit(pool)
    assert fill(a / "after-snapshot", 16)[1] == errno.EDQUOT
    # A new root from the snapshot (rollback, fork, restore) is born with the limit again and
    # charged only for its own writes: the snapshot's files stay, and 60 MiB more fit.
    await pool.delete_subvolume(a)
    await pool.snapshot(snap, a, sandbox_root=True, limit_bytes=64 * MIB)
    assert (a / "first").stat().st_size == 60 * MIB
    assert fill(a / "second", 60) == (60 * MIB, None)
    assert fill(a / "third", 100)[1] == errno.EDQUOT


async def test_the_limit_of_a_root_can_change(pool: Pool, template: Path) -> None:
    root = pool.root / "sandboxes" / "w" / "rootfs"
    await pool.snapshot(template, root, sandbox_root=True, limit_bytes=32 * MIB)
    assert fill(root / "a", 64)[1] == errno.EDQUOT
    await pool.set_disk_limit(root, 128 * MIB)
    assert fill(root / "b", 64) == (64 * MIB, None)
    await pool.set_disk_limit(root, 16 * MIB)  # below what it holds: nothing more fits
    assert fill(root / "c", 1)[1] == errno.EDQUOT


async def test_roots_together_never_take_the_reserve(pool: Pool, template: Path) -> None:
    x, y = pool.root / "sandboxes" / "x" / "rootfs", pool.root / "sandboxes" / "y" / "rootfs"
    await pool.snapshot(template, x, sandbox_root=True, limit_bytes=None)
    await pool.snapshot(template, y, sandbox_root=True, limit_bytes=None)
    _, err = fill(x / "fill", 4096)
    assert err == errno.EDQUOT
    commit(pool)
    assert fill(y / "fill", 4096)[1] == errno.EDQUOT  # the share of all roots is used up
    free = (await pool.usage())["free_bytes"]
    assert free >= RESERVE - 64 * MIB, free >> 20
    # The node's own work still has room: a snapshot of a full root, a file outside the roots.
    await pool.snapshot(x, pool.root / "sandboxes" / "x" / "snapshots" / "s" / "rootfs", readonly=True)
    assert fill(pool.root / "sandboxes" / "x" / "state.json", 64) == (64 * MIB, None)
    assert free - 64 * MIB > MIN_FREE_BYTES
    # Space given back (a deleted sandbox, its snapshot included: the extents it wrote are
    # charged to it while anything shares them) grows the roots' share at the next refresh.
    await pool.delete_subvolume(pool.root / "sandboxes" / "x")  # its root, snapshot and files
    # The cleaner frees a deleted subvolume's extents in the background; then a commit.
    cleaned(pool)
    commit(pool)
    await pool.refresh_reserve()
    assert fill(y / "after-delete", 64) == (64 * MIB, None)
    commit(pool)
    assert (await pool.usage())["free_bytes"] >= RESERVE - 64 * MIB


async def test_a_build_tree_is_held_to_the_build_bound(pool: Pool) -> None:
    """A template build's tree (``template.begin``) is born with the node's build bound: an image
    layer bomb or a step that fills the disk fails that build with EDQUOT, and the pool keeps room."""
    from space.node.helper.backend import InProcess
    from space.node.helper.verbs import HelperContext
    from space.node.templates.store import DEFAULT_CACHE_DIR

    priv = InProcess(HelperContext(data_dir=pool.data_dir, cache_dir=DEFAULT_CACHE_DIR, pool_root=pool.root,
                                   build_max_bytes=64 * MIB))
    work = "tmp/build-bomb@0123456789abcdef"
    await priv.call("template.begin", {"work": work})
    try:
        written, err = fill(pool.root / work / "bomb", 200)
        if err is None:  # the usage the limit sees is the last commit's: one more commit, one more write
            commit(pool)
            more, err = fill(pool.root / work / "more", 200)
            written += more
        assert err == errno.EDQUOT and written <= 96 * MIB, (written, err)
    finally:
        await pool.delete_subvolume(pool.root / work)
