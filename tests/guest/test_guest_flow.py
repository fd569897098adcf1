"""Replay, gaps, reconnects and flow control between the guest and the node-side client."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from space import errors
from space.node.sandboxes import guest_client
from space.node.sandboxes.guest_client import GuestConnection
from tests.guest.guest_harness import HostGuest
from tests.guest.test_guest_exec import cid, collect
from tests.waiting import await_for

MiB = 1 << 20
WINDOW = 4 * MiB


async def command(conn: GuestConnection, c: str) -> dict[str, Any]:
    found = [x for x in (await conn.request("list"))["commands"] if x["id"] == c]
    assert found, f"{c} not listed"
    info: dict[str, Any] = found[0]
    return info


async def wait_for(conn: GuestConnection, c: str, pred: Any, within: float = 20.0) -> dict[str, Any]:
    """The command's listing once ``pred`` holds for it."""

    async def check() -> dict[str, Any] | None:
        info = await command(conn, c)
        return info if pred(info) else None

    return await await_for(check, within, f"command {c} to match")


def check_stream(evs: list[dict[str, Any]]) -> None:
    seqs = [e["seq"] for e in evs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "events must be contiguous"
    assert evs[-1]["kind"] == "exit" and all(e["kind"] != "exit" for e in evs[:-1])


async def test_replay_after_reconnect(guest: HostGuest) -> None:
    conn = await GuestConnection.connect(guest.socket)
    c = cid()
    await conn.request("exec", cmd=c, shell="for i in $(seq 1 200); do echo line$i; done; echo bye >&2")
    await conn.close()
    conn = await GuestConnection.connect(guest.socket)
    try:
        evs, out, err = await collect(conn, c)
    finally:
        await conn.close()
    assert evs[0]["seq"] == 1
    check_stream(evs)
    assert out == b"".join(b"line%d\n" % i for i in range(1, 201)) and err == b"bye\n"


async def test_events_after_skips_seen_events(conn: GuestConnection) -> None:
    c = cid()
    await conn.request("exec", cmd=c, shell="echo a; sleep 0.05; echo b; sleep 0.05; echo c")
    evs, out, _ = await collect(conn, c)
    later, out2, _ = await collect(conn, c, after=evs[0]["seq"])
    assert later == evs[1:] and out.endswith(out2) and len(out2) < len(out)


async def test_gap_with_tiny_buffer(conn: GuestConnection, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest_client, "ATTACH_GRACE", 0.0)  # nobody will subscribe in time
    c = cid()
    total = 300_000
    await conn.request("exec", cmd=c, argv=["head", "-c", str(total), "/dev/zero"], buffer_bytes=1024)
    await wait_for(conn, c, lambda i: i["state"] == "exited")
    evs, out, _ = await collect(conn, c)
    gap = evs[0]
    assert gap["kind"] == "gap" and gap["seq"] >= 1
    assert gap["lost_bytes"] + len(out) == total
    check_stream(evs[1:])
    assert evs[1]["seq"] == gap["seq"] + 1


async def test_unattended_command_does_not_block(conn: GuestConnection) -> None:
    # Nobody subscribes: the client acks on arrival, so the guest never waits for a consumer.
    c = cid()
    total = 24 * MiB
    await conn.request("exec", cmd=c, argv=["head", "-c", str(total), "/dev/zero"])
    info = await wait_for(conn, c, lambda i: i["state"] == "exited", within=20)
    assert info["exit_code"] == 0 and info["out_bytes"] == total
    evs, out, _ = await collect(conn, c)
    assert evs[0]["kind"] == "gap" and evs[0]["lost_bytes"] + len(out) == total


async def test_paused_consumer_loses_nothing(conn: GuestConnection) -> None:
    c = cid()
    total = 24 * MiB
    # A 1 MiB replay buffer: without backpressure most of the output would be evicted.
    await conn.request("exec", cmd=c, argv=["head", "-c", str(total), "/dev/zero"], buffer_bytes=MiB)
    got = 0
    evs: list[dict[str, Any]] = []
    async with contextlib.aclosing(conn.events(c)) as events:
        it = aiter(events)
        ev, payload = await anext(it)
        evs.append(ev)
        got += len(payload)
        # The consumer stops reading: the guest must stop at its window, the process must block.
        info = await wait_for(conn, c, lambda i: i["unacked"] >= WINDOW)
        assert info["state"] == "running" and info["out_bytes"] < total
        async with asyncio.timeout(60):
            async for ev, payload in it:
                evs.append(ev)
                got += len(payload)
    assert got == total
    assert all(e["kind"] != "gap" for e in evs)
    check_stream(evs)


async def test_late_subscriber_within_attach_grace_loses_nothing(
        conn: GuestConnection, monkeypatch: pytest.MonkeyPatch) -> None:
    """Output before the first subscriber (API clients subscribe in a second request) is held for
    it: the guest stalls at its window instead of the client acking the output away."""
    monkeypatch.setattr(guest_client, "ATTACH_GRACE", 60.0)
    c = cid()
    total = 24 * MiB
    await conn.request("exec", cmd=c, argv=["head", "-c", str(total), "/dev/zero"], buffer_bytes=MiB)
    info = await wait_for(conn, c, lambda i: i["unacked"] >= WINDOW)
    assert info["state"] == "running" and info["out_bytes"] < total
    evs, out, _ = await collect(conn, c)
    assert all(e["kind"] != "gap" for e in evs) and len(out) == total
    check_stream(evs)


async def test_unattended_command_runs_on_after_attach_grace(
        conn: GuestConnection, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest_client, "ATTACH_GRACE", 0.2)
    c = cid()
    await conn.request("exec", cmd=c, argv=["head", "-c", str(3 * WINDOW), "/dev/zero"])
    info = await wait_for(conn, c, lambda i: i["state"] == "exited", within=20)
    assert info["exit_code"] == 0 and info["out_bytes"] == 3 * WINDOW


async def test_failed_exec_leaves_no_hold(conn: GuestConnection) -> None:
    c = cid()
    with pytest.raises(errors.SpaceError):
        await conn.request("exec", cmd=c, argv=["/no/such/binary"])
    assert c not in conn._cmds


async def test_two_subscribers_see_the_same_stream(conn: GuestConnection) -> None:
    c = cid()
    await conn.request("exec", cmd=c, argv=["head", "-c", str(6 * MiB), "/dev/urandom"], buffer_bytes=MiB)
    a, b = await asyncio.gather(collect(conn, c), collect(conn, c))
    assert a[1] == b[1] and len(a[1]) == 6 * MiB


async def test_stream_survives_client_restart(guest: HostGuest) -> None:
    """The node agent restarts mid-stream: a new connection picks up after the last seen seq."""
    conn = await GuestConnection.connect(guest.socket)
    c = cid()
    total = 12 * MiB
    await conn.request("exec", cmd=c, argv=["head", "-c", str(total), "/dev/zero"], buffer_bytes=64 * MiB)
    got, last = 0, 0
    async with contextlib.aclosing(conn.events(c)) as events:
        async for ev, payload in events:
            got += len(payload)
            last = ev["seq"]
            if got >= 2 * MiB:
                break
    await conn.close()
    conn = await GuestConnection.connect(guest.socket)
    try:
        evs, out, _ = await collect(conn, c, after=last)
    finally:
        await conn.close()
    assert evs[0]["seq"] == last + 1
    check_stream(evs)
    assert got + len(out) == total


async def test_exited_buffers_share_a_budget(conn: GuestConnection) -> None:
    # Two exited commands hold 2 x 40 MiB > 64 MiB: the older one is trimmed to its exit event.
    first, second = cid(), cid()
    for c in (first, second):
        await conn.request("exec", cmd=c, argv=["head", "-c", str(40 * MiB), "/dev/zero"],
                           buffer_bytes=64 * MiB)
        await wait_for(conn, c, lambda i: i["state"] == "exited")
    evs, out, _ = await collect(conn, first)
    assert [e["kind"] for e in evs] == ["gap", "exit"] and evs[0]["lost_bytes"] == 40 * MiB
    evs, out, _ = await collect(conn, second)
    assert evs[0]["kind"] == "out" and len(out) == 40 * MiB
