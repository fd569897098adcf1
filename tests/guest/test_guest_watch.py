"""Directory watchers of the guest daemon (``watch.*``). The daemon runs on the host here, so tmp_path
is its file system and the test makes the changes itself."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from space import errors
from space.node.sandboxes.guest_client import GuestConnection
from tests.guest.guest_harness import HostGuest, connected
from tests.waiting import await_for, wait_for

Event = tuple[str, str]  # (type, name)


async def poll_until(conn: GuestConnection, wid: str, done: Callable[[list[dict[str, Any]]], bool],
                     what: str, timeout: float = 10) -> list[dict[str, Any]]:
    """Poll ``wid`` (draining it) until the events so far satisfy ``done``."""
    got: list[dict[str, Any]] = []

    async def step() -> bool:
        got.extend((await conn.request("watch.poll", watcher=wid))["events"])
        return done(got)

    await await_for(step, timeout, what)
    return got


def pairs(events: list[dict[str, Any]]) -> list[Event]:
    """(type, name) in order, a run of writes to one file counted once (one write() may be several)."""
    out: list[Event] = []
    for e in events:
        p = (e["type"], e["name"])
        if not (out and p == out[-1] and p[0] == "write"):
            out.append(p)
    return out


def has(name: str, kind: str = "create") -> Callable[[list[dict[str, Any]]], bool]:
    return lambda evs: any(e["name"] == name and e["type"] == kind for e in evs)


def touch(path: Path) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))  # a create and nothing else


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    watched, outside = tmp_path / "w", tmp_path / "out"
    watched.mkdir()
    outside.mkdir()
    return watched, outside


async def test_events_of_one_directory(conn: GuestConnection, roots: tuple[Path, Path]) -> None:
    d, outside = roots
    (outside / "c.txt").write_text("c")
    wid = (await conn.request("watch.add", path=str(d)))["watcher"]
    assert wid
    (d / "a.txt").write_text("alpha")
    os.chmod(d / "a.txt", 0o600)
    os.rename(d / "a.txt", d / "b.txt")
    os.rename(d / "b.txt", outside / "b.txt")  # moved out: a rename (E2B's semantics)
    os.rename(outside / "c.txt", d / "c.txt")  # moved in: a create
    os.unlink(d / "c.txt")
    os.mkdir(d / "sub")
    (d / "sub" / "deep.txt").write_text("not watched")  # not recursive: unseen
    touch(d / "end")
    events = await poll_until(conn, wid, has("end"), "the end marker")
    assert pairs(events) == [
        ("create", "a.txt"), ("write", "a.txt"), ("chmod", "a.txt"), ("rename", "a.txt"),
        ("create", "b.txt"), ("rename", "b.txt"), ("create", "c.txt"), ("remove", "c.txt"),
        ("create", "sub"), ("create", "end"),
    ]
    assert all(isinstance(e["ts"], float) for e in events)
    # Drained: the next poll has nothing, and says nothing was lost.
    res = await conn.request("watch.poll", watcher=wid)
    assert res["events"] == [] and res["overflowed"] is False
    # The watched directory itself is ".".
    os.chmod(d, 0o750)
    await poll_until(conn, wid, has(".", "chmod"), "a chmod of the directory itself")
    await conn.request("watch.remove", watcher=wid)


async def test_recursive_watcher_follows_the_tree(conn: GuestConnection, roots: tuple[Path, Path]) -> None:
    d, outside = roots
    (d / "a" / "b").mkdir(parents=True)
    wid = (await conn.request("watch.add", path=str(d), recursive=True))["watcher"]
    (d / "a" / "b" / "f").write_text("1")  # an existing subdirectory is watched from the start
    await poll_until(conn, wid, has("a/b/f", "write"), "a write two levels down")

    # A tree made at once (mkdir -p): what was inside before its watch existed is reported as created.
    (d / "new" / "x" / "y").mkdir(parents=True)
    (d / "new" / "x" / "y" / "z").write_text("z")
    events = await poll_until(conn, wid, lambda evs: {"new", "new/x", "new/x/y", "new/x/y/z"}
                              <= {e["name"] for e in evs if e["type"] == "create"}, "the new tree")
    (d / "new" / "x" / "y" / "z").write_text("again")
    await poll_until(conn, wid, has("new/x/y/z", "write"), "a write in the new tree")

    # A directory renamed inside the tree is watched under its new name, with its contents.
    os.rename(d / "a", d / "moved")
    events = await poll_until(conn, wid, has("moved/b/f"), "the moved tree's contents")
    assert ("rename", "a") in pairs(events) and ("create", "moved") in pairs(events)
    (d / "moved" / "b" / "f").write_text("2")
    events = await poll_until(conn, wid, has("moved/b/f", "write"), "a write under the new name")
    assert not any(e["name"].startswith("a/") for e in events)

    # One moved out of the tree is not watched any more.
    os.rename(d / "moved", outside / "gone")
    (outside / "gone" / "b" / "f").write_text("3")
    touch(d / "end")
    events = await poll_until(conn, wid, has("end"), "the end marker")
    assert pairs(events) == [("rename", "moved"), ("create", "end")]

    # A removed tree: every file and directory in it, the deepest first.
    import shutil

    shutil.rmtree(d / "new")
    events = await poll_until(conn, wid, has("new", "remove"), "the removal of the tree")
    assert [n for t, n in pairs(events) if t == "remove"] == ["new/x/y/z", "new/x/y", "new/x", "new"]
    listed = (await conn.request("watch.list"))["watchers"]
    assert [(w["id"], w["dirs"]) for w in listed] == [(wid, 1)]  # only the root is left to watch


async def test_entries_and_big_polls(conn: GuestConnection, roots: tuple[Path, Path]) -> None:
    d, _ = roots
    wid = (await conn.request("watch.add", path=str(d), entry=True))["watcher"]
    (d / "f").write_bytes(b"12345")
    events = await poll_until(conn, wid, has("f", "write"), "the write")
    entry = events[-1]["entry"]
    assert entry["type"] == "file" and entry["size"] == 5 and entry["path"] == str(d / "f")
    os.unlink(d / "f")
    events = await poll_until(conn, wid, has("f", "remove"), "the removal")
    assert events[-1]["entry"] is None  # gone by the time it was looked at

    # More events than one answer frame holds come back whole, in order.
    n = 3000
    for i in range(n):
        touch(d / f"file-{i:05d}-{'x' * 40}")

    async def buffered() -> bool:
        return bool((await conn.request("watch.list"))["watchers"][0]["buffered"] == n)

    await await_for(buffered, 30, f"{n} buffered events")
    res = await conn.request("watch.poll", watcher=wid, max=10)
    assert len(res["events"]) == 10 and res["pending"] == n - 10
    res = await conn.request("watch.poll", watcher=wid)
    assert [e["name"][:10] for e in res["events"]] == [f"file-{i:05d}" for i in range(10, n)]
    assert res["pending"] == 0 and res["overflowed"] is False


async def test_errors_and_the_watcher_limit(conn: GuestConnection, roots: tuple[Path, Path]) -> None:
    d, _ = roots
    (d / "file").write_text("x")
    with pytest.raises(errors.NotFound):
        await conn.request("watch.add", path=str(d / "missing"))
    with pytest.raises(errors.InvalidRequest):
        await conn.request("watch.add", path=str(d / "file"))
    with pytest.raises(errors.InvalidPath):
        await conn.request("watch.add", path="relative")
    for op in ("watch.poll", "watch.remove"):
        with pytest.raises(errors.NotFound):
            await conn.request(op, watcher="w-unknown")
    ids = [(await conn.request("watch.add", path=str(d)))["watcher"] for _ in range(64)]
    assert len(set(ids)) == 64
    with pytest.raises(errors.QuotaExceeded):
        await conn.request("watch.add", path=str(d))
    await conn.request("watch.remove", watcher=ids[0])
    with pytest.raises(errors.NotFound):
        await conn.request("watch.poll", watcher=ids[0])
    ids[0] = (await conn.request("watch.add", path=str(d)))["watcher"]  # room again
    for wid in ids:
        await conn.request("watch.remove", watcher=wid)
    assert (await conn.request("watch.list"))["watchers"] == []


def _inotify_fds(pid: int) -> int:
    fds = Path(f"/proc/{pid}/fd")
    n = 0
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            n += os.readlink(fd) == "anon_inode:inotify"
    return n


@pytest.fixture
async def small_guest() -> AsyncIterator[tuple[HostGuest, GuestConnection]]:
    """A daemon whose watchers keep 50 events and are dropped after 0.5 s without a poll."""
    g = HostGuest(env={"SPACE_GUEST_WATCH_MAX_EVENTS": "50", "SPACE_GUEST_WATCH_IDLE": "0.5"}).start()
    try:
        async with connected(g.socket, timeout=15) as c:
            yield g, c
    finally:
        g.stop()


async def test_overflow_and_idle_watchers(small_guest: tuple[HostGuest, GuestConnection],
                                          roots: tuple[Path, Path]) -> None:
    g, conn = small_guest
    assert g.daemon is not None
    d, _ = roots
    wid = (await conn.request("watch.add", path=str(d)))["watcher"]
    for i in range(200):
        touch(d / f"f{i:03d}")
    touch(d / "end")

    async def overflowed() -> bool:
        return bool((await conn.request("watch.list"))["watchers"][0]["overflowed"])

    await await_for(overflowed, 10, "the buffer to overflow")  # watch.list does not drain
    got: list[dict[str, Any]] = []
    lost = False

    async def step() -> bool:
        nonlocal lost
        res = await conn.request("watch.poll", watcher=wid)
        got.extend(res["events"])
        lost = lost or res["overflowed"]
        return has("end")(got)

    await await_for(step, 10, "the end marker")
    # The oldest went; what is left is the newest, in order.
    assert lost and len(got) < 201
    names = [e["name"] for e in got]
    assert names[-1] == "end" and names[:-1] == sorted(names[:-1]) and len(names) >= 50

    # Nobody polls it: dropped, its inotify fd closed.
    async def dropped() -> bool:
        return not (await conn.request("watch.list"))["watchers"]

    await await_for(dropped, 10, "the idle watcher to be dropped")
    with pytest.raises(errors.NotFound):
        await conn.request("watch.poll", watcher=wid)
    pid = g.daemon.pid
    wait_for(lambda: _inotify_fds(pid) == 0, 10, "the daemon to close its inotify fd")
