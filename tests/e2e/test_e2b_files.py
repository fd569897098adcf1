"""The official E2B SDK's filesystem against SPACE: read, write, list, info, exists, make_dir, remove,
rename, gzip both ways, signed URLs, health, watchers (with entries: envd 0.6.3), file metadata
refused by name (envd 0.6.2: no extended attributes in the sandbox's filesystem).

Mirrors E2B's own ``packages/python-sdk/tests/{sync,async}/sandbox_*/files``. One sandbox serves the
module (each test works in names of its own); the async tests connect to it with ``AsyncSandbox``.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e import e2b_env
from tests.e2e.harness import Server, runtime_available
from tests.waiting import await_for, wait_for

pytestmark = [pytest.mark.runtime, pytest.mark.skipif(runtime_available() is not None,
                                                      reason=str(runtime_available()))]

e2b = pytest.importorskip("e2b")

from e2b import (  # noqa: E402 -- after the importorskip
    AsyncSandbox,
    FilesystemEvent,
    FilesystemEventType,
    FileType,
    InvalidArgumentException,
    NotEnoughSpaceException,
    Sandbox,
    SandboxException,
    SandboxNotRunningException,
)
from e2b.exceptions import FileNotFoundException  # noqa: E402
from e2b.sandbox.filesystem.filesystem import WriteEntry  # noqa: E402

HOME = "/home/user"


@pytest.fixture(scope="module")
def made(server: Server) -> Iterator[e2b_env.Sandboxes]:
    with pytest.MonkeyPatch.context() as mp:
        e2b_env.point_sdk_at(mp, server)
        yield from e2b_env.sandboxes()


@pytest.fixture(scope="module")
def sbx(made: e2b_env.Sandboxes) -> Sandbox:
    s = Sandbox.create(metadata={"test": "files"})
    made.add(s.sandbox_id)
    return s


def fresh(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def envd(server: Server, sbx: Sandbox, token: bool = True) -> httpx.Client:
    """A raw client of the sandbox's envd, as the SDK addresses it."""
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token:
        headers["X-Access-Token"] = sbx._envd_access_token or ""
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


# -- write and read -------------------------------------------------------------------------------


def test_write_text_then_read(sbx: Sandbox) -> None:
    name = fresh("write") + ".txt"
    info = sbx.files.write(name, "This is a test file.")
    assert info.path == f"{HOME}/{name}" and info.name == name and info.type == FileType.FILE
    assert sbx.files.exists(name)
    assert sbx.files.read(name) == "This is a test file."
    assert sbx.files.read(f"{HOME}/{name}", format="bytes") == bytearray(b"This is a test file.")


def test_write_binary_streams_all_byte_values(sbx: Sandbox) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB: several chunks each way
    name = fresh("bin") + ".bin"
    info = sbx.files.write(name, io.BytesIO(data))  # a file-like: the octet-stream upload
    assert info.path == f"{HOME}/{name}"
    assert bytes(sbx.files.read(name, format="bytes")) == data
    with sbx.files.read(name, format="stream") as stream:
        assert b"".join(stream) == data
    sbx.files.write(name, b"")
    sbx.files.write(name, io.BytesIO(data), use_octet_stream=False)  # one multipart part, many chunks
    assert bytes(sbx.files.read(name, format="bytes")) == data
    it = iter([b"chunk-one,", b"chunk-two"])  # an iterable of chunks streams too
    sbx.files.write(name, it)
    assert sbx.files.read(name) == "chunk-one,chunk-two"


