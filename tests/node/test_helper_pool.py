"""The helper's pool verbs (``subvol.*``, ``tree.*``) through the in-process backend, on a real
loop btrfs pool.

Aspects: every verb does what the Pool methods did; a REL is confined to the pool's areas (no
``..``, no absolute path, no unknown area, no symlink, no mount crossing) and a refused call
changes nothing outside the pool; snapshots never overwrite; tree.delete removes nested (also
read-only) subvolumes and mounts left beneath, never what a bind mount beneath shows, and is a
no-op on a missing path.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from space.errors import Conflict, InvalidPath, InvalidRequest, NotFound
from space.node.helper.backend import InProcess
from space.node.helper.verbs import HelperContext
from space.node.storage.mountinfo import mounts
from space.node.storage.pool import Pool

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]


def is_subvolume(path: Path) -> bool:
    try:
        return path.lstat().st_ino == 256 and path.is_dir()
    except FileNotFoundError:
        return False


def mounted_beneath(path: Path) -> list[str]:
    prefix = str(path) + "/"
    return [m.target for m in mounts() if m.target == str(path) or m.target.startswith(prefix)]


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def lexists(path: Path) -> bool:
    return os.path.lexists(path)


def umount_all(path: Path) -> None:
    for target in sorted(mounted_beneath(path), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", target], check=False)


def snapshot_of(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its content (to prove a refused call changed nothing)."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            p = Path(dirpath) / name
            out[str(p.relative_to(path))] = p.read_bytes()
    return out


@pytest.fixture
def priv(btrfs_pool: Pool, tmp_path: Path) -> InProcess:
    return InProcess(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=tmp_path / "cache",
                                   pool_root=btrfs_pool.root))


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    """A directory outside the pool with content that must survive every test."""
    canary = tmp_path / "outside"
    (canary / "sub").mkdir(parents=True)
    (canary / "keep").write_text("precious")
    (canary / "sub" / "deep").write_text("also precious")
    yield canary
    assert snapshot_of(canary) == {"keep": b"precious", "sub/deep": b"also precious"}


@pytest.fixture
async def cleanup(priv: InProcess, btrfs_pool: Pool) -> AsyncIterator[list[str]]:
    """RELs to delete after the test (after lifting any mount a test left)."""
    rels: list[str] = []
    yield rels
    for rel in rels:
        umount_all(btrfs_pool.root / rel)
        await priv.call("tree.delete", {"rel": rel})
        assert not lexists(btrfs_pool.root / rel)


# -- each verb -------------------------------------------------------------------------------------


async def test_generation_moves_only_when_the_files_change(priv: InProcess, btrfs_pool: Pool,
                                                           cleanup: list[str]) -> None:
    root = btrfs_pool.root
    cleanup += ["tmp/hv-gen"]
    await priv.call("subvol.create", {"rel": "tmp/hv-gen"})
    first = (await priv.call("subvol.generation", {"rel": "tmp/hv-gen"}))["generation"]
    assert first == (await priv.call("subvol.generation", {"rel": "tmp/hv-gen"}))["generation"]
    # Written but not yet committed: the verb commits before it reads, so this is seen.
    (root / "tmp/hv-gen/file").write_bytes(b"x" * 4096)
    second = (await priv.call("subvol.generation", {"rel": "tmp/hv-gen"}))["generation"]
    assert second > first
    assert second == (await priv.call("subvol.generation", {"rel": "tmp/hv-gen"}))["generation"]
    with pytest.raises(NotFound):
        await priv.call("subvol.generation", {"rel": "tmp/hv-gen-missing"})


async def test_create_snapshot_flags_and_du(priv: InProcess, btrfs_pool: Pool, cleanup: list[str]) -> None:
    root = btrfs_pool.root
    cleanup += ["sandboxes/hv-verbs", "tmp/hv-src"]

    await priv.call("subvol.create", {"rel": "tmp/hv-src"})
    assert is_subvolume(root / "tmp/hv-src")
    (root / "tmp/hv-src/data").write_bytes(os.urandom(1 << 20))
    # Parent directories of a new subvolume are made as needed.
    await priv.call("subvol.create", {"rel": "sandboxes/hv-verbs/rootfs"})
    assert (root / "sandboxes/hv-verbs").is_dir() and not is_subvolume(root / "sandboxes/hv-verbs")
    assert is_subvolume(root / "sandboxes/hv-verbs/rootfs")

    await priv.call("subvol.snapshot", {"src": "tmp/hv-src", "dst": "sandboxes/hv-verbs/snapshots/s1/rootfs",
                                        "readonly": True})
    snap = root / "sandboxes/hv-verbs/snapshots/s1/rootfs"
    assert is_subvolume(snap)
    assert (await priv.call("subvol.is_readonly", {"rel": "sandboxes/hv-verbs/snapshots/s1/rootfs"})) == {
        "readonly": True}
    with pytest.raises(OSError) as excinfo:
        (snap / "data").write_bytes(b"x")
    assert excinfo.value.errno == errno.EROFS

    result = await priv.call("subvol.set_readonly", {"rel": "sandboxes/hv-verbs/snapshots/s1/rootfs", "ro": False})
    assert result == {"readonly": False}
    (snap / "data").write_bytes(b"changed")
    assert (root / "tmp/hv-src/data").stat().st_size == 1 << 20

    await priv.call("subvol.snapshot", {"src": "tmp/hv-src", "dst": "tmp/hv-src-rw"})
    cleanup.append("tmp/hv-src-rw")
    assert (await priv.call("subvol.is_readonly", {"rel": "tmp/hv-src-rw"})) == {"readonly": False}
    # A fresh snapshot shares every extent; a rewritten file is the snapshot's own.
    assert (await priv.call("subvol.du", {"rel": "tmp/hv-src-rw"})) == {"exclusive_bytes": 0}
    (root / "tmp/hv-src-rw/data").write_bytes(os.urandom(1 << 20))
    os.sync()
    du = await priv.call("subvol.du", {"rel": "tmp/hv-src-rw"})
    assert du["exclusive_bytes"] >= 1 << 20

    await priv.call("tree.delete", {"rel": "sandboxes/hv-verbs"})
    assert not (root / "sandboxes/hv-verbs").exists()


async def test_tree_size_counts_regular_files_beneath_only(priv: InProcess, btrfs_pool: Pool, tmp_path: Path,
                                                          cleanup: list[str]) -> None:
    root = btrfs_pool.root
    cleanup.append("tmp/hv-size")
    await priv.call("subvol.create", {"rel": "tmp/hv-size"})
    (root / "tmp/hv-size/a").write_bytes(b"x" * 1000)
    (root / "tmp/hv-size/d/e").mkdir(parents=True)
    (root / "tmp/hv-size/d/e/b").write_bytes(b"y" * 234)
    os.chmod(root / "tmp/hv-size/d", 0)  # unreadable to anyone but root: still counted
    outside = tmp_path / "big"
    outside.write_bytes(b"z" * 100_000)
    (root / "tmp/hv-size/link").symlink_to(outside)  # never followed
    (root / "tmp/hv-size/dirlink").symlink_to(tmp_path)
    assert await priv.call("tree.size", {"rel": "tmp/hv-size"}) == {"bytes": 1234}
    with pytest.raises(InvalidPath):
        await priv.call("tree.size", {"rel": "tmp/hv-size/dirlink"})


async def test_snapshot_and_create_never_overwrite(priv: InProcess, btrfs_pool: Pool, cleanup: list[str]) -> None:
    root = btrfs_pool.root
    cleanup += ["tmp/hv-ow-src", "tmp/hv-ow-dst", "tmp/hv-ow-file"]
    await priv.call("subvol.create", {"rel": "tmp/hv-ow-src"})
    (root / "tmp/hv-ow-dst").mkdir()
    (root / "tmp/hv-ow-file").write_text("plain")

    for dst in ("tmp/hv-ow-dst", "tmp/hv-ow-file", "tmp/hv-ow-src"):
        with pytest.raises(Conflict):
            await priv.call("subvol.snapshot", {"src": "tmp/hv-ow-src", "dst": dst})
        with pytest.raises(Conflict):
            await priv.call("subvol.create", {"rel": dst})
    assert list((root / "tmp/hv-ow-dst").iterdir()) == []
    assert (root / "tmp/hv-ow-file").read_text() == "plain"

    # The source must be a subvolume (a plain dir, a file or nothing is refused).
    for src in ("tmp/hv-ow-dst", "tmp/hv-ow-file", "tmp/hv-ow-missing"):
        with pytest.raises(InvalidPath):
            await priv.call("subvol.snapshot", {"src": src, "dst": "tmp/hv-ow-new"})
    assert not (root / "tmp/hv-ow-new").exists()
    with pytest.raises(InvalidPath):
        await priv.call("subvol.set_readonly", {"rel": "tmp/hv-ow-dst"})
    with pytest.raises(NotFound):
        await priv.call("subvol.is_readonly", {"rel": "tmp/hv-ow-missing"})


async def test_delete_of_nested_readonly_subvolumes_and_mounts(
    priv: InProcess, btrfs_pool: Pool, cleanup: list[str]
) -> None:
    root = btrfs_pool.root
    top = root / "sandboxes/hv-nested"
    cleanup.append("sandboxes/hv-nested")
    await priv.call("subvol.create", {"rel": "sandboxes/hv-nested/rootfs"})
    await priv.call("subvol.create", {"rel": "sandboxes/hv-nested/rootfs/var"})
    await priv.call("subvol.create", {"rel": "sandboxes/hv-nested/rootfs/var/inner"})
    (top / "rootfs/var/inner/file").write_text("x")
    (top / "rootfs/etc").mkdir()
    (top / "rootfs/etc/link").symlink_to("/etc/passwd")
    # Read-only subvolumes that still hold nested ones: the parent must be made writable first.
    await priv.call("subvol.set_readonly", {"rel": "sandboxes/hv-nested/rootfs/var"})
    await priv.call("subvol.set_readonly", {"rel": "sandboxes/hv-nested/rootfs"})
    await priv.call("subvol.snapshot", {"src": "sandboxes/hv-nested/rootfs",
                                        "dst": "sandboxes/hv-nested/snapshots/a/rootfs", "readonly": True})
    (top / "bundle").mkdir()
    (top / "bundle/config.json").write_text("{}")
    (top / "rootfs-link").symlink_to(top / "bundle")  # removed as a link, not followed
    # What a killed debootstrap leaves: /proc mounted in its target, twice, and one mount deeper.
    (top / "work/proc").mkdir(parents=True)
    for _ in range(2):
        mount("-t", "tmpfs", "tmpfs", str(top / "work/proc"))
    (top / "work/proc/sys").mkdir()
    mount("-t", "tmpfs", "tmpfs", str(top / "work/proc/sys"))
    assert len(mounted_beneath(top)) == 3

    await priv.call("tree.delete", {"rel": "sandboxes/hv-nested"})

    assert not top.exists()
    assert mounted_beneath(top) == []
    assert lexists(Path("/etc/passwd"))
    # Missing, and missing below a missing parent: no-ops.
    await priv.call("tree.delete", {"rel": "sandboxes/hv-nested"})
    await priv.call("tree.delete", {"rel": "sandboxes/hv-nested/rootfs/var/inner"})


async def test_delete_of_a_plain_file_and_a_read_only_leaf(priv: InProcess, btrfs_pool: Pool) -> None:
    root = btrfs_pool.root
    (root / "tmp/hv-file.json").write_text("{}")
    await priv.call("tree.delete", {"rel": "tmp/hv-file.json"})
    assert not (root / "tmp/hv-file.json").exists()

    await priv.call("subvol.create", {"rel": "tmp/hv-ro-leaf"})
    await priv.call("subvol.set_readonly", {"rel": "tmp/hv-ro-leaf"})
    await priv.call("tree.delete", {"rel": "tmp/hv-ro-leaf"})  # root deletes it without a flag change
    assert not (root / "tmp/hv-ro-leaf").exists()


# -- confinement -----------------------------------------------------------------------------------


BAD_RELS = [
    "sandboxes/../../etc", "sandboxes/x/..", "tmp/./x", "/etc/passwd", "/tmp/x", "etc/passwd",
    "pool.img/x", "sandboxes", "tmp", "", "sandboxes//x", "sandboxes/x/", "sandboxes/.hidden",
    "sandboxes/a b", "sandboxes/-x", "tmp/a/b/c/d/e/f", "sandboxes/" + "a" * 200,
]


@pytest.mark.parametrize("rel", BAD_RELS)
async def test_invalid_rels_are_refused(priv: InProcess, btrfs_pool: Pool, rel: str) -> None:
    before = sorted(p.name for p in btrfs_pool.root.iterdir())
    calls: list[tuple[str, dict[str, Any]]] = [
        ("subvol.create", {"rel": rel}),
        ("subvol.snapshot", {"src": "tmp/hv-none", "dst": rel}),
        ("subvol.snapshot", {"src": rel, "dst": "tmp/hv-none"}),
        ("subvol.set_readonly", {"rel": rel, "ro": True}),
        ("subvol.is_readonly", {"rel": rel}),
        ("subvol.generation", {"rel": rel}),
        ("subvol.du", {"rel": rel}),
        ("tree.delete", {"rel": rel}),
    ]
    for verb, args in calls:
        with pytest.raises(InvalidPath):
            await priv.call(verb, args)
    assert sorted(p.name for p in btrfs_pool.root.iterdir()) == before


async def test_malformed_arguments_are_refused(priv: InProcess) -> None:
    calls: list[tuple[str, dict[str, Any]]] = [
        ("subvol.create", {}),
        ("subvol.create", {"rel": 5}),
        ("subvol.create", {"rel": "tmp/x", "path": "/etc"}),
        ("subvol.snapshot", {"src": "tmp/a", "dst": "tmp/b", "readonly": "yes"}),
        ("tree.delete", {"rel": ["tmp", "x"]}),
    ]
    for verb, args in calls:
        with pytest.raises(InvalidRequest):
            await priv.call(verb, args)


async def test_a_planted_symlink_is_never_followed(
    priv: InProcess, btrfs_pool: Pool, outside: Path, cleanup: list[str]
) -> None:
    root = btrfs_pool.root
    cleanup += ["sandboxes/hv-link", "tmp/hv-link-src", "tmp/hv-link-in"]
    (root / "sandboxes/hv-link").symlink_to(outside)
    await priv.call("subvol.create", {"rel": "tmp/hv-link-src"})
    (root / "tmp/hv-link-in").symlink_to(root / "tmp/hv-link-src")  # even one that stays in the pool

    calls: list[tuple[str, dict[str, Any]]] = [
        ("subvol.create", {"rel": "sandboxes/hv-link/rootfs"}),
        ("subvol.create", {"rel": "sandboxes/hv-link/sub/rootfs"}),
        ("subvol.snapshot", {"src": "tmp/hv-link-src", "dst": "sandboxes/hv-link/snap"}),
        ("subvol.snapshot", {"src": "tmp/hv-link-in", "dst": "tmp/hv-link-out"}),
        ("subvol.set_readonly", {"rel": "tmp/hv-link-in", "ro": True}),
        ("subvol.is_readonly", {"rel": "tmp/hv-link-in"}),
        ("subvol.generation", {"rel": "tmp/hv-link-in"}),
        ("subvol.generation", {"rel": "sandboxes/hv-link/sub"}),
        ("subvol.du", {"rel": "sandboxes/hv-link/sub"}),
        ("tree.delete", {"rel": "sandboxes/hv-link/keep"}),
        ("tree.delete", {"rel": "sandboxes/hv-link/sub"}),
        ("tree.delete", {"rel": "sandboxes/hv-link/sub/deep"}),
    ]
    for verb, args in calls:
        with pytest.raises(InvalidPath):
            await priv.call(verb, args)
    assert not (root / "tmp/hv-link-out").exists()
    assert (await priv.call("subvol.is_readonly", {"rel": "tmp/hv-link-src"})) == {"readonly": False}

    # Deleting the link itself removes the link, never what it points to.
    await priv.call("tree.delete", {"rel": "sandboxes/hv-link"})
    assert not lexists(root / "sandboxes/hv-link")
    assert (outside / "keep").exists()


async def test_a_mount_beneath_is_not_crossed(
    priv: InProcess, btrfs_pool: Pool, outside: Path, cleanup: list[str]
) -> None:
    root = btrfs_pool.root
    cleanup += ["sandboxes/hv-bind", "tmp/hv-bind-src"]
    (root / "sandboxes/hv-bind/mnt").mkdir(parents=True)
    await priv.call("subvol.create", {"rel": "tmp/hv-bind-src"})
    mount("--bind", str(outside), str(root / "sandboxes/hv-bind/mnt"))
    try:
        calls: list[tuple[str, dict[str, Any]]] = [
            ("subvol.create", {"rel": "sandboxes/hv-bind/mnt/rootfs"}),
            ("subvol.snapshot", {"src": "tmp/hv-bind-src", "dst": "sandboxes/hv-bind/mnt/snap"}),
            ("subvol.is_readonly", {"rel": "sandboxes/hv-bind/mnt"}),
            ("subvol.du", {"rel": "sandboxes/hv-bind/mnt"}),
            ("subvol.du", {"rel": "sandboxes/hv-bind/mnt/sub"}),
        ]
        for verb, args in calls:
            with pytest.raises(InvalidPath):
                await priv.call(verb, args)
        assert sorted(os.listdir(outside)) == ["keep", "sub"]

        # tree.delete lifts the bind mount first, then deletes only what is in the pool.
        await priv.call("tree.delete", {"rel": "sandboxes/hv-bind"})
        assert not (root / "sandboxes/hv-bind").exists()
        assert mounted_beneath(root / "sandboxes/hv-bind") == []
    finally:
        umount_all(root / "sandboxes/hv-bind")
