"""ObjectStore on a local directory and on S3 (moto): every method, streaming, checks and errors.

Aspects: small objects round-trip; missing objects are NotFound naming the key; listing is by whole
segments and sorted; deletes are idempotent; a ~20 MB streamed upload reports the right size and
sha256; a failing producer leaves no object; downloads are verified, atomic and leave nothing on
failure; keys that could escape the store are refused; URLs are parsed strictly; an unreachable
store is Unavailable.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space.errors import InvalidPath, InvalidRequest, NotFound, SnapshotCorrupt, Unavailable
from space.objstore import ObjectStore
from tests.e2e.harness import free_port
from tests.objstore.conftest import Backend

pytestmark = pytest.mark.anyio


async def test_small_objects_round_trip(store: ObjectStore) -> None:
    await store.put_bytes("a/b/c.txt", b"hello")
    assert await store.get_bytes("a/b/c.txt") == b"hello"
    assert await store.exists("a/b/c.txt")
    assert await store.size("a/b/c.txt") == 5
    await store.put_bytes("a/b/c.txt", b"replaced")
    assert await store.get_bytes("a/b/c.txt") == b"replaced"
    await store.put_bytes("empty", b"")
    assert await store.get_bytes("empty") == b""
    assert await store.size("empty") == 0


async def test_missing_objects(store: ObjectStore) -> None:
    assert not await store.exists("nope/x")
    assert await store.size("nope/x") is None
    with pytest.raises(NotFound, match="nope/x") as exc:
        await store.get_bytes("nope/x")
    assert exc.value.details["key"] == "nope/x"


async def test_list_and_delete(store: ObjectStore) -> None:
    for key in ("snap/1/b", "snap/1/a", "snap/1/sub/c", "snap/10/x", "other"):
        await store.put_bytes(key, key.encode())
    assert await store.list("snap/1") == ["snap/1/a", "snap/1/b", "snap/1/sub/c"]
    assert await store.list("snap/1/") == ["snap/1/a", "snap/1/b", "snap/1/sub/c"]
    assert await store.list("") == ["other", "snap/1/a", "snap/1/b", "snap/1/sub/c", "snap/10/x"]
    assert await store.list("missing") == []

    await store.delete("snap/1/a")
    await store.delete("snap/1/a")  # idempotent
    assert not await store.exists("snap/1/a")

    assert await store.delete_prefix("snap/1") == 2
    assert await store.list("snap") == ["snap/10/x"]
    assert await store.delete_prefix("snap/1") == 0
    with pytest.raises(InvalidPath):
        await store.delete_prefix("")


def pseudo_random_chunks(total: int, chunk: int, seed: int) -> tuple[AsyncIterator[bytes], hashlib._Hash]:
    """A deterministic byte stream made on the fly, and the digest it will have when consumed."""
    rng = random.Random(seed)
    expected = hashlib.sha256()

    async def gen() -> AsyncIterator[bytes]:
        left = total
        while left:
            n = min(chunk, left)
            data = rng.randbytes(n)
            expected.update(data)
            left -= n
            yield data

    return gen(), expected


async def test_stream_upload_of_20mb(store: ObjectStore, tmp_path: Path) -> None:
    total = 20 * 1024 * 1024 + 12345  # not a multiple of the part size
    chunks, expected = pseudo_random_chunks(total, 1 << 20, seed=7)
    result = await store.put_stream("big/blob", chunks)
    assert result.size == total
    assert result.sha256 == expected.hexdigest()
    assert await store.size("big/blob") == total

    dest = tmp_path / "blob"
    got = await store.get_to_file("big/blob", dest, expected_sha256=result.sha256, expected_size=total)
    assert got == total
    assert dest.stat().st_size == total
    h = hashlib.sha256()
    with dest.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    assert h.hexdigest() == result.sha256


async def test_failing_producer_leaves_no_object(store: ObjectStore) -> None:
    class ProducerDied(Exception):
        pass

    async def dying() -> AsyncIterator[bytes]:
        for _ in range(12):
            yield b"x" * (1 << 20)
        raise ProducerDied("btrfs send exited 1")

    with pytest.raises(ProducerDied):
        await store.put_stream("partial/blob", dying())
    assert not await store.exists("partial/blob")
    assert await store.list("partial") == []


async def test_put_file_and_get_to_file(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(random.Random(1).randbytes(3 * 1024 * 1024 + 1))
    result = await store.put_file("files/src.bin", src)
    assert result.size == src.stat().st_size
    assert result.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()

    dest = tmp_path / "out" / "dest.bin"
    dest.parent.mkdir()
    dest.write_bytes(b"an older version")
    assert await store.get_to_file("files/src.bin", dest, expected_sha256=result.sha256) == result.size
    assert dest.read_bytes() == src.read_bytes()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["dest.bin"]

    with pytest.raises(NotFound, match="does not exist"):
        await store.put_file("files/none", tmp_path / "none")


async def test_get_to_file_verifies_and_leaves_nothing_on_failure(store: ObjectStore, tmp_path: Path) -> None:
    await store.put_bytes("v/obj", b"0123456789")
    good = hashlib.sha256(b"0123456789").hexdigest()
    out = tmp_path / "out"
    out.mkdir()

    with pytest.raises(SnapshotCorrupt, match="v/obj") as exc:
        await store.get_to_file("v/obj", out / "f", expected_sha256="0" * 64)
    assert "checksum" in exc.value.message and exc.value.details["key"] == "v/obj"
    with pytest.raises(SnapshotCorrupt, match=r"v/obj has 10 bytes, 11 were expected"):
        await store.get_to_file("v/obj", out / "f", expected_sha256=good, expected_size=11)
    with pytest.raises(SnapshotCorrupt, match=r"v/obj is larger"):
        await store.get_to_file("v/obj", out / "f", expected_size=4)
    with pytest.raises(NotFound, match="v/missing"):
        await store.get_to_file("v/missing", out / "f")
    assert list(out.iterdir()) == []

    # An existing file survives a failed download untouched.
    (out / "f").write_bytes(b"keep me")
    with pytest.raises(SnapshotCorrupt):
        await store.get_to_file("v/obj", out / "f", expected_sha256="0" * 64)
    assert (out / "f").read_bytes() == b"keep me"
    assert [p.name for p in out.iterdir()] == ["f"]


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/abs", "a//b", "./a", "a/./b", "a\\b", ""])
async def test_keys_that_could_escape_are_refused(backend: Backend, key: str, tmp_path: Path) -> None:
    store = backend.store
    with pytest.raises(InvalidPath):
        await store.put_bytes(key, b"x")
    with pytest.raises(InvalidPath):
        await store.get_bytes(key)
    with pytest.raises(InvalidPath):
        await store.get_to_file(key, tmp_path / "f")
    with pytest.raises(InvalidPath):
        await store.exists(key)
    with pytest.raises(InvalidPath):
        await store.delete(key)
    if key:
        with pytest.raises(InvalidPath):
            await store.list(key)
        with pytest.raises(InvalidPath):
            await store.delete_prefix(key)
    assert _names(tmp_path) <= {"objects"}


def _names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


async def test_local_urls(tmp_path: Path) -> None:
    plain = ObjectStore.from_url(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()
    await plain.put_bytes("k", b"1")
    assert (tmp_path / "a" / "b" / "k").read_bytes() == b"1"
    assert plain.url == str(tmp_path / "a" / "b")
    assert str(tmp_path / "a" / "b") in plain.describe()

    via_file_url = ObjectStore.from_url(f"file://{tmp_path}/a/b")
    assert await via_file_url.get_bytes("k") == b"1"

    with pytest.raises(InvalidRequest):
        ObjectStore.from_url("file://otherhost/dir")
    for bad in ("", "gs://bucket/x", "http://example.invalid/x"):
        with pytest.raises(InvalidRequest):
            ObjectStore.from_url(bad)


@pytest.mark.usefixtures("s3_credentials")
def test_s3_urls() -> None:
    store = ObjectStore.from_url("s3://bkt/some/prefix?endpoint=http://127.0.0.1:9&region=eu-west-1")
    assert store.describe() == "s3://bkt/some/prefix (endpoint http://127.0.0.1:9, region eu-west-1)"
    assert "space-test" not in store.describe()
    assert ObjectStore.from_url("s3://bkt").describe() == "s3://bkt"
    for bad in ("s3:///prefix", "s3://bkt/x?color=blue", "s3://key:secret@bkt/x", "s3://bkt/../x",
                "s3://bkt/x?endpoint=http://127.0.0.1:9&allow_http=maybe"):
        with pytest.raises(InvalidRequest):
            ObjectStore.from_url(bad)


@pytest.mark.usefixtures("s3_credentials")
async def test_unreachable_s3_is_unavailable() -> None:
    port = free_port()  # nothing listens there
    store = ObjectStore.from_url(f"s3://bkt/p?endpoint=http://127.0.0.1:{port}", max_retries=0)
    with pytest.raises(Unavailable, match="k") as exc:
        await store.get_bytes("k")
    assert exc.value.retryable
    with pytest.raises(Unavailable):
        await store.put_bytes("k", b"x")