def test_write_files_many_parts(sbx: Sandbox) -> None:
    assert sbx.files.write_files([]) == []
    d = fresh("multi")
    entries = [WriteEntry(path=f"{d}/f{i}.txt", data=f"content {i}") for i in range(5)]
    entries.append(WriteEntry(path=f"{d}/raw.bin", data=b"\x00\xffbytes"))
    infos = sbx.files.write_files(entries)
    assert [i.path for i in infos] == [f"{HOME}/{e['path']}" for e in entries]
    assert all(i.type == FileType.FILE for i in infos)
    for i in range(5):
        assert sbx.files.read(f"{d}/f{i}.txt") == f"content {i}"
    assert bytes(sbx.files.read(f"{d}/raw.bin", format="bytes")) == b"\x00\xffbytes"
    mixed = sbx.files.write_files([WriteEntry(path=f"{d}/s.txt", data=io.StringIO("StringIO data")),
                                   WriteEntry(path=f"{d}/b.bin", data=io.BytesIO(b"BytesIO data"))])
    assert len(mixed) == 2
    assert sbx.files.read(f"{d}/s.txt") == "StringIO data"
    assert sbx.files.read(f"{d}/b.bin") == "BytesIO data"


def test_overwrite_and_parents_are_created(sbx: Sandbox) -> None:
    d = fresh("parents")
    path = f"{d}/a/b/file.txt"
    sbx.files.write(path, "Initial content.")
    assert sbx.commands.run(f"chmod 750 {path}").exit_code == 0
    sbx.files.write(path, "New.")
    assert sbx.files.read(path) == "New."
    assert sbx.files.get_info(path).mode == 0o750  # envd overwrites in place: the mode stays
    made_dir = sbx.files.get_info(f"{d}/a")
    assert made_dir.type == FileType.DIR and made_dir.owner == "user" and made_dir.group == "user"


