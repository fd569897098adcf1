"""File operations of the guest daemon (it runs on the host here, so tmp_path is its file system)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space import errors
from space.node.sandboxes import guest_client
from space.node.sandboxes.guest_client import GuestConnection
from tests.waiting import await_for

MiB = 1 << 20


async def chunks_of(data: bytes, size: int = MiB) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def read_all(conn: GuestConnection, path: str, **args: object) -> tuple[bytes, dict[str, object]]:
    stream = conn.stream("fs.read", path=path, **args)
    buf = bytearray()
    async for _, payload in stream:
        buf += payload
    assert stream.result is not None
    return bytes(buf), stream.result


async def test_write_read_round_trip(conn: GuestConnection, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(5 * MiB + 12345)
    target = tmp_path / "deep" / "dir" / "blob.bin"
    res = await conn.upload("fs.write", chunks_of(data), path=str(target), mode=0o600)
    entry = res["entry"]
    assert entry["type"] == "file" and entry["size"] == len(data) and entry["mode"] == 0o600
    assert entry["path"] == str(target) and entry["name"] == "blob.bin"
    assert target.read_bytes() == data
    # Read in several windows (one request each) and in one.
    monkeypatch.setattr(guest_client, "READ_WINDOW", MiB)
    got, result = await read_all(conn, str(target))
    assert got == data and result["size"] == len(data)
    got, _ = await read_all(conn, str(target), offset=1000, length=3 * MiB)
    assert got == data[1000 : 1000 + 3 * MiB]
    got, _ = await read_all(conn, str(target), offset=len(data) - 10)
    assert got == data[-10:]


async def test_aborted_upload_leaves_nothing(conn: GuestConnection, tmp_path: Path) -> None:
    target = tmp_path / "partial.bin"

    async def failing() -> AsyncIterator[bytes]:
        yield b"x" * (2 * MiB)
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError):
        await conn.upload("fs.write", failing(), path=str(target))
    # The guest drops the temporary file once it sees the abort: wait for that, with a deadline.
    async def emptied() -> bool:
        return not (await conn.request("fs.list", path=str(tmp_path)))["entries"]

    await await_for(emptied, 10, "the aborted upload's temporary file to go")
    assert not target.exists()


async def test_overwrite_is_atomic_replace(conn: GuestConnection, tmp_path: Path) -> None:
    target = tmp_path / "f.txt"
    target.write_text("old")
    await conn.upload("fs.write", chunks_of(b"new contents"), path=str(target))
    assert target.read_text() == "new contents"
    assert os.listdir(tmp_path) == ["f.txt"]


async def test_upload_errors(conn: GuestConnection, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(errors.NotFound):
        await conn.upload("fs.write", chunks_of(b"abc"), path=str(tmp_path / "missing" / "f"), mkdirs=False)
    with pytest.raises(errors.Conflict):
        await conn.upload("fs.write", chunks_of(b"abc"), path=str(tmp_path / "file" / "f"))
    with pytest.raises(errors.Conflict):
        await conn.upload("fs.write", chunks_of(b"abc"), path=str(tmp_path))
    with pytest.raises(errors.InvalidPath):
        await conn.upload("fs.write", chunks_of(b"abc"), path="relative/f")
    assert (await conn.request("hello"))["version"] == 1


async def test_stat_list_mkdir_move_remove(conn: GuestConnection, tmp_path: Path) -> None:
    base = str(tmp_path)
    made = (await conn.request("fs.mkdir", path=f"{base}/a/b/c"))["entry"]
    assert made["type"] == "dir" and made["path"] == f"{base}/a/b/c"
    assert (await conn.request("fs.mkdir", path=f"{base}/a/b/c"))["entry"]["type"] == "dir"
    (tmp_path / "a" / "f.txt").write_text("hello")
    os.symlink("f.txt", tmp_path / "a" / "link")
    with pytest.raises(errors.Conflict):
        await conn.request("fs.mkdir", path=f"{base}/a/f.txt")
    with pytest.raises(errors.NotFound):
        await conn.request("fs.mkdir", path=f"{base}/x/y", parents=False)

    st = (await conn.request("fs.stat", path=f"{base}/a/link"))["entry"]
    assert st["type"] == "symlink" and st["symlink_target"] == "f.txt"
    st = (await conn.request("fs.stat", path=f"{base}/a/f.txt"))["entry"]
    assert st["size"] == 5 and st["owner"] == "root"
    assert st["mode"] == (tmp_path / "a" / "f.txt").stat().st_mode & 0o7777
    assert isinstance(st["mtime"], float)

    names = [e["name"] for e in (await conn.request("fs.list", path=f"{base}/a"))["entries"]]
    assert names == ["b", "f.txt", "link"]
    deep = [e["path"] for e in (await conn.request("fs.list", path=f"{base}/a", depth=3))["entries"]]
    assert deep == [f"{base}/a/b", f"{base}/a/b/c", f"{base}/a/f.txt", f"{base}/a/link"]
    with pytest.raises(errors.InvalidRequest):
        await conn.request("fs.list", path=f"{base}/a/f.txt")

    moved = (await conn.request("fs.move", src=f"{base}/a/f.txt", dst=f"{base}/a/b/g.txt"))["entry"]
    assert moved["path"] == f"{base}/a/b/g.txt" and (tmp_path / "a/b/g.txt").read_text() == "hello"
    with pytest.raises(errors.NotFound):
        await conn.request("fs.move", src=f"{base}/nope", dst=f"{base}/x")
    with pytest.raises(errors.Conflict):
        await conn.request("fs.move", src=f"{base}/a/b/g.txt", dst=f"{base}/a/b/c")

    with pytest.raises(errors.Conflict):
        await conn.request("fs.remove", path=f"{base}/a/b")
    await conn.request("fs.remove", path=f"{base}/a/link")
    await conn.request("fs.remove", path=f"{base}/a/b", recursive=True)
    assert [p.name for p in (tmp_path / "a").iterdir()] == []
    with pytest.raises(errors.NotFound):
        await conn.request("fs.remove", path=f"{base}/a/b")
    with pytest.raises(errors.Forbidden):
        await conn.request("fs.remove", path="/", recursive=True)


async def test_invalid_and_missing_paths(conn: GuestConnection, tmp_path: Path) -> None:
    for bad in ("/../etc/passwd", "/a/../../etc", "relative", "", "/tmp/a\x00b"):
        with pytest.raises(errors.InvalidPath):
            await conn.request("fs.stat", path=bad)
    with pytest.raises(errors.InvalidPath):
        await read_all(conn, "/../../etc/passwd")
    # `..` that stays inside / is normalized, not refused.
    st = (await conn.request("fs.stat", path=f"{tmp_path}/../{tmp_path.name}/."))["entry"]
    assert st["path"] == str(tmp_path)
    with pytest.raises(errors.NotFound):
        await conn.request("fs.stat", path=f"{tmp_path}/missing")
    with pytest.raises(errors.NotFound):
        await read_all(conn, f"{tmp_path}/missing")
    with pytest.raises(errors.InvalidRequest):
        await read_all(conn, str(tmp_path))


async def test_files_owned_by_user(conn: GuestConnection, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    res = await conn.upload("fs.write", chunks_of(b"hi"), path=f"{tmp_path}/u/new/f", user="nobody")
    assert res["entry"]["owner"] == "nobody"
    assert (await conn.request("fs.stat", path=f"{tmp_path}/u/new"))["entry"]["owner"] == "nobody"
    assert (await conn.request("fs.stat", path=str(tmp_path)))["entry"]["owner"] == "root"
    made = await conn.request("fs.mkdir", path=f"{tmp_path}/v/w", user="nobody")
    assert made["entry"]["owner"] == "nobody"


async def test_large_listing_spans_frames(conn: GuestConnection, tmp_path: Path) -> None:
    for i in range(1500):
        (tmp_path / f"file-with-a-longish-name-{i:05d}.txt").touch()
    entries = (await conn.request("fs.list", path=str(tmp_path)))["entries"]
    assert len(entries) == 1500 and entries[0]["name"] == "file-with-a-longish-name-00000.txt"
    assert entries[-1]["name"] == "file-with-a-longish-name-01499.txt"
