"""Small pieces without a running guest: path rules, protocol helpers, the daemon's resync."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from space import errors
from space.guest import daemon, protocol
from space.node.sandboxes.guest_client import GuestConnection
from tests.guest.guest_harness import DAEMON, HostGuest


@pytest.mark.parametrize(("raw", "norm"), [
    ("/", "/"), ("/a/b/../c", "/a/c"), ("//a/./b/", "/a/b"), ("/a/..", "/"), ("/a/../b/..", "/"),
])
def test_norm_path(raw: str, norm: str) -> None:
    assert daemon.norm_path(raw) == norm


@pytest.mark.parametrize("raw", ["/..", "/a/../..", "a/b", "", "/a\x00", None, 3])
def test_norm_path_refuses(raw: object) -> None:
    with pytest.raises(daemon.GuestError) as exc:
        daemon.norm_path(raw)
    assert exc.value.code == "invalid_path"


def test_batch_items_fit_in_headers() -> None:
    items = [{"name": "x" * 200, "i": i} for i in range(2000)]
    batches = protocol.batch_items(items)
    assert len(batches) > 1 and [x for b in batches for x in b] == items
    for b in batches:
        protocol.encode({"t": "chunk", "id": 1, "part": "entries", "entries": b})
    assert protocol.batch_items([]) == [[]]


def test_resync_finds_the_next_frame() -> None:
    good = protocol.encode({"t": "res", "id": 1})
    buf = b"\xff\xff\xff\xffjunk{not-a-frame" + good
    i = protocol.resync(buf)
    assert buf[i:] == good


def test_daemon_survives_garbage_on_its_stdin() -> None:
    proc = subprocess.Popen([sys.executable, "-I", "-S", str(DAEMON)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        ready = protocol.read_frame(proc.stdout.read)
        assert ready is not None and ready[0]["kind"] == "ready" and ready[0]["pid"] == proc.pid
        proc.stdin.write(b"\x00\x00\x00\x05garbage" + protocol.encode({"t": "req", "id": 9, "op": "hello"}))
        proc.stdin.write(protocol.encode({"t": "req", "id": 10, "op": "activity"})[:-1] + b"!")
        proc.stdin.write(protocol.encode({"t": "req", "id": 11, "op": "activity"}))
        proc.stdin.flush()
        got = [protocol.read_frame(proc.stdout.read) for _ in range(2)]
        assert [f[0]["id"] for f in got if f] == [9, 11]
    finally:
        proc.stdin.close()
        proc.wait(10)


async def test_connect_gives_up_with_unavailable(tmp_path: object) -> None:
    with pytest.raises(errors.Unavailable):
        await GuestConnection.connect(os.path.join(str(tmp_path), "nobody.sock"), timeout=0.3)


async def test_pending_request_fails_when_the_channel_drops(guest: HostGuest) -> None:
    conn = await GuestConnection.connect(guest.socket)
    pid = 0
    try:
        pid = (await conn.request("exec", cmd="s", argv=["sleep", "60"]))["pid"]
        events = conn.events("s")
        assert guest.daemon is not None
        guest.daemon.kill()
        with pytest.raises(errors.Unavailable):
            async for _ in events:
                pass
        assert conn.closed
        with pytest.raises(errors.Unavailable):
            await conn.request("hello")
    finally:
        await conn.close()
        if pid:  # the killed daemon could not take its command down with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


async def test_shim_skips_client_garbage(guest: HostGuest) -> None:
    import asyncio

    await (await GuestConnection.connect(guest.socket)).close()
    reader, writer = await asyncio.open_unix_connection(guest.socket)
    writer.write(b"\xff\xff\xff\xffnoise" + protocol.encode({"t": "req", "id": 5, "op": "activity"}))
    await writer.drain()
    async with asyncio.timeout(10):
        prefix = await reader.readexactly(8)
        rest, hlen = protocol.decode_lengths(prefix)
        header, _ = protocol.decode_body(await reader.readexactly(rest), hlen)
    assert header["id"] == 5 and header["ok"] is True
    writer.close()
    await writer.wait_closed()