def test_read_missing_and_directory(sbx: Sandbox) -> None:
    with pytest.raises(FileNotFoundException):
        sbx.files.read(fresh("missing") + ".txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.read(fresh("missing") + ".txt", format="stream")
    with pytest.raises(InvalidArgumentException):
        sbx.files.read(HOME)


def test_read_empty_file(sbx: Sandbox) -> None:
    name = fresh("empty")
    sbx.commands.run(f"touch {name}")
    assert sbx.files.read(name) == ""


def test_gzip_both_ways(sbx: Sandbox, server: Server) -> None:
    name = fresh("gz") + ".txt"
    content = "Streamed gzipped content. " * 10_000
    info = sbx.files.write(name, content, gzip=True)
    assert info.path == f"{HOME}/{name}"
    assert sbx.files.read(name) == content
    assert sbx.files.read(name, gzip=True) == content
    assert sbx.files.read(name, format="bytes", gzip=True).decode() == content
    with sbx.files.read(name, format="stream", gzip=True) as stream:
        assert b"".join(stream).decode() == content
    infos = sbx.files.write_files([WriteEntry(path=f"{name}.{i}", data=f"File {i}") for i in range(3)], gzip=True)
    assert len(infos) == 3
    assert [sbx.files.read(f"{name}.{i}") for i in range(3)] == ["File 0", "File 1", "File 2"]
    # On the wire the answer really is gzip when asked for, and plain when not.
    with envd(server, sbx) as c:
        with c.stream("GET", "/files", params={"path": name}, headers={"accept-encoding": "gzip"}) as r:
            assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
            raw = b"".join(r.iter_raw())
        assert len(raw) < len(content) // 10 and gzip.decompress(raw).decode() == content
        r = c.get("/files", params={"path": name}, headers={"accept-encoding": "identity"})
        assert "content-encoding" not in r.headers and r.content.decode() == content
        # Data gzip cannot shrink goes plain even when gzip is accepted (httpx accepts it by default).
        noise = os.urandom(300_000)
        sbx.files.write(f"{name}.bin", noise)
        r = c.get("/files", params={"path": f"{name}.bin"}, headers={"accept-encoding": "gzip"})
        assert "content-encoding" not in r.headers and r.content == noise
    assert sbx.files.read(f"{name}.bin", format="bytes", gzip=True) == noise


def test_upload_errors(sbx: Sandbox, server: Server) -> None:
    with envd(server, sbx) as c:
        r = c.post("/files", content=b"x", headers={"content-type": "application/octet-stream"})
        assert r.status_code == 400 and "path" in r.json()["message"]
        r = c.post("/files", params={"path": "x"}, content=b"x", headers={"content-type": "text/plain"})
        assert r.status_code == 400 and r.json()["code"] == 400
        r = c.post("/files", params={"path": "bad.gz"}, content=b"not gzip at all",
                   headers={"content-type": "application/octet-stream", "content-encoding": "gzip"})
        assert r.status_code == 400 and "decompress" in r.json()["message"]
        # The upload limit (64 MiB on the test server) counts what lands on disk: a small gzip bomb.
        bomb = gzip.compress(b"\0" * (65 << 20))
        r = c.post("/files", params={"path": "bomb.bin"}, content=bomb,
                   headers={"content-type": "application/octet-stream", "content-encoding": "gzip"})
        assert r.status_code == 413
        assert not sbx.files.exists("bomb.bin")
        r = c.post("/files", params={"path": HOME}, content=b"x", headers={"content-type": "application/octet-stream"})
        assert r.status_code == 400 and "directory" in r.json()["message"]


def test_full_disk_is_not_enough_space(sbx: Sandbox) -> None:
    # /dev/full answers every write with ENOSPC, as a full disk does (a tmpfs cannot be mounted here).
    with pytest.raises(NotEnoughSpaceException):
        sbx.files.write("/dev/full", io.BytesIO(b"x" * (1 << 20)), user="root")
    with pytest.raises(NotEnoughSpaceException):
        sbx.files.write("/dev/full", "y" * 1000, user="root")


def test_user_root_writes_as_root(sbx: Sandbox) -> None:
    name = fresh("rootfile")
    info = sbx.files.write(name, "secret", user="root")
    assert info.path == f"/root/{name}"  # relative to root's home
    entry = sbx.files.get_info(f"/root/{name}")
    assert entry.owner == "root" and entry.group == "root"
    assert sbx.files.read(name, user="root") == "secret"
    assert sbx.files.make_dir(f"/tmp/{name}/d", user="root")
    assert sbx.files.get_info(f"/tmp/{name}/d").owner == "root"
    mine = sbx.files.write(f"/tmp/{name}/mine", "x")
    assert sbx.files.get_info(mine.path).owner == "user"


# -- list, info, exists ---------------------------------------------------------------------------


def test_list_depths(sbx: Sandbox) -> None:
    d = fresh("test_directory")
    for sub in ("subdir1/subdir1_1", "subdir1/subdir1_2", "subdir2/subdir2_1", "subdir2/subdir2_2"):
        sbx.files.make_dir(f"{d}/{sub}")
    sbx.files.write(f"{d}/file1.txt", "Hello, world!")
    top = ["file1.txt", "subdir1", "subdir2"]
    for depth in (None, 1):
        files = sbx.files.list(d, depth=depth)
        assert [f.name for f in files] == top
        assert [f.path for f in files] == [f"{HOME}/{d}/{n}" for n in top]
        assert [f.type for f in files] == [FileType.FILE, FileType.DIR, FileType.DIR]
    deep = ["file1.txt", "subdir1", "subdir1/subdir1_1", "subdir1/subdir1_2", "subdir2", "subdir2/subdir2_1",
            "subdir2/subdir2_2"]
    for depth in (2, 3):
        files = sbx.files.list(d, depth=depth)
        assert [f.path for f in files] == [f"{HOME}/{d}/{n}" for n in deep]
        assert [f.name for f in files] == [n.rsplit("/", 1)[-1] for n in deep]
    with pytest.raises(InvalidArgumentException, match="depth should be at least 1"):
        sbx.files.list(d, depth=-1)
    with pytest.raises(FileNotFoundException):
        sbx.files.list(fresh("no_such_dir"))
    with pytest.raises(InvalidArgumentException):
        sbx.files.list(f"{d}/file1.txt")


def test_entry_details(sbx: Sandbox) -> None:
    d = fresh("test-entry")
    sbx.files.make_dir(f"{d}/subdir")
    sbx.files.write(f"{d}/test.txt", "Hello, World!")
    entries = {e.name: e for e in sbx.files.list(d)}
    f, sub = entries["test.txt"], entries["subdir"]
    assert (f.path, f.type, f.mode, f.permissions) == (f"{HOME}/{d}/test.txt", FileType.FILE, 0o644, "-rw-r--r--")
    assert (f.owner, f.group, f.size, f.symlink_target) == ("user", "user", 13, None)
    assert f.modified_time.tzinfo is not None
    assert (sub.type, sub.mode, sub.permissions, sub.owner, sub.group) == (
        FileType.DIR, 0o755, "drwxr-xr-x", "user", "user")
    info = sbx.files.get_info(f"{d}/test.txt")
    pwd = sbx.commands.run("pwd").stdout.strip()
    assert (info.name, info.path, info.size, info.permissions) == ("test.txt", f"{pwd}/{d}/test.txt", 13,
                                                                    "-rw-r--r--")
    assert info.modified_time == f.modified_time
    dinfo = sbx.files.get_info(d)
    assert (dinfo.type, dinfo.mode, dinfo.permissions, dinfo.owner) == (FileType.DIR, 0o755, "drwxr-xr-x", "user")
    assert sbx.files.get_info("/tmp").permissions == "dtrwxrwxrwx"  # Go's FileMode.String
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info(fresh("nope"))


def test_symlinks_report_their_target(sbx: Sandbox) -> None:
    d = fresh("test-symlink")
    sbx.files.write(f"{d}/test.txt", "Hello, World!")
    sbx.files.make_dir(f"{d}/dir")
    r = sbx.commands.run("ln -s test.txt link && ln -s dir dlink && ln -s nowhere broken", cwd=d)  # relative: ~
    assert r.exit_code == 0
    link = sbx.files.get_info(f"{d}/link")
    assert link.type == FileType.FILE and link.symlink_target == f"{HOME}/{d}/test.txt"
    assert link.mode == 0o644 and link.permissions == "Lrwxrwxrwx"
    assert sbx.files.get_info(f"{d}/dlink").type == FileType.DIR
    assert sbx.files.make_dir(f"{d}/dlink") is False  # a link to a directory is one
    names = [e.name for e in sbx.files.list(d)]
    assert "broken" not in names and {"link", "dlink", "dir", "test.txt"} <= set(names)  # untyped: dropped


def test_exists(sbx: Sandbox) -> None:
    name = fresh("exists")
    assert not sbx.files.exists(name)
    sbx.files.write(name, "test")
    assert sbx.files.exists(name) and sbx.files.exists(f"~/{name}")


# -- make_dir, remove, rename ---------------------------------------------------------------------


def test_make_dir(sbx: Sandbox) -> None:
    d = fresh("test_directory")
    assert sbx.files.make_dir(d) is True
    assert sbx.files.make_dir(d) is False
    assert sbx.files.make_dir(f"{d}/nested/deeper") is True
    assert sbx.files.get_info(f"{d}/nested/deeper").type == FileType.DIR
    sbx.files.write(f"{d}/file", "x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.make_dir(f"{d}/file")
    with pytest.raises(InvalidArgumentException):
        sbx.files.make_dir(f"{d}/file/below")


def test_remove(sbx: Sandbox) -> None:
    name = fresh("remove")
    sbx.files.write(name, "This file will be removed.")
    sbx.files.remove(name)
    assert not sbx.files.exists(name)
    sbx.files.remove(fresh("never_there"))  # envd: nothing to remove is fine
    d = fresh("tree")
    sbx.files.write(f"{d}/a/b/c.txt", "deep")
    sbx.files.remove(d)
    assert not sbx.files.exists(d)


def test_rename(sbx: Sandbox) -> None:
    old, new = fresh("rename_old"), fresh("rename_new")
    sbx.files.write(old, "This file will be renamed.")
    info = sbx.files.rename(old, new)
    assert info.path == f"{HOME}/{new}" and info.type == FileType.FILE and info.size == 26
    assert not sbx.files.exists(old) and sbx.files.read(new) == "This file will be renamed."
    moved = sbx.files.rename(new, f"{fresh('newdir')}/inner/{new}")  # envd makes the parents
    assert sbx.files.read(moved.path) == "This file will be renamed."
    with pytest.raises(FileNotFoundException):
        sbx.files.rename(fresh("non_existing"), fresh("target"))


# -- auth, signed URLs, health --------------------------------------------------------------------


def test_signed_urls(sbx: Sandbox) -> None:
    name = fresh("signed") + ".txt"
    sbx.files.write(name, "This file will be watched.")
    # With E2B_SANDBOX_URL the SDK's URL names no sandbox: the link names it with sandbox_id (a
    # signature is checked against the one sandbox named, never searched for among all of them).
    sid = f"&sandbox_id={sbx.sandbox_id}"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(sbx.download_url(name))
    assert err.value.code == 401 and "names no sandbox" in json.loads(err.value.read().decode())["message"]
    for url in (sbx.download_url(name, "user"), sbx.download_url(name, "user", 120), sbx.download_url(name)):
        with urllib.request.urlopen(url + sid) as resp:  # no headers at all: the signature is the key
            assert resp.status == 200 and resp.read().decode() == "This file will be watched."
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(sbx.download_url(name, "user", use_signature_expiration=-120) + sid)
    assert err.value.code == 401
    assert json.loads(err.value.read().decode()) == {"code": 401, "message": "signature is already expired"}
    tampered = sbx.download_url(name, "user").replace("username=user", "username=root")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(tampered + sid)
    assert err.value.code == 401
    up = sbx.upload_url(f"up_{name}", "user")
    r = httpx.post(up + sid, files={"file": (f"up_{name}", b"uploaded through a signed URL")})
    assert r.status_code == 200 and r.json()[0]["path"] == f"{HOME}/up_{name}"
    assert sbx.files.read(f"up_{name}") == "uploaded through a signed URL"
    with pytest.raises(urllib.error.HTTPError) as err:  # a read signature does not write
        urllib.request.urlopen(urllib.request.Request(sbx.download_url(name) + sid, data=b"x", method="POST"))
    assert err.value.code == 401
    # The SDK's own header names the sandbox just as well.
    r = httpx.get(sbx.download_url(name), headers={"E2b-Sandbox-Id": sbx.sandbox_id})
    assert r.status_code == 200 and r.text == "This file will be watched."


def test_files_need_a_token_or_signature(sbx: Sandbox, server: Server) -> None:
    with envd(server, sbx, token=False) as c:
        r = c.get("/files", params={"path": "x"})
        assert r.status_code == 401 and r.json() == {"code": 401, "message": "missing signature query parameter"}
        r = c.get("/files", params={"path": "x"}, headers={"X-Access-Token": "ea_wrong"})
        assert r.status_code == 401
        r = c.post("/filesystem.Filesystem/Stat", json={"path": "/"},
                   headers={"Connect-Protocol-Version": "1"})
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"


def test_health(sbx: Sandbox, server: Server) -> None:
    assert sbx.is_running()
    with envd(server, sbx, token=False) as c:
        assert c.get("/health").status_code == 204  # no token needed
        r = c.get("/health", headers={"E2b-Sandbox-Id": "nosuchsandbox"})
        assert r.status_code == 502 and "was not found" in r.json()["message"]


# -- watchers -------------------------------------------------------------------------------------


def test_watch_dir_polled(sbx: Sandbox) -> None:
    d = fresh("test_watch_dir")
    sbx.files.make_dir(d)
    sbx.files.write(f"{d}/test_watch.txt", "This file will be watched.")
    handle = sbx.files.watch_dir(d)
    try:
        sbx.files.write(f"{d}/test_watch.txt", "This file has been modified.")
        seen: list[FilesystemEvent] = []

        def wrote() -> bool:
            seen.extend(handle.get_new_events())
            return any(e.type == FilesystemEventType.WRITE and e.name == "test_watch.txt" for e in seen)

        wait_for(wrote, 30, "a write event")
        # E2B writes in place: a watcher never sees a temporary name.
        assert {e.name for e in seen} == {"test_watch.txt"}
    finally:
        handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()


def test_watch_new_file_events_like_envd(sbx: Sandbox) -> None:
    d = fresh("test_watch_iterated")
    sbx.files.make_dir(d)
    handle = sbx.files.watch_dir(d)
    try:
        sbx.files.write(f"{d}/new.txt", "content")
        seen: list[FilesystemEvent] = []

        def written() -> bool:
            seen.extend(handle.get_new_events())
            return any(e.type == FilesystemEventType.WRITE for e in seen)

        wait_for(written, 30, "the new file's write event")
        assert [e.type for e in seen] == [FilesystemEventType.CREATE, FilesystemEventType.CHMOD,
                                          FilesystemEventType.WRITE]
        assert all(e.name == "new.txt" for e in seen)
    finally:
        handle.stop()


def test_watch_recursive_and_errors(sbx: Sandbox) -> None:
    d = fresh("test_recursive_watch_dir")
    sbx.files.make_dir(f"{d}/nested")
    handle = sbx.files.watch_dir(d, recursive=True)
    try:
        sbx.files.write(f"{d}/nested/test_watch.txt", "x")
        seen: list[FilesystemEvent] = []

        def created() -> bool:
            seen.extend(handle.get_new_events())
            return any(e.type == FilesystemEventType.CREATE for e in seen)

        wait_for(created, 30, "a create event in the nested directory")
        assert seen[0].type == FilesystemEventType.CREATE and seen[0].name == "nested/test_watch.txt"
    finally:
        handle.stop()
    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir(fresh("missing_dir"))


def test_watch_with_entries_and_network_mounts_through_the_sdk(sbx: Sandbox) -> None:
    """envd 0.6.3 and 0.6.4 as E2B's own tests use them: ``include_entry`` gives each event the entry
    of the path that changed, and ``allow_network_mounts`` watches a directory as without it."""
    d = fresh("watch_sdk_entry")
    sbx.files.make_dir(d)
    sbx.files.write(f"{d}/w.txt", "first")
    for kwargs in ({"include_entry": True}, {"allow_network_mounts": True}):
        handle = sbx.files.watch_dir(d, **kwargs)
        try:
            sbx.files.write(f"{d}/w.txt", f"changed {kwargs}")
            seen: list[FilesystemEvent] = []

            def wrote(seen: list[FilesystemEvent] = seen, handle: Any = handle) -> bool:
                seen.extend(handle.get_new_events())
                return any(e.type == FilesystemEventType.WRITE and e.name == "w.txt" for e in seen)

            wait_for(wrote, 30, f"a write event with {kwargs}")
            write = next(e for e in seen if e.type == FilesystemEventType.WRITE)
            if kwargs.get("include_entry"):
                assert write.entry is not None and write.entry.path == f"{HOME}/{d}/w.txt"
                assert write.entry.name == "w.txt" and write.entry.type == FileType.FILE
        finally:
            handle.stop()


def test_file_metadata_is_refused_by_name(sbx: Sandbox) -> None:
    """envd 0.6.2's file metadata has nowhere to live here (the sandbox filesystem refuses extended
    attributes): a write that carries it is refused with that reason, and writes nothing."""
    name = fresh("with_metadata.txt")
    with pytest.raises(InvalidArgumentException, match=r"file metadata .* is not supported by SPACE"):
        sbx.files.write(name, "x", metadata={"author": "mish"})
    assert not sbx.files.exists(name)
    assert sbx.files.write(name, "x").name == name.rpartition("/")[2]  # without metadata: written


def test_watch_include_entry_on_the_wire(sbx: Sandbox, server: Server) -> None:
    """What envd >= 0.6.3 adds (the SDK asks for it only from that version): each event's entry."""
    d = fresh("watch_entry")
    sbx.files.make_dir(d)
    rpc = {"Connect-Protocol-Version": "1"}
    with envd(server, sbx) as c:
        r = c.post("/filesystem.Filesystem/CreateWatcher", json={"path": d, "includeEntry": True}, headers=rpc)
        assert r.status_code == 200, r.text
        wid = r.json()["watcherId"]
        sbx.files.write(f"{d}/e.txt", "entry")
        events: list[dict[str, object]] = []

        def wrote() -> bool:
            r = c.post("/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": wid}, headers=rpc)
            assert r.status_code == 200, r.text
            events.extend(r.json().get("events", []))
            return any(e["type"] == "EVENT_TYPE_WRITE" for e in events)

        wait_for(wrote, 30, "a write event")
        write = next(e for e in events if e["type"] == "EVENT_TYPE_WRITE")
        assert write["name"] == "e.txt"
        assert isinstance(write["entry"], dict)
        assert write["entry"]["path"] == f"{HOME}/{d}/e.txt" and write["entry"]["type"] == "FILE_TYPE_FILE"
        r = c.post("/filesystem.Filesystem/RemoveWatcher", json={"watcherId": wid}, headers=rpc)
        assert r.status_code == 200
        r = c.post("/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": wid}, headers=rpc)
        assert r.status_code == 404 and r.json()["code"] == "not_found"


