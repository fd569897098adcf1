"""The node's btrfs pool, on real loop files.

Aspects: opening is idempotent and adopts the existing loop device and mount (also from another
process, and after a crash between attaching and mounting); teardown deletes sandbox and tmp
subvolumes, unmounts and detaches but keeps the pool file and its templates; a data dir already on
btrfs needs no loop file; snapshots are writable or read-only as asked, share extents and are
independent of their source; delete is recursive and idempotent; paths outside the pool are refused.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from space.errors import Conflict, InvalidPath, InvalidRequest
from space.node.helper import privileged
from space.node.storage.mountinfo import mounts
from space.node.storage.pool import AREAS, Pool, PoolKind
from tests.node.poolkit import PoolFactory, loop_devices_of, run_async

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]


def mount_count(path: Path) -> int:
    return sum(1 for m in mounts() if m.target == str(path))


# -- open / teardown (private pools) -------------------------------------------------------------


def test_open_is_idempotent_and_reuses_the_loop_device(pool_factory: PoolFactory) -> None:
    first = pool_factory("node")
    image = first.data_dir / "pool.img"
    assert first.kind is PoolKind.LOOP
    assert loop_devices_of(image) == [str(first.device)]
    assert all((first.root / area).is_dir() for area in AREAS)

    second = pool_factory("node")

    assert (second.root, second.device, second.kind) == (first.root, first.device, PoolKind.LOOP)
    assert loop_devices_of(image) == [str(first.device)]
    assert mount_count(first.root) == 1


def test_open_from_another_process_adopts_the_mount(pool_factory: PoolFactory) -> None:
    pool = pool_factory("node")
    code = (
        "import asyncio, sys; from pathlib import Path; from space.node.storage.pool import Pool;"
        "p = asyncio.run(Pool.open(Path(sys.argv[1]))); print('RESULT', p.kind.value, p.device)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(pool.data_dir)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    result = [line.split()[1:] for line in out if line.startswith("RESULT")]
    assert result == [["loop", str(pool.device)]]
    assert loop_devices_of(pool.data_dir / "pool.img") == [str(pool.device)]
    assert mount_count(pool.root) == 1


def test_a_loop_attached_through_another_mount_namespace_is_still_the_nodes_own(
        pool_factory: PoolFactory, tmp_path: Path) -> None:
    """A node agent's previous container attached the loop device through its own mount of the
    data dir, now gone: the kernel shows the backing file's path relative to that mount. The pool
    is still this node's loop file (by the file's identity), not someone else's mount: it keeps
    its disk limits and is detached at teardown."""
    pool = pool_factory("node")
    image = pool.data_dir / "pool.img"
    subprocess.run(["umount", str(pool.root)], check=True)
    subprocess.run(["losetup", "-d", str(pool.device)], check=True)
    alias = tmp_path / "alias"
    alias.mkdir()
    attached = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount --bind "$1" "$2" && losetup -f --show "$2/pool.img"', "attach", str(pool.data_dir), str(alias)],
        capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["mount", "-t", "btrfs", attached, str(pool.root)], check=True)
    backing = Path(f"/sys/block/{Path(attached).name}/loop/backing_file").read_text().strip()
    assert backing != str(image)  # what made the node take its own pool for a foreign mount

    again = pool_factory("node")

    assert (again.kind, str(again.device)) == (PoolKind.LOOP, attached)


def test_open_after_a_crash_between_attach_and_mount_reuses_the_device(pool_factory: PoolFactory) -> None:
    pool = pool_factory("node")
    # What a crash after `losetup` but before `mount` leaves: an attached, unmounted loop device.
    subprocess.run(["umount", str(pool.root)], check=True)
    assert mount_count(pool.root) == 0

    again = pool_factory("node")

    assert again.device == pool.device
    assert loop_devices_of(pool.data_dir / "pool.img") == [str(pool.device)]
    assert mount_count(pool.root) == 1


def test_teardown_detaches_and_keeps_the_pool_file(pool_factory: PoolFactory) -> None:
    pool = pool_factory("node")
    image = pool.data_dir / "pool.img"
    sandbox = pool.sandbox_dir("s1")

    async def populate() -> None:
        await pool.create_subvolume(pool.root / "templates" / "t@0123456789abcdef")
        await pool.create_subvolume(sandbox / "rootfs")
        await pool.snapshot(sandbox / "rootfs", sandbox / "snapshots" / "one", readonly=True)
        await pool.create_subvolume(pool.tmp_dir / "build-x")

    run_async(populate())
    run_async(pool.teardown())

    assert mount_count(pool.root) == 0
    assert loop_devices_of(image) == []
    assert image.exists()

    reopened = pool_factory("node")
    assert (reopened.root / "templates" / "t@0123456789abcdef").is_dir()
    assert list((reopened.root / "sandboxes").iterdir()) == []
    assert list(reopened.tmp_dir.iterdir()) == []


async def test_a_data_dir_on_btrfs_needs_no_loop_file(btrfs_pool: Pool) -> None:
    data_dir = btrfs_pool.tmp_dir / "nested-node"
    try:
        inner = await Pool.open(data_dir)
        assert inner.kind is PoolKind.DIRECTORY
        assert not (data_dir / "pool.img").exists()
        await inner.create_subvolume(inner.sandbox_dir("s1") / "rootfs")
        await inner.teardown()
        assert not inner.sandbox_dir("s1").exists()
        assert mount_count(btrfs_pool.root) == 1
    finally:
        await btrfs_pool.delete_subvolume(data_dir)


# -- subvolumes (the module's pool) ------------------------------------------------------------


async def test_writable_snapshot_shares_extents_and_is_independent(btrfs_pool: Pool) -> None:
    src, dst = btrfs_pool.tmp_dir / "snap-src", btrfs_pool.tmp_dir / "snap-rw"
    try:
        await btrfs_pool.create_subvolume(src)
        payload = bytes(range(256)) * 4096  # 1 MiB
        (src / "data").write_bytes(payload)

        await btrfs_pool.snapshot(src, dst)

        assert await btrfs_pool.is_subvolume(dst)
        assert not await btrfs_pool.is_readonly(dst)
        assert await btrfs_pool.exclusive_bytes(dst) == 0  # every extent shared with src
        (dst / "data").write_bytes(b"changed")
        (dst / "new").write_text("only in the snapshot")
        assert (src / "data").read_bytes() == payload
        assert not (src / "new").exists()
    finally:
        await btrfs_pool.delete_subvolume(dst)
        await btrfs_pool.delete_subvolume(src)


async def test_readonly_snapshot_refuses_writes_until_made_writable(btrfs_pool: Pool) -> None:
    src, dst = btrfs_pool.tmp_dir / "ro-src", btrfs_pool.tmp_dir / "ro-snap"
    try:
        await btrfs_pool.create_subvolume(src)
        (src / "f").write_text("x")

        await btrfs_pool.snapshot(src, dst, readonly=True)

        assert await btrfs_pool.is_readonly(dst)
        with pytest.raises(OSError) as excinfo:
            (dst / "f").write_text("y")
        assert excinfo.value.errno == errno.EROFS
        await btrfs_pool.set_readonly(dst, False)
        (dst / "f").write_text("y")
        assert (src / "f").read_text() == "x"
    finally:
        await btrfs_pool.delete_subvolume(dst)
        await btrfs_pool.delete_subvolume(src)


async def test_snapshot_never_lands_inside_an_existing_directory(btrfs_pool: Pool) -> None:
    src, dst = btrfs_pool.tmp_dir / "exists-src", btrfs_pool.tmp_dir / "exists-dst"
    try:
        await btrfs_pool.create_subvolume(src)
        dst.mkdir()
        with pytest.raises(Conflict):
            await btrfs_pool.snapshot(src, dst)
        assert list(dst.iterdir()) == []
        with pytest.raises(Conflict):
            await btrfs_pool.create_subvolume(src)
    finally:
        await btrfs_pool.delete_subvolume(dst)
        await btrfs_pool.delete_subvolume(src)


async def test_delete_is_recursive_and_idempotent(btrfs_pool: Pool) -> None:
    sandbox = btrfs_pool.sandbox_dir("srecursive")
    rootfs = sandbox / "rootfs"
    await btrfs_pool.create_subvolume(rootfs)
    await btrfs_pool.create_subvolume(rootfs / "var" / "nested")
    await btrfs_pool.create_subvolume(rootfs / "var" / "nested" / "deeper")
    await btrfs_pool.snapshot(rootfs, sandbox / "snapshots" / "a", readonly=True)
    (sandbox / "bundle").mkdir()
    (sandbox / "bundle" / "config.json").write_text(json.dumps({}))
    # A read-only subvolume that still holds a nested one (made writable-nested, then frozen).
    frozen = btrfs_pool.tmp_dir / "frozen"
    await btrfs_pool.create_subvolume(frozen)
    await btrfs_pool.create_subvolume(frozen / "inner")
    await btrfs_pool.set_readonly(frozen)

    await btrfs_pool.delete_subvolume(sandbox)
    await btrfs_pool.delete_subvolume(frozen)

    assert not sandbox.exists()
    assert not frozen.exists()
    await btrfs_pool.delete_subvolume(sandbox)  # already gone: no error
    await btrfs_pool.delete_subvolume(rootfs / "var" / "nested")


async def test_paths_outside_the_pool_are_refused(btrfs_pool: Pool, tmp_path: Path) -> None:
    for path in (tmp_path, btrfs_pool.root, btrfs_pool.root / "tmp" / ".." / ".."):
        with pytest.raises(InvalidPath):
            await btrfs_pool.delete_subvolume(path)
    with pytest.raises(InvalidPath):
        await btrfs_pool.snapshot(btrfs_pool.root / "templates", tmp_path / "x")
    with pytest.raises(InvalidRequest):
        btrfs_pool.sandbox_dir("../escape")
    with pytest.raises(InvalidRequest):
        btrfs_pool.template_path("a/b", "0" * 64)


async def test_layout_and_usage(btrfs_pool: Pool) -> None:
    digest = "ab" * 32
    assert btrfs_pool.template_path("base", digest) == btrfs_pool.root / "templates" / f"base@{digest[:16]}"
    assert btrfs_pool.sandbox_dir("s123") == btrfs_pool.root / "sandboxes" / "s123"
    usage = await btrfs_pool.usage()
    assert set(usage) == {"size_bytes", "used_bytes", "free_bytes"}
    assert 3 * 1024**3 < usage["size_bytes"] <= 4 * 1024**3
    assert 0 < usage["used_bytes"] < usage["size_bytes"]
    assert 0 < usage["free_bytes"] < usage["size_bytes"]


async def test_delete_clears_mounts_left_beneath(btrfs_pool: Pool) -> None:
    sub = btrfs_pool.tmp_dir / "with-mounts"
    await btrfs_pool.create_subvolume(sub)
    (sub / "proc").mkdir()
    # What a killed debootstrap leaves: its target's /proc still mounted (here twice, stacked).
    for _ in range(2):
        await privileged.run("mount", "-t", "tmpfs", "tmpfs", str(sub / "proc"))

    await btrfs_pool.delete_subvolume(sub)

    assert not sub.exists()
    assert mount_count(sub / "proc") == 0
