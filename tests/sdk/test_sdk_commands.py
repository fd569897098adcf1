"""Commands through the SDK: request shapes, output events, stdin/signal/resize, and stream resume.

Aspects: a string runs in a shell and a list as argv; options reach the body; results carry
exit code, both streams and the signal; a stream dropped mid-event is resumed with Last-Event-ID
and yields every event exactly once (async and sync); retries are bounded; the decoders. Every
test runs against a server answering frames (what SPACE does when asked) and one speaking only SSE.
"""

from __future__ import annotations

import base64
import struct

import httpx
import pytest

import space.sdk._async._http as async_http
import space.sdk._sse as sse_module
import space.sdk._sync._http as sync_http
from space import AsyncClient, Client, errors, event_frames
from space.sdk import AsyncSandbox
from space.sdk._models import Event
from space.sdk._sse import ACCEPT_EVENTS, EventDecoder, ServerSentEvent, SSEDecoder, StreamEvent
from tests.sdk.fake_api import API_KEY, URL, FakeAPI, encode_event


@pytest.fixture(params=["frames", "sse"])
def fake(request: pytest.FixtureRequest) -> FakeAPI:
    api = FakeAPI()
    api.answer_frames = request.param == "frames"
    return api


@pytest.fixture
async def sandbox(aclient: AsyncClient) -> AsyncSandbox:
    return await aclient.sandboxes.create()


async def test_string_is_a_shell_list_is_argv_and_options_reach_the_body(
    fake: FakeAPI, sandbox: AsyncSandbox
) -> None:
    await sandbox.exec("echo hi | wc -c")
    await sandbox.exec(["echo", "a b"], env={"K": "V"}, cwd="/tmp", user="root", pty=(40, 120), timeout=5)
    first, second = (s.json() for s in fake.seen("POST", "/commands"))
    assert first == {"shell": "echo hi | wc -c"}
    assert second == {"cmd": ["echo", "a b"], "env": {"K": "V"}, "cwd": "/tmp", "user": "root",
                      "pty": {"rows": 40, "cols": 120}, "timeout": 5}


async def test_exec_returns_exit_code_and_both_streams(sandbox: AsyncSandbox) -> None:
    out: list[bytes] = []
    err: list[bytes] = []
    result = await sandbox.exec(["emit", "out", "err", "7"], on_stdout=out.append, on_stderr=err.append)
    assert (result.exit_code, result.stdout, result.stderr, result.signal) == (7, b"out", b"err", None)
    assert out == [b"out"] and err == [b"err"]
    assert not result.ok and result.stderr_text == "err"


async def test_a_killed_command_reports_its_signal(sandbox: AsyncSandbox) -> None:
    result = await sandbox.exec(["killed", "9"])
    assert result.signal == 9 and not result.ok


async def test_start_returns_a_handle_and_stdin_reaches_the_process(
    fake: FakeAPI, sandbox: AsyncSandbox
) -> None:
    command = await sandbox.start(["cat"], stdin=True)
    assert command.pid is not None and command.attach_token == f"tok-{command.id}"
    await command.send_stdin(b"hello ")
    await command.send_stdin(b"world", eof=True)
    stdin_posts = fake.seen("POST", "/stdin")
    assert [s.body for s in stdin_posts] == [b"hello ", b"world"]
    assert [s.params.get("eof") for s in stdin_posts] == [None, "true"]
    assert (await command.wait()).stdout == b"hello world"
    assert (await sandbox.exec(["cat"], stdin=b"piped")).stdout == b"piped"
    assert next(c["id"] for c in await sandbox.list_commands()) == command.id
    assert (await sandbox.get_command(command.id)).info["state"] == "exited"


async def test_signal_and_resize_requests(fake: FakeAPI, sandbox: AsyncSandbox) -> None:
    command = await sandbox.start(["cat"], stdin=True, pty=True)
    await command.resize(50, 132)
    await command.signal("SIGTERM")
    await command.signal(9)
    assert [s.json() for s in fake.seen("POST", "/resize")] == [{"rows": 50, "cols": 132}]
    assert [s.json() for s in fake.seen("POST", "/signal")] == [{"signal": "SIGTERM"}, {"signal": 9}]
    assert (await command.wait()).signal == 15


async def test_a_dropped_stream_resumes_without_duplicates_or_holes(
    fake: FakeAPI, sandbox: AsyncSandbox
) -> None:
    fake.drop_events_after = 2
    command = await sandbox.start(["count", "5"])
    events = [e async for e in command.events()]
    assert [e.seq for e in events] == [1, 2, 3, 4, 5, 6]
    assert b"".join(e.data for e in events) == b"".join(f"line {i}\n".encode() for i in range(1, 6))
    assert events[-1].type == "exit" and events[-1].exit_code == 0
    streams = fake.seen("GET", "/events")
    assert len(streams) == 2
    assert "last-event-id" not in streams[0].headers and streams[1].headers["last-event-id"] == "2"


def test_the_sync_client_resumes_too(fake: FakeAPI, client: Client) -> None:
    fake.drop_events_after = 0
    sandbox = client.sandboxes.create()
    result = sandbox.exec(["count", "3"])
    assert result.stdout == b"line 1\nline 2\nline 3\n"
    # exec runs in one request (its answer is the event stream); that stream dropped before its
    # first event, so one GET took the events up from the start.
    assert [s.headers.get("accept") for s in fake.seen("POST", "/commands")] == [ACCEPT_EVENTS]
    assert [s.headers.get("last-event-id") for s in fake.seen("GET", "/events")] == [None]


