"""Files through the SDK: streamed uploads in 1 MiB chunks, streamed downloads, and metadata calls.

Aspects: uploads of a local file, an open file and an iterator arrive as chunks (not one buffer);
downloads land atomically, also into a directory; list/stat/exists/mkdir/move/remove shapes;
an escaping path is InvalidPath.
"""

from __future__ import annotations

import io
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space import AsyncClient, Client, errors
from space.sdk import AsyncSandbox, Sandbox
from space.sdk._local import CHUNK_SIZE
from tests.sdk.fake_api import FakeAPI

BLOB = os.urandom(2 * CHUNK_SIZE + 12345)


@pytest.fixture
async def sandbox(aclient: AsyncClient) -> AsyncSandbox:
    return await aclient.sandboxes.create()


@pytest.fixture
def sync_sandbox(client: Client) -> Sandbox:
    return client.sandboxes.create()


async def test_upload_streams_a_local_file_in_chunks(
    fake: FakeAPI, sandbox: AsyncSandbox, tmp_path: Path
) -> None:
    local = tmp_path / "blob"
    local.write_bytes(BLOB)
    entry = await sandbox.files.upload(local, "/home/user/blob")
    assert entry["size"] == len(BLOB) and entry["type"] == "file"
    [put] = fake.seen("PUT", "/files")
    assert put.params == {"path": "/home/user/blob"}
    assert [len(c) for c in put.chunks] == [CHUNK_SIZE, CHUNK_SIZE, 12345]
    assert put.headers.get("transfer-encoding") == "chunked" and "content-length" not in put.headers
    assert await sandbox.files.read("/home/user/blob") == BLOB


async def test_write_accepts_bytes_files_and_iterators(fake: FakeAPI, sandbox: AsyncSandbox) -> None:
    async def agen() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    await sandbox.files.write("/f1", b"bytes")
    await sandbox.files.write("/f2", io.BytesIO(b"line1\nline2\n"))
    await sandbox.files.write("/f3", iter([b"x", b"y"]))
    await sandbox.files.write("/f4", agen())
    chunks = [s.chunks for s in fake.seen("PUT", "/files")]
    # An open file is read in chunks rather than split at newlines.
    assert chunks == [[b"bytes"], [b"line1\nline2\n"], [b"x", b"y"], [b"a", b"b"]]
    assert [await sandbox.files.read(p) for p in ("/f1", "/f2", "/f3", "/f4")] == \
        [b"bytes", b"line1\nline2\n", b"xy", b"ab"]


async def test_download_streams_and_lands_atomically(sandbox: AsyncSandbox, tmp_path: Path) -> None:
    await sandbox.files.write("/data/blob", BLOB)
    assert await sandbox.files.download("/data/blob", tmp_path / "out") == tmp_path / "out"
    assert (tmp_path / "out").read_bytes() == BLOB
    # Into a directory, like cp.
    assert await sandbox.files.download("/data/blob", tmp_path) == tmp_path / "blob"
    assert b"".join([c async for c in sandbox.files.read_stream("/data/blob")]) == BLOB
    with pytest.raises(errors.NotFound):
        await sandbox.files.download("/data/missing", tmp_path / "missing")
    assert sorted(os.listdir(tmp_path)) == ["blob", "out"]  # no partial file left


async def test_metadata_calls(fake: FakeAPI, sandbox: AsyncSandbox) -> None:
    assert (await sandbox.files.mkdir("/work"))["type"] == "dir"
    await sandbox.files.write("/work/a.txt", b"hi")
    assert [e["name"] for e in await sandbox.files.list("/work")] == ["a.txt"]
    assert fake.seen("GET", "/files/list")[0].params == {"path": "/work", "depth": "1"}
    assert (await sandbox.files.stat("/work/a.txt"))["size"] == 2
    moved = await sandbox.files.move("/work/a.txt", "/work/b.txt")
    assert moved["path"] == "/work/b.txt"
    assert fake.seen("POST", "/files/move")[0].json() == {"src": "/work/a.txt", "dst": "/work/b.txt"}
    assert await sandbox.files.exists("/work/b.txt") and not await sandbox.files.exists("/work/a.txt")
    with pytest.raises(errors.Conflict):
        await sandbox.files.remove("/work")
    await sandbox.files.remove("/work", recursive=True)
    assert fake.seen("DELETE", "/files")[-1].params == {"path": "/work", "recursive": "true"}
    assert not await sandbox.files.exists("/work")


async def test_escaping_paths_are_invalid(sandbox: AsyncSandbox) -> None:
    with pytest.raises(errors.InvalidPath):
        await sandbox.files.read("/home/../../etc/passwd")


def test_sync_round_trip(sync_sandbox: Sandbox, tmp_path: Path) -> None:
    local = tmp_path / "blob"
    local.write_bytes(BLOB)
    sync_sandbox.files.upload(local, "/blob")
    sync_sandbox.files.download("/blob", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == BLOB
    assert b"".join(sync_sandbox.files.read_stream("/blob")) == BLOB
