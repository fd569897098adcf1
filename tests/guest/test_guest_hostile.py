"""A hostile guest at the guest-client seam (a socketpair, no sandbox): everything the node agent's
GuestConnection keeps because of what a guest sends is bounded, and nothing a guest sends takes the
connection down. Whoever is root inside a sandbox can write any bytes into the channel
(``/proc/1/fd/1``), so the guest is not trusted: these tests play it.

Memory is measured with tracemalloc (what the process holds beyond its baseline); the limits the
client enforces are module constants, some made smaller here so that exceeding them stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import pytest

from space import errors
from space.guest import protocol
from space.node.sandboxes import guest_client, startup
from space.web import FRAME_WIRE, SSE_WIRE, guest_event
from tests.guest.hostile import CommandLog, Header, MiB, Retained, in_thread, out_events, seam, settle

#: Slack for what the measurement itself and the event loop hold (buffers in flight, small objects).
SLACK = 2 * MiB
#: A frame the agent may hold while reading it, plus the stream reader's own buffer (2 x its limit).
READER = protocol.MAX_FRAME + 8 * MiB


def budget(conn: guest_client.GuestConnection) -> int:
    """What the connection says its buffers hold (0 on code that does not account)."""
    return int(getattr(conn, "buffered", 0))


async def test_events_and_answers_for_ids_nobody_allocated_are_dropped() -> None:
    """Events for commands this agent never started and answers for requests it never made: the
    agent tracked a command per id the guest named (a dict entry per forged id, forever)."""
    async with seam() as (conn, fake):
        with Retained() as mem:
            def forge() -> None:
                fake.flood(({"t": "ev", "kind": "out", "cmd": f"forged-{i}", "seq": 1, "fd": 1, "off": 0}, b"x")
                            for i in range(50_000))
                fake.flood(({"t": "res", "id": 10**9 + i, "ok": True, "junk": "y" * 100}, b"")
                            for i in range(20_000))
                fake.flood(({"t": "chunk", "id": 10**9 + i, "part": "entries", "entries": [{}] * 50}, b"")
                            for i in range(20_000))
            await in_thread(forge)
            await settle(conn, fake)
            kept = mem.now()
        assert kept < SLACK, f"{kept / MiB:.1f} MiB kept for forged ids"
        assert budget(conn) == 0


async def test_an_answer_larger_than_its_limit_fails_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest that answers one ``fs.list`` with endless part chunks: the request fails with
    too_large instead of the agent collecting every entry the guest cares to send."""
    monkeypatch.setattr(guest_client, "ANSWER_LIMIT", 4 * MiB, raising=False)
    async with seam() as (conn, fake):
        with Retained() as mem:
            call = asyncio.create_task(conn.request("fs.list", path="/", timeout=120))
            req = await in_thread(fake.request, "fs.list")
            entry = {"name": "x" * 60_000}
            await in_thread(fake.flood, (({"t": "chunk", "id": req["id"], "part": "entries",
                                           "entries": [entry]}, b"") for _ in range(700)))
            peak = mem.peak()
            fake.reply(req, entries=[])
            with pytest.raises(errors.PayloadTooLarge):
                await call
            kept = mem.now()
        assert peak < 4 * MiB + READER + SLACK, f"peak {peak / MiB:.1f} MiB for one 40 MiB answer"
        assert kept < SLACK and budget(conn) == 0
        assert (await conn.request("hello"))["version"] == 1


