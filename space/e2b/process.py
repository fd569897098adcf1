"""envd's ``process.Process`` service over SPACE's commands.

An E2B process is a SPACE command: Start runs one through the node (its id is ours, its pid the
guest's), and its output stream is the command's event stream translated into Connect envelopes.
E2B names processes by pid, so calls that take a selector find the command by pid in the node's
listing. Semantics copied from envd (``E2B_COMPAT.md`` C.2): the Connect deadline of Start is the
process's lifetime; a client that goes away does not kill the process; exit statuses read like
Go's ``ProcessState``; a stream whose sandbox goes away is ended with ``unavailable``, never with an
``end`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal as signal_mod
import time
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from space import ids
from space.api.state import AppState
from space.e2b import connect, filesystem
from space.e2b.connect import ConnectError, end_of_stream, envelope, field, uint, unb64
from space.e2b.edge import Target, json_body, target
from space.errors import NotFound, SpaceError
from space.lifecycle import State
from space.sdk._sse import SSEDecoder

log = structlog.get_logger("space.e2b.process")

#: envd's default keepalive interval when the client names none.
DEFAULT_KEEPALIVE: Final = 90.0
#: How long a stream may be quiet before the facade checks that its sandbox still runs.
STATE_CHECK: Final = 2.0
#: How often a broken event stream is re-opened before the call gives up.
MAX_REOPEN: Final = 5
MAX_INPUT: Final = 16 << 20
#: How long SendSignal(SIGKILL) waits for the command to be reaped before it answers.
KILL_REAP_WAIT: Final = 2.0
_SIGNALS: Final = {"SIGNAL_SIGKILL": signal_mod.SIGKILL, "SIGNAL_SIGTERM": signal_mod.SIGTERM,
                   "SIGNAL_SIGINT": signal_mod.SIGINT, "SIGNAL_SIGHUP": signal_mod.SIGHUP}
#: Go's names for the signals a process commonly dies of (``signal: killed``).
_GO_SIGNAL_NAMES: Final = {
    signal_mod.SIGKILL: "killed", signal_mod.SIGTERM: "terminated", signal_mod.SIGINT: "interrupt",
    signal_mod.SIGHUP: "hangup", signal_mod.SIGQUIT: "quit", signal_mod.SIGABRT: "aborted",
    signal_mod.SIGSEGV: "segmentation fault", signal_mod.SIGPIPE: "broken pipe",
    signal_mod.SIGBUS: "bus error", signal_mod.SIGFPE: "floating point exception",
    signal_mod.SIGILL: "illegal instruction", signal_mod.SIGUSR1: "user defined signal 1",
    signal_mod.SIGUSR2: "user defined signal 2", signal_mod.SIGALRM: "alarm clock",
}


# -- wire shapes --------------------------------------------------------------------------------


def end_event(exit_code: int | None, sig: int | None) -> dict[str, Any]:
    if sig:
        try:
            name = _GO_SIGNAL_NAMES.get(signal_mod.Signals(sig), signal_mod.Signals(sig).name)
        except ValueError:
            name = f"signal {sig}"
        status = f"signal: {name}"
        return {"exitCode": -1, "exited": False, "status": status, "error": status}
    code = exit_code if isinstance(exit_code, int) else -1
    end: dict[str, Any] = {"exitCode": code, "exited": True, "status": f"exit status {code}"}
    if code != 0:
        end["error"] = end["status"]
    return end


def _event(ev: dict[str, Any]) -> bytes:
    return envelope({"event": ev})


# -- selectors and commands ---------------------------------------------------------------------


async def _commands(t: Target) -> list[dict[str, Any]]:
    res = await t.node.call("GET", f"/v1/sandboxes/{t.sandbox.id}/commands")
    cmds = res.get("commands", [])
    return [c for c in cmds if isinstance(c, dict)]


async def find_command(t: Target, selector: Any, *, running: bool = False) -> dict[str, Any]:
    """The command a ``ProcessSelector`` names (``{"pid": n}``; tags are not kept)."""
    if not isinstance(selector, dict):
        raise ConnectError("invalid_argument", "process selector is required")
    if "tag" in selector:
        raise ConnectError("not_found", f"process with tag {selector['tag']!r} not found")
    pid = uint(selector.get("pid"), "process.pid")
    found = [c for c in await _commands(t) if c.get("pid") == pid]
    # A pid may be reused after its command exited: the running one is the one meant.
    live = [c for c in found if c.get("state") == "running"]
    if live:
        return live[-1]
    if found and not running:
        return found[-1]
    raise ConnectError("not_found", f"process with pid {pid} not found")


# -- the stream of one command ------------------------------------------------------------------


class CommandStream:
    """A command's events from the node, as envd's ``ProcessEvent`` envelopes, resumed after a
    broken stream (the node answers again from the last event seen)."""

    def __init__(self, st: AppState, t: Target, cid: str, pid: int, *, pty: bool, after: int,
                 keepalive: float) -> None:
        self.st, self.t, self.cid, self.pid, self.pty = st, t, cid, pid, pty
        self.after = after
        self.keepalive = keepalive

    async def envelopes(self) -> AsyncIterator[bytes]:
        yield _event({"start": {"pid": self.pid}})
        queue: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue(maxsize=64)
        pump = asyncio.create_task(self._pump(queue))
        last_keepalive = time.monotonic()
        try:
            while True:
                wait = min(STATE_CHECK, max(0.0, last_keepalive + self.keepalive - time.monotonic()))
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=wait)
                except TimeoutError:
                    # A quiet stream: if the sandbox was paused or went away meanwhile, cut it as
                    # E2B's edge does (a paused sandbox's connections do not survive there either).
                    if not await self._sandbox_running():
                        raise connect.DropConnection(self._why_ended()) from None
                    if time.monotonic() - last_keepalive >= self.keepalive:
                        yield _event({"keepalive": {}})
                        last_keepalive = time.monotonic()
                    continue
                if item is None:  # the node's stream ended for good
                    if not await self._sandbox_running():
                        raise connect.DropConnection(self._why_ended())
                    yield end_of_stream(ConnectError("unavailable", self._why_ended()))
                    return
                kind, data = item
                if kind in ("stdout", "stderr"):
                    yield _event({"data": {("pty" if self.pty else kind): data.get("data", "")}})
                elif kind == "exit":
                    if data.get("timed_out"):
                        yield end_of_stream(ConnectError("deadline_exceeded", "the process ran out of its time"))
                        return
                    yield _event({"end": end_event(data.get("exit_code"), data.get("signal"))})
                    yield end_of_stream()
                    return
                elif kind == "error":  # the node lost the command: its sandbox died or went
                    if not await self._sandbox_running():
                        raise connect.DropConnection(self._why_ended())
                    yield end_of_stream(ConnectError("unavailable", self._why_ended()))
                    return
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

    async def _pump(self, queue: asyncio.Queue[tuple[str, dict[str, Any]] | None]) -> None:
        failures = 0
        try:
            while failures <= MAX_REOPEN:
                try:
                    resp = await self.t.node.open_stream(
                        "GET", f"/v1/sandboxes/{self.t.sandbox.id}/commands/{self.cid}/events",
                        params={"after": self.after})
                except SpaceError:
                    failures += 1
                    if not await self._sandbox_running():
                        return
                    await asyncio.sleep(0.2 * failures)
                    continue
                try:
                    decoder = SSEDecoder()
                    async for line in resp.aiter_lines():
                        ev = decoder.feed(line)
                        if ev is None:
                            continue
                        data = ev.json()
                        if ev.seq is not None:
                            self.after = ev.seq
                        await queue.put((ev.event, data))
                        if ev.event in ("exit", "error"):
                            return
                except (httpx.HTTPError, SpaceError):
                    pass
                finally:
                    await resp.aclose()
                failures += 1
                if not await self._sandbox_running():
                    return
        finally:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)

    async def _sandbox_running(self) -> bool:
        try:
            sb = await self.st.store.get_sandbox(self.t.sandbox.id)
        except NotFound:
            return False
        return sb.state == State.RUNNING

    def _why_ended(self) -> str:
        # Worded as envd does (it cannot tell either): the SDK then probes /health, which says
        # whether the sandbox is gone.
        return f"the connection to sandbox {self.t.sandbox.id} ended before the stream completed"


def _stream_response(stream: CommandStream) -> StreamingResponse:
    return connect.DroppableStream(stream.envelopes(), media_type=connect.STREAM_TYPE,
                             headers={"cache-control": "no-store", "x-accel-buffering": "no"})


def _keepalive(request: Request) -> float:
    raw = request.headers.get("keepalive-ping-interval", "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_KEEPALIVE
    return min(max(value, 1.0), 3600.0)


# -- the RPCs -----------------------------------------------------------------------------------


async def start(st: AppState, request: Request) -> Response:
    msg = await connect.first_stream_request(request)
    proc = field(msg, "process")
    if not isinstance(proc, dict) or not isinstance(proc.get("cmd"), str) or not proc["cmd"]:
        raise ConnectError("invalid_argument", "process.cmd is required")
    args = proc.get("args") or []
    envs = proc.get("envs") or {}
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConnectError("invalid_argument", "process.args must be a list of strings")
    if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
        raise ConnectError("invalid_argument", "process.envs must map strings to strings")
    pty = field(msg, "pty")
    stdin = field(msg, "stdin", default=True)
    t = await target(st, request)
    body: dict[str, Any] = {"id": ids.command_id(), "cmd": [proc["cmd"], *args], "env": envs,
                            "stdin": bool(stdin) or pty is not None}
    if isinstance(proc.get("cwd"), str) and proc["cwd"]:
        # envd resolves ``~`` and a relative cwd against the user's home.
        body["cwd"] = filesystem.resolve(proc["cwd"], (await filesystem.actor(st, t.sandbox, t.user)).home, "cwd")
    if t.user is not None:
        body["user"] = t.user
    if isinstance(pty, dict):
        size = pty.get("size") or {}
        body["pty"] = {"rows": uint(size.get("rows", 24), "pty.size.rows"),
                       "cols": uint(size.get("cols", 80), "pty.size.cols")}
    deadline = connect.timeout_seconds(request)
    if deadline is not None:
        body["timeout"] = deadline
    res = await t.node.call("POST", f"/v1/sandboxes/{t.sandbox.id}/commands", json_body=body)
    log.info("e2b.process.start", sandbox=t.sandbox.id, command=body["id"], pid=res.get("pid"))
    return _stream_response(CommandStream(st, t, body["id"], int(res["pid"]), pty="pty" in body, after=0,
                                          keepalive=_keepalive(request)))


async def connect_(st: AppState, request: Request) -> Response:
    msg = await connect.first_stream_request(request)
    t = await target(st, request)
    cmd = await find_command(t, field(msg, "process"))
    # Only what the process writes from now on (envd's semantics), unless it already ended: then
    # its end is all there is to tell.
    after = int(cmd.get("seq") or 0)
    if cmd.get("state") != "running":
        after = max(0, after - 1)
    return _stream_response(CommandStream(st, t, str(cmd["id"]), int(cmd["pid"]), pty=bool(cmd.get("pty")),
                                          after=after, keepalive=_keepalive(request)))


async def list_(st: AppState, request: Request) -> Response:
    await connect.unary_request(request)
    t = await target(st, request)
    out = []
    for c in await _commands(t):
        if c.get("state") != "running" or not c.get("pid"):
            continue
        argv = [str(a) for a in c.get("argv") or []] or [""]
        out.append({"config": {"cmd": argv[0], "args": argv[1:], "envs": {}}, "pid": c["pid"]})
    return json_body({"processes": out})


async def send_signal(st: AppState, request: Request) -> Response:
    msg = await connect.unary_request(request)
    name = field(msg, "signal", default="SIGNAL_UNSPECIFIED")
    sig = _SIGNALS.get(name) if isinstance(name, str) else (name if isinstance(name, int) else None)
    if not sig:
        raise ConnectError("invalid_argument", f"unsupported signal {name!r}")
    t = await target(st, request)
    cmd = await find_command(t, field(msg, "process"), running=True)
    try:
        await t.node.call("POST", f"/v1/sandboxes/{t.sandbox.id}/commands/{cmd['id']}/signal",
                          json_body={"signal": int(sig)})
    except SpaceError as exc:
        if exc.code == "invalid_state":  # it exited meanwhile
            raise ConnectError("not_found", f"process with pid {cmd['pid']} not found") from None
        raise
    if sig == signal_mod.SIGKILL:
        await _reaped(t, str(cmd["id"]))
    return json_body({})


async def _reaped(t: Target, command_id: str) -> None:
    """Wait (briefly) until a killed command is reaped, so that a ``List`` right after ``kill()``
    no longer shows it: agent code kills and then lists. SIGKILL cannot be caught, so this is
    milliseconds; past the bound the answer goes out anyway (the kill was delivered)."""
    deadline = time.monotonic() + KILL_REAP_WAIT
    pause = 0.005
    while time.monotonic() < deadline:
        if not any(c.get("id") == command_id and c.get("state") == "running" for c in await _commands(t)):
            return
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.1)


async def _write_input(t: Target, cmd: dict[str, Any], data: bytes, *, eof: bool = False) -> None:
    if len(data) > MAX_INPUT:
        raise ConnectError("resource_exhausted", f"input is limited to {MAX_INPUT} bytes per message")
    try:
        await t.node.call("POST", f"/v1/sandboxes/{t.sandbox.id}/commands/{cmd['id']}/stdin", content=data,
                          params={"eof": str(eof).lower()})
    except SpaceError as exc:
        if exc.code in ("invalid_state", "not_found"):
            raise ConnectError("not_found", f"process with pid {cmd['pid']} not found or its stdin is closed") from None
        raise


def _input_bytes(value: Any) -> bytes:
    if not isinstance(value, dict):
        raise ConnectError("invalid_argument", "input is required")
    if "stdin" in value:
        return unb64(value["stdin"], "input.stdin")
    if "pty" in value:
        return unb64(value["pty"], "input.pty")
    return b""


async def send_input(st: AppState, request: Request) -> Response:
    msg = await connect.unary_request(request)
    data = _input_bytes(field(msg, "input"))
    t = await target(st, request)
    cmd = await find_command(t, field(msg, "process"), running=True)
    await _write_input(t, cmd, data)
    return json_body({})


async def close_stdin(st: AppState, request: Request) -> Response:
    msg = await connect.unary_request(request)
    t = await target(st, request)
    cmd = await find_command(t, field(msg, "process"), running=True)
    await _write_input(t, cmd, b"", eof=True)
    return json_body({})


async def stream_input(st: AppState, request: Request) -> Response:
    t = await target(st, request)
    cmd: dict[str, Any] | None = None
    async for msg in connect.stream_requests(request):
        if "start" in msg:
            cmd = await find_command(t, (msg["start"] or {}).get("process"), running=True)
        elif "data" in msg:
            if cmd is None:
                raise ConnectError("failed_precondition", "the input stream must start with a start message")
            await _write_input(t, cmd, _input_bytes((msg["data"] or {}).get("input")))
    return StreamingResponse(iter([envelope({}), end_of_stream()]), media_type=connect.STREAM_TYPE)


async def update(st: AppState, request: Request) -> Response:
    msg = await connect.unary_request(request)
    pty = field(msg, "pty")
    t = await target(st, request)
    cmd = await find_command(t, field(msg, "process"), running=True)
    if isinstance(pty, dict):
        size = pty.get("size") or {}
        await t.node.call("POST", f"/v1/sandboxes/{t.sandbox.id}/commands/{cmd['id']}/resize",
                          json_body={"rows": uint(size.get("rows", 24), "pty.size.rows"),
                                     "cols": uint(size.get("cols", 80), "pty.size.cols")})
    return json_body({})


RPCS: Final = {
    "Start": start, "Connect": connect_, "List": list_, "SendSignal": send_signal, "SendInput": send_input,
    "CloseStdin": close_stdin, "StreamInput": stream_input, "Update": update,
}
#: Methods whose request is an enveloped stream (the others are unary).
STREAMING: Final = frozenset({"Start", "Connect", "StreamInput"})
