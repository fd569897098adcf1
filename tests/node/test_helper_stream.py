"""The helper's stream verbs (``stream.send``, ``stream.receive``) through the in-process backend, on
a real loop btrfs pool, and the agent's zstd side of them (:mod:`space.node.storage.shipping`).

Aspects: a sent stream received elsewhere in the pool is the same read-only tree, keeps a received
UUID and applies deltas (``-p``); a received stream must hold exactly the subvolume named, else it
is refused and nothing is left (no staging dir, nothing at the destination); the destination must
not exist; a garbage stream is refused; a cancelled receive kills btrfs and leaves nothing; REL
arguments cannot escape the pool (``..``, absolute, a symlink); a writable subvolume is not sent;
the fds are required; the agent's zstd side round-trips and reports a corrupt stream as zstd's.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from space import objauth
from space.errors import Conflict, InvalidRequest, NotFound, RuntimeFailure, SnapshotCorrupt
from space.kms import LOCAL, DataKeys, KeyRef, LocalKeyring
from space.node.helper.backend import InProcess
from space.node.helper.verbs import HelperContext
from space.node.storage import artifacts, shipping, snapshots
from space.node.storage.artifacts import Sealing
from space.node.storage.pool import Pool
from space.objstore import ObjectStore
from tests.node.poolkit import PoolFactory
from tests.waiting import await_for

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]

KEYS = objauth.ManifestKeys([objauth.generate_key()])


@pytest.fixture
def priv(btrfs_pool: Pool, tmp_path: Path) -> InProcess:
    return InProcess(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=tmp_path / "cache",
                                   pool_root=btrfs_pool.root))


def staging_dirs(pool: Pool) -> list[str]:
    return sorted(n for n in os.listdir(pool.root / "tmp") if n.startswith("recv-"))


def received_uuid(path: Path) -> str:
    show = subprocess.run(["btrfs", "subvolume", "show", str(path)], capture_output=True, text=True,
                          check=True).stdout
    return next(line.split()[-1] for line in show.splitlines() if "Received UUID" in line)


@pytest.fixture
def source(btrfs_pool: Pool) -> Iterator[Path]:
    """A read-only subvolume ``tmp/src-<rand>`` with a file in it."""
    path = btrfs_pool.tmp_dir / f"src-{uuid.uuid4().hex[:8]}"
    btrfs("subvolume", "create", str(path))
    (path / "etc").mkdir()
    (path / "etc" / "hello").write_text("from the source")
    subprocess.run(["btrfs", "property", "set", "-ts", str(path), "ro", "true"], check=True)
    yield path
    btrfs("subvolume", "delete", str(path))


async def send_to_file(priv: InProcess, rel: str, out: Path, parent: str | None = None) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        await priv.call("stream.send", {"rel": rel, "parent": parent}, fds={"stdout": fd})
    finally:
        os.close(fd)


async def receive_file(priv: InProcess, stream: Path, dest: str, name: str) -> dict[str, object]:
    fd = os.open(stream, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return await priv.call("stream.receive", {"dest": dest, "name": name}, fds={"stdin": fd})
    finally:
        os.close(fd)


def btrfs(*args: str) -> None:
    subprocess.run(["btrfs", "-q", *args], check=True)


def entries(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def rel(pool: Pool, path: Path) -> str:
    return path.relative_to(pool.root).as_posix()


@pytest.fixture
def dest(btrfs_pool: Pool) -> Iterator[Path]:
    """An empty ``sandboxes/<rand>`` directory to receive into, deleted afterwards."""
    path = btrfs_pool.root / "sandboxes" / f"recv-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    subprocess.run(["btrfs", "-q", "subvolume", "delete", *map(str, path.iterdir())], check=False)
    path.rmdir()


async def test_a_sent_stream_is_received_as_the_same_read_only_tree(
    btrfs_pool: Pool, priv: InProcess, source: Path, dest: Path, tmp_path: Path
) -> None:
    stream = tmp_path / "full.btrfs"
    await send_to_file(priv, rel(btrfs_pool, source), stream)

    got = await receive_file(priv, stream, rel(btrfs_pool, dest), source.name)

    target = dest / source.name
    assert got == {"rel": rel(btrfs_pool, target)}
    assert (target / "etc" / "hello").read_text() == "from the source"
    assert target.stat().st_ino == 256 and await btrfs_pool.is_readonly(target)
    assert received_uuid(target) != "-"
    assert staging_dirs(btrfs_pool) == []


async def test_a_delta_applies_on_top_of_its_parent(
    btrfs_pool: Pool, priv: InProcess, source: Path, dest: Path, tmp_path: Path
) -> None:
    child = btrfs_pool.tmp_dir / f"child-{uuid.uuid4().hex[:8]}"
    child_ro = btrfs_pool.tmp_dir / f"{child.name}-ro"
    try:
        btrfs("subvolume", "snapshot", str(source), str(child))
        (child / "etc" / "delta").write_text("only in the child")
        btrfs("subvolume", "snapshot", "-r", str(child), str(child_ro))
        stream = tmp_path / "delta.btrfs"
        await send_to_file(priv, rel(btrfs_pool, child_ro), stream, parent=rel(btrfs_pool, source))

        await receive_file(priv, stream, rel(btrfs_pool, dest), child_ro.name)

        got = dest / child_ro.name
        assert (got / "etc" / "delta").read_text() == "only in the child"
        assert (got / "etc" / "hello").read_text() == "from the source"
        assert stream.stat().st_size < 64 * 1024
    finally:
        btrfs("subvolume", "delete", str(child), str(child_ro))


async def test_a_stream_naming_another_subvolume_is_refused_and_leaves_nothing(
    btrfs_pool: Pool, priv: InProcess, source: Path, dest: Path, tmp_path: Path
) -> None:
    stream = tmp_path / "full.btrfs"
    await send_to_file(priv, rel(btrfs_pool, source), stream)

    with pytest.raises(RuntimeFailure, match="exactly the subvolume 'rootfs'"):
        await receive_file(priv, stream, rel(btrfs_pool, dest), "rootfs")

    assert entries(dest) == []
    assert staging_dirs(btrfs_pool) == []


async def test_receiving_onto_an_existing_name_is_refused(
    btrfs_pool: Pool, priv: InProcess, source: Path, dest: Path, tmp_path: Path
) -> None:
    stream = tmp_path / "full.btrfs"
    await send_to_file(priv, rel(btrfs_pool, source), stream)
    (dest / source.name).mkdir()
    (dest / source.name / "mine").write_text("keep")

    with pytest.raises(Conflict):
        await receive_file(priv, stream, rel(btrfs_pool, dest), source.name)

    assert [p.name for p in (dest / source.name).iterdir()] == ["mine"]
    assert staging_dirs(btrfs_pool) == []
    (dest / source.name / "mine").unlink()
    (dest / source.name).rmdir()


async def test_a_garbage_stream_is_refused_and_leaves_nothing(
    btrfs_pool: Pool, priv: InProcess, dest: Path, tmp_path: Path
) -> None:
    stream = tmp_path / "garbage"
    stream.write_bytes(b"btrfs-stream\x00" + os.urandom(4096))

    with pytest.raises(RuntimeFailure, match="btrfs receive"):
        await receive_file(priv, stream, rel(btrfs_pool, dest), "rootfs")

    assert entries(dest) == []
    assert staging_dirs(btrfs_pool) == []


async def test_a_cancelled_receive_kills_btrfs_and_leaves_nothing(
    btrfs_pool: Pool, priv: InProcess, source: Path, dest: Path, tmp_path: Path
) -> None:
    stream = tmp_path / "full.btrfs"
    await send_to_file(priv, rel(btrfs_pool, source), stream)
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, stream.read_bytes()[:200])  # a stream that never ends
        task = asyncio.create_task(priv.call("stream.receive", {"dest": rel(btrfs_pool, dest), "name": source.name},
                                             fds={"stdin": read_end}))

        async def staging() -> bool:
            return bool(staging_dirs(btrfs_pool))
        await await_for(staging, 30, "the receive's staging dir")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert staging_dirs(btrfs_pool) == []
        assert entries(dest) == []
        os.close(read_end)
        read_end = -1
        with pytest.raises(BrokenPipeError):  # btrfs receive, the only other reader, is gone
            os.write(write_end, b"more")
    finally:
        if read_end >= 0:
            os.close(read_end)
        os.close(write_end)


@pytest.mark.parametrize("bad", ["../x", "/etc", "tmp/../../x", "tmp/./x", "etc/passwd", "tmp", "tmp//x",
                                 "sandboxes/x/../../../etc"])
async def test_a_rel_escaping_the_pool_is_refused(priv: InProcess, bad: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        with pytest.raises(InvalidRequest):
            await priv.call("stream.send", {"rel": bad}, fds={"stdout": fd})
        with pytest.raises(InvalidRequest):
            await priv.call("stream.send", {"rel": "tmp/x", "parent": bad}, fds={"stdout": fd})
        if bad != "tmp":  # tmp + x is the valid tmp/x
            with pytest.raises(InvalidRequest):
                await priv.call("stream.receive", {"dest": bad, "name": "x"}, fds={"stdin": fd})
    finally:
        os.close(fd)
    assert out.stat().st_size == 0


async def test_a_symlinked_dest_is_refused(
    btrfs_pool: Pool, priv: InProcess, source: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    link = btrfs_pool.root / "sandboxes" / f"link-{uuid.uuid4().hex[:8]}"
    link.symlink_to(outside)
    stream = tmp_path / "full.btrfs"
    await send_to_file(priv, rel(btrfs_pool, source), stream)
    try:
        with pytest.raises(InvalidRequest):
            await receive_file(priv, stream, rel(btrfs_pool, link), source.name)
    finally:
        link.unlink()
    assert list(outside.iterdir()) == []
    assert staging_dirs(btrfs_pool) == []


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "x@notadigest"])
async def test_a_bad_subvolume_name_is_refused(priv: InProcess, name: str) -> None:
    with pytest.raises(InvalidRequest):
        await priv.call("stream.receive", {"dest": "templates", "name": name}, fds={"stdin": 0})


async def test_a_writable_subvolume_is_not_sent(btrfs_pool: Pool, priv: InProcess, tmp_path: Path) -> None:
    path = btrfs_pool.tmp_dir / f"rw-{uuid.uuid4().hex[:8]}"
    await btrfs_pool.create_subvolume(path)
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        with pytest.raises(Conflict, match="read-only"):
            await priv.call("stream.send", {"rel": rel(btrfs_pool, path)}, fds={"stdout": fd})
        with pytest.raises(NotFound):
            await priv.call("stream.send", {"rel": "tmp/no-such-subvolume"}, fds={"stdout": fd})
    finally:
        os.close(fd)
        await btrfs_pool.delete_subvolume(path)
    assert out.stat().st_size == 0


async def test_the_fds_are_required(priv: InProcess) -> None:
    with pytest.raises(InvalidRequest, match="stdout"):
        await priv.call("stream.send", {"rel": "tmp/x"})
    with pytest.raises(InvalidRequest, match="stdin"):
        await priv.call("stream.receive", {"dest": "templates", "name": "x"})
    with pytest.raises(InvalidRequest):
        await priv.call("stream.send", {"rel": "tmp/x"}, fds={"stdin": 0})


# -- the agent's side: zstd on a pipe ---------------------------------------------------------------


async def test_the_agents_compressed_send_and_receive_round_trip(
    btrfs_pool: Pool, source: Path, dest: Path, tmp_path: Path
) -> None:
    stream = tmp_path / "full.btrfs.zst"
    fd = os.open(stream, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        async with shipping.compressed_send(btrfs_pool, source, stdout=fd):
            pass
    finally:
        os.close(fd)
    assert stream.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # zstd's magic

    await shipping.receive_compressed(btrfs_pool, stream, dest, source.name)

    assert (dest / source.name / "etc" / "hello").read_text() == "from the source"


async def test_a_corrupt_compressed_stream_is_reported_as_zstds(
    btrfs_pool: Pool, dest: Path, tmp_path: Path
) -> None:
    stream = tmp_path / "bad.zst"
    stream.write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(2048))

    with pytest.raises(RuntimeFailure, match="zstd"):
        await shipping.receive_compressed(btrfs_pool, stream, dest, "rootfs")

    assert entries(dest) == []
    assert staging_dirs(btrfs_pool) == []


async def test_send_delta_streams_a_failing_send_as_an_error(btrfs_pool: Pool, tmp_path: Path) -> None:
    path = btrfs_pool.tmp_dir / f"rw-{uuid.uuid4().hex[:8]}"
    await btrfs_pool.create_subvolume(path)
    try:
        with pytest.raises(Conflict):
            async for _ in shipping.send_delta(path, path, pool=btrfs_pool):
                pass
    finally:
        await btrfs_pool.delete_subvolume(path)


# -- shipping a snapshot between two pools (file:// object store; no runtime needed) -----------------


@pytest.mark.parametrize("encrypted", [False, True])
async def test_a_shipped_snapshot_is_a_delta_that_lands_on_another_node(
    btrfs_pool: Pool, pool_factory: PoolFactory, tmp_path: Path, encrypted: bool
) -> None:
    """Also encrypted (a tenant's key, the local keyring): then no stored byte holds the sandbox's
    file or its memory image, and it lands all the same."""
    template = btrfs_pool.root / "templates" / f"ship-{uuid.uuid4().hex[:8]}@0123456789abcdef"
    sid, snap_id = f"sb-{uuid.uuid4().hex[:8]}", "snap-1"
    await btrfs_pool.create_subvolume(template)
    (template / "base-file").write_bytes(os.urandom(256 * 1024))
    await btrfs_pool.set_readonly(template)
    snap_root = snapshots.rootfs_of(btrfs_pool, sid, snap_id)
    work = btrfs_pool.sandbox_dir(sid) / "rootfs"
    await btrfs_pool.snapshot(template, work)
    (work / "changed").write_text("by the sandbox")
    await btrfs_pool.snapshot(work, snap_root, readonly=True)
    image = snapshots.image_of(btrfs_pool, sid, snap_id)
    image.mkdir()
    (image / "checkpoint.img").write_bytes(b"memory" * 100)
    snap = snapshots.LocalSnapshot(id=snap_id, sandbox_id=sid, kind="full", created_at=1.0, template="ship",
                                   template_digest="0123456789abcdef" * 4, cpu=1.0, memory_mb=256, env={},
                                   user=None)
    snapshots.commit(btrfs_pool, snap)
    store = ObjectStore.from_url(str(tmp_path / "objects"))
    other = pool_factory("other-node")
    try:
        # The other node gets the template from its stream, as TemplateStore does from the cache.
        stream = tmp_path / "template.zst"
        fd = os.open(stream, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            async with shipping.compressed_send(btrfs_pool, template, stdout=fd):
                pass
        finally:
            os.close(fd)
        await shipping.receive_compressed(other, stream, other.root / "templates", template.name)

        bound = artifacts.snapshot_binding(tenant="t", sandbox_id=sid, snapshot_id=snap_id, prefix="ship/test")
        sealing = Sealing(DataKeys({LOCAL: LocalKeyring([os.urandom(32)])}), KeyRef(LOCAL, "t"), os.urandom(32)) \
            if encrypted else None
        shipped = await shipping.upload(store, "ship/test", btrfs_pool, snap, template, {}, keys=KEYS, binding=bound,
                                        sealing=sealing)
        if encrypted:
            for key in await store.list("ship/test"):
                data = await store.get_bytes(key)
                assert b"memory" * 10 not in data and b"by the sandbox" not in data, key
        got = await shipping.download(store, "ship/test", other, sid, snap_id, keys=KEYS, binding=bound,
                                      sealing=sealing)

        rootfs_bytes = next(a["size"] for a in shipped["artifacts"] if a["name"] == shipping.ROOTFS_ARTIFACT)
        assert rootfs_bytes < 64 * 1024  # a delta: the template's 256 KiB of noise is not in it
        landed = snapshots.rootfs_of(other, sid, snap_id)
        assert (landed / "changed").read_text() == "by the sandbox"
        assert (landed / "base-file").read_bytes() == (template / "base-file").read_bytes()
        assert await other.is_readonly(landed)
        assert (snapshots.image_of(other, sid, snap_id) / "checkpoint.img").read_bytes() == b"memory" * 100
        assert got == snap
        assert staging_dirs(other) == []
    finally:
        await btrfs_pool.delete_subvolume(btrfs_pool.sandbox_dir(sid))
        await btrfs_pool.delete_subvolume(template)


async def test_a_snapshot_whose_stream_is_not_its_rootfs_is_corrupt_and_leaves_nothing(
    btrfs_pool: Pool, source: Path, tmp_path: Path
) -> None:
    # A manifest that is complete and consistent, but its rootfs stream names another subvolume.
    sid, snap_id = f"sb-{uuid.uuid4().hex[:8]}", "snap-x"
    store = ObjectStore.from_url(str(tmp_path / "objects"))
    raw = tmp_path / "stream.zst"
    fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        async with shipping.compressed_send(btrfs_pool, source, stdout=fd):
            pass
    finally:
        os.close(fd)
    snap = {"id": snap_id, "sandbox_id": "elsewhere", "kind": "disk", "created_at": 1.0, "template": "t",
            "template_digest": "0" * 64, "cpu": 1.0, "memory_mb": 256, "env": {}, "user": None}
    bound = artifacts.snapshot_binding(tenant="t", sandbox_id=sid, snapshot_id=snap_id, prefix="ship/evil")
    await artifacts.upload_snapshot(store, "ship/evil", [artifacts.Artifact(name=shipping.ROOTFS_ARTIFACT,
                                                                            path=raw)], {"snapshot": snap},
                                    keys=KEYS, binding=bound)

    with pytest.raises(SnapshotCorrupt):
        await shipping.download(store, "ship/evil", btrfs_pool, sid, snap_id, keys=KEYS, binding=bound)

    assert not snapshots.snapshot_dir(btrfs_pool, sid, snap_id).exists()
    assert not (btrfs_pool.root / "sandboxes" / sid / source.name).exists()
    assert staging_dirs(btrfs_pool) == []