# -- the async SDK ----------------------------------------------------------------------------------


async def test_async_files(sbx: Sandbox) -> None:
    s = await AsyncSandbox.connect(sbx.sandbox_id)
    d = fresh("async")
    assert await s.files.make_dir(d) is True
    info = await s.files.write(f"{d}/a.txt", "async content")
    assert info.path == f"{HOME}/{d}/a.txt"
    assert await s.files.read(f"{d}/a.txt") == "async content"
    assert await s.files.read(f"{d}/a.txt", gzip=True) == "async content"
    await s.files.write(f"{d}/gz.txt", io.BytesIO(b"gz" * 50_000), gzip=True)
    assert await s.files.read(f"{d}/gz.txt", format="bytes") == bytearray(b"gz" * 50_000)
    entries = await s.files.list(d)
    assert [(e.name, e.type, e.owner) for e in entries] == [("a.txt", FileType.FILE, "user"),
                                                            ("gz.txt", FileType.FILE, "user")]
    assert (await s.files.get_info(f"{d}/a.txt")).size == 13
    assert await s.files.exists(f"{d}/a.txt") and not await s.files.exists(f"{d}/b.txt")
    moved = await s.files.rename(f"{d}/a.txt", f"{d}/b.txt")
    assert moved.path == f"{HOME}/{d}/b.txt"
    await s.files.remove(f"{d}/b.txt")
    with pytest.raises(FileNotFoundException):
        await s.files.read(f"{d}/b.txt")
    assert await s.is_running()


