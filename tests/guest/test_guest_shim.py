"""The shim: one client at a time, whole frames only, clean exit; and the guest's stall timeout."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from typing import Any

import pytest

from space.guest import protocol
from space.node.sandboxes.guest_client import GuestConnection
from tests.guest.guest_harness import HostGuest
from tests.guest.test_guest_exec import cid, collect
from tests.guest.test_guest_flow import check_stream, wait_for
from tests.waiting import await_for

MiB = 1 << 20


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def cleaned_up(guest: HostGuest) -> bool:
    return not os.path.exists(guest.socket) and not os.path.exists(guest.chan.pidfile)


async def wait_exit(proc: subprocess.Popen[bytes], within: float = 10.0) -> int:
    async def exited() -> bool:
        return proc.poll() is not None

    await await_for(exited, within, f"process {proc.pid} to exit")
    assert proc.returncode is not None
    return proc.returncode


async def test_new_connection_replaces_old_mid_stream(guest: HostGuest) -> None:
    first = await GuestConnection.connect(guest.socket)
    c = cid()
    await first.request("exec", cmd=c, argv=["head", "-c", str(40 * MiB), "/dev/zero"])
    got = 0
    async with contextlib.aclosing(first.events(c)) as events:
        async for _, payload in events:
            got += len(payload)
            if got > 3 * MiB:
                break
    second = await GuestConnection.connect(guest.socket)
    try:
        async with asyncio.timeout(10):
            await first.wait_closed()
        # Every frame the new client gets is whole: the stream decodes to its end.
        evs, _, _ = await collect(second, c)
        check_stream([e for e in evs if e["kind"] != "gap"])
        assert evs[-1]["exit_code"] == 0
    finally:
        await first.close()
        await second.close()


async def test_partial_frame_of_a_dropped_client_is_discarded(guest: HostGuest) -> None:
    await (await GuestConnection.connect(guest.socket)).close()  # the shim is listening
    frame = protocol.encode({"t": "req", "id": 1, "op": "exec", "cmd": "never", "argv": ["true"]})
    _, writer = await asyncio.open_unix_connection(guest.socket)
    writer.write(frame[: len(frame) // 2])
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    conn = await GuestConnection.connect(guest.socket)
    try:
        assert conn.hello["version"] == 1
        assert [x["id"] for x in (await conn.request("list"))["commands"]] == []
    finally:
        await conn.close()


async def test_socket_is_private(guest: HostGuest) -> None:
    conn = await GuestConnection.connect(guest.socket)
    await conn.close()
    assert os.stat(guest.socket).st_mode & 0o777 == 0o600
    assert guest.chan.pidfile.read_text().strip() == str(guest.chan.shim.pid if guest.chan.shim else "")


async def test_shim_exits_when_the_guest_ends(guest: HostGuest) -> None:
    conn = await GuestConnection.connect(guest.socket)
    assert guest.daemon is not None and guest.chan.shim is not None
    guest.daemon.kill()
    assert await wait_exit(guest.chan.shim) == 0
    async with asyncio.timeout(10):
        await conn.wait_closed()
    assert cleaned_up(guest)


async def test_sigterm_stops_shim_and_host_daemon(guest: HostGuest) -> None:
    conn = await GuestConnection.connect(guest.socket)
    c = cid()
    pid = (await conn.request("exec", cmd=c, argv=["sleep", "60"]))["pid"]
    assert guest.chan.shim is not None and guest.daemon is not None
    guest.chan.shim.send_signal(signal.SIGTERM)
    assert await wait_exit(guest.chan.shim) == 0
    assert cleaned_up(guest)
    # Off PID 1, the daemon takes the end of its channel as the end: it kills its commands and exits.
    await wait_exit(guest.daemon)
    async def reaped() -> bool:
        return gone(pid)

    await await_for(reaped, 10, f"command process {pid} to be gone")
    await conn.close()


@pytest.fixture
def impatient_guest() -> Any:
    g = HostGuest(env={"SPACE_GUEST_STALL_TIMEOUT": "0.5"}).start()
    try:
        yield g
    finally:
        g.stop()


async def test_stalled_consumer_does_not_block_forever(impatient_guest: HostGuest) -> None:
    conn = await GuestConnection.connect(impatient_guest.socket)
    try:
        c = cid()
        total = 12 * MiB
        await conn.request("exec", cmd=c, argv=["head", "-c", str(total), "/dev/zero"], buffer_bytes=MiB)
        async with contextlib.aclosing(conn.events(c)) as events:
            it = aiter(events)
            await anext(it)
            # Subscribed but not reading: after the stall timeout the guest runs the command on.
            info = await wait_for(conn, c, lambda i: i["state"] == "exited")
            assert info["exit_code"] == 0 and info["out_bytes"] == total
            async with asyncio.timeout(30):
                kinds = [ev["kind"] async for ev, _ in it]
        assert kinds[-1] == "exit"
    finally:
        await conn.close()