async def test_a_file_read_flood_is_windowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest that answers a file read with far more than the window asked, while the consumer
    (an HTTP client) is slow: the agent keeps at most its stream limit, and the consumer still gets
    the file whole and exact, asked again from where it got to."""
    monkeypatch.setattr(guest_client, "READ_WINDOW", 1 * MiB)
    monkeypatch.setattr(guest_client, "STREAM_LIMIT", 2 * MiB, raising=False)
    size = 32 * MiB
    content = (bytes(range(251)) * (size // 251 + 1))[:size]
    flooded = threading.Event()

    def serve_read(h: Header) -> None:
        off = int(h.get("offset") or 0)
        n = size - off if not flooded.is_set() else min(int(h["length"]), size - off)
        step = protocol.MAX_PAYLOAD
        fake.flood(({"t": "chunk", "id": h["id"]}, content[i : i + step]) for i in range(off, off + n, step))
        fake.reply(h, read=n)
        flooded.set()

    async with seam() as (conn, fake):
        fake.handlers["fs.read"] = serve_read
        with Retained() as mem:
            stream = conn.stream("fs.read", path="/big")
            got = bytearray((await anext(aiter(stream)))[1])
            await in_thread(flooded.wait, 120)
            await settle(conn, fake)
            held = mem.now()
            async for _, payload in stream:
                got += payload
        assert held < 2 * MiB + SLACK, f"{held / MiB:.1f} MiB queued for one slow reader"
        assert bytes(got) == content
        assert budget(conn) == 0


async def test_a_replay_flood_is_paged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest that answers a replay with its whole history at once (ignoring the window the agent
    asks for) to a subscriber that is slow: bounded, and the subscriber still gets every event once,
    in order, then the exit."""
    monkeypatch.setattr(guest_client, "STREAM_LIMIT", 2 * MiB, raising=False)
    n = 50_000
    async with seam() as (conn, fake):
        log = CommandLog(fake, hostile_replays=1)
        list(log.record(out_events("c1", n, 200)))
        list(log.record([({"t": "ev", "kind": "exit", "cmd": "c1", "seq": n + 1, "exit_code": 0,
                           "signal": None, "timed_out": False}, b"")]))
        with Retained() as mem:
            async with contextlib.aclosing(conn.events("c1")) as events:
                seqs = [(await anext(events))[0]["seq"]]
                await settle(conn, fake)
                held = mem.now()
                async for ev, _ in events:
                    seqs.append(ev["seq"])
        assert held < 2 * MiB + SLACK, f"{held / MiB:.1f} MiB of one replay queued"
        assert seqs == list(range(1, n + 2))
        assert budget(conn) == 0


async def test_a_subscriber_leaving_mid_replay_gives_back_what_it_held() -> None:
    """The replay page a departing subscriber had not read yet stayed queued (and counted) until the
    guest answered, and for a guest that never answers, for as long as the connection lived."""
    async with seam() as (conn, fake):
        log = CommandLog(fake)
        list(log.record(out_events("c1", 1_000, 1_000)))
        fake.handlers["replay"] = lambda h: fake.flood(
            ({"t": "chunk", "id": h["id"], "ev": ev}, p) for ev, p in log.events["c1"])  # and no answer
        async with contextlib.aclosing(conn.events("c1")) as events:
            await anext(events)
            await settle(conn, fake)
            assert conn.buffered > 0
        assert conn.buffered == 0


async def test_live_events_for_a_subscriber_that_does_not_read_are_bounded() -> None:
    """A guest that ignores acks and floods a command's output at a subscriber that does not read
    (its HTTP client stalled): bounded by count too (a flood of tiny events), and once the
    subscriber reads again it gets everything, replayed from the guest's buffer."""
    n = 100_000
    async with seam() as (conn, fake):
        log = CommandLog(fake)
        log.events["c1"] = []
        frames = [*out_events("c1", n, 16), (
            {"t": "ev", "kind": "exit", "cmd": "c1", "seq": n + 1, "exit_code": 0, "signal": None,
             "timed_out": False}, b"")]
        with Retained() as mem:
            async with contextlib.aclosing(conn.events("c1")) as events:
                first = asyncio.create_task(anext(events))
                await in_thread(fake.flood, log.record(frames))
                seqs = [(await first)[0]["seq"]]
                await settle(conn, fake)
                held = mem.now()
                async for ev, _ in events:
                    seqs.append(ev["seq"])
        assert held < guest_client.SUB_LIMIT + SLACK, f"{held / MiB:.1f} MiB queued for one subscriber"
        assert seqs == list(range(1, n + 2))
        assert budget(conn) == 0