async def test_async_watch_stream(sbx: Sandbox) -> None:
    s = await AsyncSandbox.connect(sbx.sandbox_id)
    d = fresh("async_watch")
    await s.files.make_dir(d)
    await s.files.write(f"{d}/w.txt", "before")
    received: list[FilesystemEvent] = []
    exits: list[Exception | None] = []
    handle = await s.files.watch_dir(d, on_event=received.append, on_exit=exits.append)
    try:
        await s.files.write(f"{d}/w.txt", "after")

        async def wrote() -> bool:
            return any(e.type == FilesystemEventType.WRITE and e.name == "w.txt" for e in received)

        await await_for(wrote, 30, "a write event on the stream")
    finally:
        await handle.stop()  # type: ignore[no-untyped-call]
    with pytest.raises(FileNotFoundException):
        await s.files.watch_dir(fresh("missing"), on_event=received.append)



async def test_killed_sandbox_cuts_the_watch_and_files(made: e2b_env.Sandboxes) -> None:
    s = await AsyncSandbox.create(metadata={"test": "files-killed"})
    made.add(s.sandbox_id)
    await s.files.write("k.txt", "x")
    exits: list[Exception | None] = []
    await s.files.watch_dir(".", on_event=lambda e: None, on_exit=exits.append)
    await s.kill()

    async def cut() -> bool:
        return bool(exits)

    await await_for(cut, 30, "the watch stream to end")
    assert exits[0] is not None  # cut with an error, not ended cleanly
    assert not await s.is_running()
    with pytest.raises(SandboxNotRunningException):
        await s.files.read("k.txt")
    with pytest.raises(SandboxNotRunningException):
        await s.files.list(".")