async def test_an_exec_whose_stream_drops_goes_on_from_the_last_event_seen(
    fake: FakeAPI, sandbox: AsyncSandbox
) -> None:
    fake.drop_events_after = 2
    seen: list[bytes] = []
    result = await sandbox.exec(["count", "5"], on_stdout=seen.append)
    assert seen == [f"line {i}\n".encode() for i in range(1, 6)]  # each once, in order
    assert result.stdout == b"".join(seen) and result.exit_code == 0
    assert [s.headers["last-event-id"] for s in fake.seen("GET", "/events")] == ["2"]


async def test_an_exec_is_one_request_when_its_stream_holds(fake: FakeAPI, sandbox: AsyncSandbox) -> None:
    result = await sandbox.exec(["echo", "hi"])
    assert result.stdout == b"hi\n" and result.exit_code == 0
    assert len(fake.seen("POST", "/commands")) == 1 and fake.seen("GET", "/events") == []


async def test_events_after_a_sequence_number(sandbox: AsyncSandbox) -> None:
    command = await sandbox.start(["count", "3"])
    assert [e.seq async for e in command.events(after=2)] == [3, 4]


def _stream_that_always_ends_early(calls: list[httpx.Request]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if request.url.path.endswith("/events"):
            return httpx.Response(200, text="event: stdout\n")  # half an event, then EOF
        return httpx.Response(201, json={"id": "cmd-1", "pid": 1})

    return httpx.MockTransport(handler)


async def test_reconnects_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(async_http, "RECONNECT_DELAYS", (0.0, 0.0, 0.0))
    calls: list[httpx.Request] = []
    async with AsyncClient(URL, API_KEY, transport=_stream_that_always_ends_early(calls)) as c:
        sandbox = AsyncSandbox(c._http, c.operations, {"id": "sb-1", "state": "running"})
        command = await sandbox.start("true")
        with pytest.raises(errors.Unavailable, match="ended before its exit event"):
            await command.wait()
    assert len([r for r in calls if r.url.path.endswith("/events")]) == 4


def test_non_retryable_stream_errors_are_raised_at_once(
    monkeypatch: pytest.MonkeyPatch, client: Client
) -> None:
    monkeypatch.setattr(sync_http, "RECONNECT_DELAYS", (0.0,) * 5)
    sandbox = client.sandboxes.create()
    command = sandbox.start(["echo"])
    command.info["id"] = "cmd-gone"
    command._path = command._path.rsplit("/", 1)[0] + "/cmd-gone"
    with pytest.raises(errors.NotFound):
        command.wait()


def test_sse_decoder() -> None:
    decoder = SSEDecoder()
    lines = [": keep-alive", "id: 7", "event: stdout", "data: {\"a\":", "data: 1}", "", "",
             "event: exit", "data: {\"seq\": 8}", ""]
    events = [e for e in (decoder.feed(line) for line in lines) if e is not None]
    assert events == [ServerSentEvent("stdout", '{"a":\n1}', "7"), ServerSentEvent("exit", '{"seq": 8}')]
    assert [e.seq for e in events] == [7, 8]
    assert decoder.feed("data: half") is None  # never dispatched without its blank line


def _feed_bytewise(decoder: EventDecoder, data: bytes) -> list[StreamEvent]:
    return [ev for i in range(len(data)) for ev in decoder.feed(data[i : i + 1])]


@pytest.mark.parametrize("frames", [True, False])
def test_both_decoders_give_the_same_events_whole_at_any_chunk_boundary(frames: bool) -> None:
    binary = bytes(range(256)) * 300  # output of every byte value, longer than one read
    stream = b"".join([
        encode_event(frames, "started", {"id": "cmd-1", "pid": 7}, None),
        encode_event(frames, "stdout", {"seq": 1, "data": base64.b64encode(binary).decode()}, 1),
        event_frames.KEEPALIVE if frames else b": keepalive\n\n",
        encode_event(frames, "stderr", {"seq": 2, "data": ""}, 2),
        encode_event(frames, "exit", {"seq": 3, "exit_code": 0, "signal": None}, 3),
    ])
    media = event_frames.MEDIA_TYPE if frames else "text/event-stream; charset=utf-8"
    whole = EventDecoder(media).feed(stream)
    assert whole == _feed_bytewise(EventDecoder(media), stream)
    assert [(e.event, e.seq) for e in whole] == [("started", None), ("stdout", 1), ("stderr", 2), ("exit", 3)]
    assert whole[0].data == {"id": "cmd-1", "pid": 7} and whole[3].data["exit_code"] == 0
    events = [Event.from_wire(e.event, e.seq or 0, e.data) for e in whole[1:]]
    assert [e.data for e in events[:2]] == [binary, b""] and events[2].exit_code == 0
    cut = EventDecoder(media)
    assert cut.feed(stream[: len(stream) // 2]) == whole[:1]  # never half an event


def test_a_frame_over_the_bounds_or_without_an_event_name_is_an_error_not_a_buffer() -> None:
    too_long = struct.pack(">II", 16, event_frames.MAX_PAYLOAD + 1)
    with pytest.raises(errors.Internal, match="over the bounds"):
        EventDecoder(event_frames.MEDIA_TYPE).feed(too_long)  # refused from its lengths alone
    for header in (b"[1]", b'{"seq": 1}', b"{nope"):
        with pytest.raises(errors.Internal, match="malformed event stream"):
            EventDecoder(event_frames.MEDIA_TYPE).feed(struct.pack(">II", len(header), 0) + header)


def test_an_sse_line_without_end_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse_module, "MAX_LINE", 1000)
    decoder = EventDecoder("text/event-stream")
    decoder.feed(b"data: " + b"x" * 900)
    with pytest.raises(errors.Internal, match="longer than 1000"):
        decoder.feed(b"x" * 200)