async def test_output_held_for_the_first_subscriber_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between ``exec`` and the caller's ``events`` the agent holds the command's output (the attach
    grace, made long here so that it cannot end during the flood): a guest flooding tiny events then
    must not grow that without bound."""
    monkeypatch.setattr(guest_client, "ATTACH_GRACE", 600.0)
    n = 100_000
    async with seam() as (conn, fake):
        log = CommandLog(fake)
        fake.handlers["exec"] = lambda h: fake.reply(h, pid=7, started_at=0.0)
        log.events["c1"] = []
        frames = [*out_events("c1", n, 16), (
            {"t": "ev", "kind": "exit", "cmd": "c1", "seq": n + 1, "exit_code": 3, "signal": None,
             "timed_out": False}, b"")]
        with Retained() as mem:
            await conn.request("exec", cmd="c1", argv=["x"])
            await in_thread(fake.flood, log.record(frames))
            await settle(conn, fake)
            held = mem.now()
            async with contextlib.aclosing(conn.events("c1")) as events:
                seqs = [ev["seq"] async for ev, _ in events]
        assert held < guest_client.SUB_LIMIT + SLACK, f"{held / MiB:.1f} MiB held for the first subscriber"
        assert seqs == list(range(1, n + 2))
        assert budget(conn) == 0


async def test_subscribers_share_one_budget_per_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many stalled subscribers of one sandbox: together they hold at most the connection's budget
    (plus one event each, so every one of them makes progress), not one limit each."""
    monkeypatch.setattr(guest_client, "SUB_LIMIT", 1 * MiB)
    monkeypatch.setattr(guest_client, "BUDGET", 4 * MiB, raising=False)
    cids = [f"c{i}" for i in range(16)]
    async with seam() as (conn, fake):
        log = CommandLog(fake)
        for c in cids:
            log.events[c] = []
        with Retained() as mem:
            subs = [conn.events(c) for c in cids]
            firsts = [asyncio.create_task(anext(s)) for s in subs]
            await await_replays(log, len(cids))
            frames = [f for c in cids for f in out_events(c, 40, 50_000)]
            await in_thread(fake.flood, log.record(frames))
            await asyncio.gather(*firsts)
            await settle(conn, fake)
            held = mem.now()
            for s in subs:
                await s.aclose()
        per_item = 50_000 + 4096
        assert held < 4 * MiB + len(cids) * per_item + SLACK, f"{held / MiB:.1f} MiB for 16 subscribers"
        assert budget(conn) == 0


async def await_replays(log: CommandLog, n: int) -> None:
    async with asyncio.timeout(60):
        while log.replays < n:
            await asyncio.sleep(0.01)


async def test_acks_do_not_pile_up_when_the_guest_never_reads() -> None:
    """A guest that never reads its input and sends output crossing an ack boundary in every event:
    every ack it provokes waited in the agent's write buffer, which grew without bound."""
    step = guest_client.ACK_EVERY
    async with seam(read=False) as (_, fake):
        with Retained() as mem:
            def provoke() -> None:
                for cid in ("f" * 120, "g" * 120):  # long ids make long acks
                    fake.flood(({"t": "ev", "kind": "out", "cmd": cid, "seq": i + 1, "fd": 1,
                                  "off": (i + 1) * step - 1}, b"xx") for i in range(60_000))
                # Padding that asks for nothing: once it is sent, the agent has read what came before.
                fake.flood(({"t": "ev", "kind": "activity"}, b"p" * protocol.MAX_PAYLOAD) for _ in range(200))
            await in_thread(provoke)
            kept = mem.now()
        assert kept < READER + SLACK, f"{kept / MiB:.1f} MiB of acks waiting for a guest that never reads"


async def test_a_header_nested_too_deep_is_skipped() -> None:
    """A header that is valid JSON nested beyond the parser's recursion limit killed the reader."""
    async with seam() as (conn, fake):
        fake.raw(protocol._LEN.pack(4 + 60_000, 60_000) + b"[" * 60_000)
        await settle(conn, fake)
        assert not conn.closed


async def test_fields_of_any_json_type_do_not_kill_the_reader() -> None:
    """An id or a kind that is a list or an object (unhashable: a TypeError on lookup) killed the
    reader, and with it every request of the sandbox."""
    async with seam() as (conn, fake):
        log = CommandLog(fake)
        log.events["c1"] = []

        def replay(h: Header) -> None:
            log.replays += 1
            fake.send({"t": "chunk", "id": h["id"], "ev": {"kind": ["out"], "cmd": "c1", "seq": 1}})
            fake.reply(h, last_seq=0, state="running")

        fake.handlers["replay"] = replay
        async with contextlib.aclosing(conn.events("c1")) as events:
            first = asyncio.create_task(anext(events))
            await await_replays(log, 1)
            fake.flood([({"t": "res", "id": [1], "ok": True}, b""), ({"t": "chunk", "id": {"a": 1}}, b""),
                        ({"t": "ev", "kind": ["out"], "cmd": "c1", "seq": 1}, b""),
                        ({"t": "ev", "kind": "out", "cmd": ["c1"], "seq": 1, "fd": 1, "off": 0}, b"")])
            await settle(conn, fake)
            assert not conn.closed
            fake.send({"t": "ev", "kind": "exit", "cmd": "c1", "seq": 1, "exit_code": 0})
            assert (await first)[0]["kind"] == "exit"


async def test_events_handed_on_carry_only_the_protocol_fields() -> None:
    """What a subscriber gets is rebuilt from the protocol's fields with the protocol's types:
    junk keys are not passed on, and an event whose fields have the wrong types is dropped."""
    async with seam() as (conn, fake):
        log = CommandLog(fake)
        log.events["c1"] = []
        bad: list[tuple[Header, bytes]] = [
            ({"t": "ev", "kind": "out", "cmd": "c1", "seq": 1, "fd": "stdout", "off": 0}, b"bad"),
            ({"t": "ev", "kind": "out", "cmd": "c1", "seq": True, "fd": 1, "off": 0}, b"bad"),
            ({"t": "ev", "kind": "out", "cmd": "c1", "seq": 1, "fd": 1, "off": -5}, b"bad"),
        ]
        good: list[tuple[Header, bytes]] = [
            ({"t": "ev", "kind": "out", "cmd": "c1", "seq": 1, "fd": 2, "off": 0,
              **{f"junk{i}": i for i in range(500)}}, b"good"),
            ({"t": "ev", "kind": "exit", "cmd": "c1", "seq": 2, "exit_code": 1, "signal": None,
              "timed_out": False, "junk": [1] * 1000}, b""),
        ]
        async with contextlib.aclosing(conn.events("c1")) as events:
            first = asyncio.create_task(anext(events))
            await await_replays(log, 1)
            fake.flood(bad)
            await in_thread(fake.flood, log.record(good))
            got: list[tuple[dict[str, Any], bytes]] = [await first]
            got += [e async for e in events]
        assert [p for _, p in got] == [b"good", b""]
        allowed = {"t", "kind", "cmd", "seq", "fd", "off", "exit_code", "signal", "timed_out", "lost_bytes"}
        for ev, payload in got:
            assert set(ev) <= allowed, set(ev) - allowed
            guest_event(ev, payload, SSE_WIRE)
            guest_event(ev, payload, FRAME_WIRE)


async def test_a_frame_longer_than_the_protocol_closes_the_channel() -> None:
    """Holds already: a length prefix beyond MAX_FRAME is refused before anything is allocated."""
    async with seam() as (conn, fake):
        with Retained() as mem:
            fake.raw(protocol._LEN.pack(0xFFFFFFF0, 16))
            async with asyncio.timeout(30):
                await conn.wait_closed()
            assert mem.peak() < SLACK


async def test_a_partial_frame_holds_at_most_one_frame() -> None:
    """Holds already: a frame that never ends costs at most one frame (and the reader's buffer)."""
    async with seam() as (conn, fake):
        with Retained() as mem:
            fake.raw(protocol._LEN.pack(protocol.MAX_FRAME - 4, 16) + b"{" * (protocol.MAX_FRAME - 100))
            await asyncio.sleep(0)
            assert mem.peak() < READER + SLACK
        assert not conn.closed


async def test_a_startup_helper_keeps_a_bounded_output() -> None:
    """The node's own helper commands (template start, log tails) read their output from the guest:
    a guest flooding it made the agent collect all of it."""
    async with seam() as (conn, fake):
        log = CommandLog(fake)

        def on_exec(h: Header) -> None:
            cid = h["cmd"]
            log.events[cid] = []
            fake.reply(h, pid=7, started_at=0.0)
            frames = list(out_events(cid, 1_000, protocol.MAX_PAYLOAD))
            frames.append(({"t": "ev", "kind": "exit", "cmd": cid, "seq": 1_001, "exit_code": 0,
                            "signal": None, "timed_out": False}, b""))
            fake.flood(log.record(frames))

        fake.handlers["exec"] = on_exec
        fake.handlers["forget"] = lambda h: fake.reply(h)
        with Retained() as mem:
            code, out = await startup._run(conn, ["/usr/bin/tail", "-c", "2000", "/log"], timeout=60)
            assert code == 0
            kept = mem.now()
        assert kept < SLACK + MiB, f"{kept / MiB:.1f} MiB kept of a helper's 60 MiB output"
        assert len(out) <= startup.MAX_HELPER_OUTPUT


async def test_a_flood_of_tiny_frames_is_read_at_a_bounded_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest sending tiny frames as fast as it can is read at FRAME_RATE (made 6.4 frames/s here,
    one batch of 64 per 10 s, no burst): the rest waits in the channel (and, through the shim, in the
    guest), while another sandbox's channel on the same event loop is served as usual."""
    monkeypatch.setattr(guest_client, "FRAME_RATE", 6.4, raising=False)
    monkeypatch.setattr(guest_client, "FRAME_BURST", 0.0, raising=False)
    async with seam() as (conn, fake), seam() as (other, other_fake):
        log = CommandLog(fake)
        log.events["c1"] = []
        async with contextlib.aclosing(conn.events("c1")) as events:
            first = asyncio.create_task(anext(events))
            await await_replays(log, 1)
            flooder = threading.Thread(target=fake.flood, args=(out_events("c1", 10_000, 16),), daemon=True)
            flooder.start()
            await first
            for _ in range(10):
                await settle(other, other_fake)
            batch = guest_client.YIELD_EVERY * (16 + 512)
            assert conn.buffered <= 4 * batch, f"{conn.buffered // (16 + 512)} events read already"


def test_garbage_is_skipped_without_a_python_step_per_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shim resyncs after garbage a guest wrote: that scan tried every ``{`` in Python (a guest
    writing ``{`` at a few MB/s kept the shim, a host process outside the sandbox's cgroup, busy on a
    core). Now only plausible frame starts get a Python check."""
    from space.runtime.shim import complete_frames

    checks = 0
    real = protocol.decode_lengths

    def counted(prefix: bytes) -> tuple[int, int]:
        nonlocal checks
        checks += 1
        return real(prefix)

    monkeypatch.setattr(protocol, "decode_lengths", counted)
    good = protocol.encode({"t": "ev", "kind": "activity"})
    buf = bytearray(b"{" * MiB + b"\xff\xff\xff\xf0" + bytes(range(256)) * 256 + good)
    assert complete_frames(buf) == len(good) and bytes(buf) == good
    assert checks < 100, f"{checks} interpreted checks for 1 MiB of garbage"


async def test_an_error_answer_carries_only_its_code_and_message() -> None:
    """The rest of a guest's error went into the exception (and on to the API's answer): ``allowed``
    that was not a list made the request fail with a TypeError, and any field rode along."""
    async with seam() as (conn, fake):
        fake.handlers["activity"] = lambda h: fake.send({"t": "res", "id": h["id"], "ok": False, "error": {
            "code": "invalid_state", "message": "no", "allowed": 5, "junk": "y" * 50_000}})
        with pytest.raises(errors.InvalidState) as caught:
            await conn.request("activity")
        assert caught.value.to_wire()["error"].keys() <= {"code", "message", "state", "allowed"}
