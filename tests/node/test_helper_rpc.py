"""The root helper's transport, over real unix sockets with real child processes (runs as root).

Aspects: a round trip; argument and verb errors arrive as the same classes with their details;
streamed lines in order; fd passing (and the server dropping its copy); a timeout, a client
cancellation and a server shutdown kill the verb's process group; the peer check refuses another
uid and, without allow_root, root; the socket file is 0660 and replaces a stale one; queued
connections beyond the limit are served; a stop waits for what the verbs it cancels do on
cancellation; the ``python -m space.node.helper`` process serves a real verb, imports nothing heavy
and exits 0 on SIGTERM and when its stop pipe closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from space.errors import Conflict, Internal, InvalidRequest, RuntimeFailure, Timeout, Unavailable
from space.node.helper import privileged, verbs
from space.node.helper.rpc import HelperClient, HelperServer, serve
from space.node.helper.verbs import Call, HelperContext, verb
from tests.waiting import await_exit, await_for

pytestmark = pytest.mark.anyio

DEADLINE = 30.0
NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]


# -- test-only verbs (the registry is global: unique names, removed afterwards) -----------------


@dataclass(frozen=True)
class EchoArgs:
    text: str
    n: int = 0


@dataclass(frozen=True)
class CountArgs:
    count: int


@dataclass(frozen=True)
class FileArgs:
    path: str


@dataclass(frozen=True)
class NoArgs:
    pass


@dataclass(frozen=True)
class Names:
    echo: str
    lines: str
    sleep: str
    fd: str
    boom: str
    crash: str
    mark: str
    tidy: str


def _exists(path: Path) -> bool:
    return path.exists()


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


#: What the ``tidy`` verb's cleanup waits for, per marker path: the test decides when it ends.
_GATES: dict[str, asyncio.Event] = {}


async def _mark_when_let(path: str) -> None:
    await _GATES.setdefault(path, asyncio.Event()).wait()  # cleanup that takes a while, as `runsc delete`
    _touch(path)


@pytest.fixture(scope="module")
def names() -> Iterator[Names]:
    prefix = f"rpctest{uuid.uuid4().hex[:8]}"
    n = Names(*(f"{prefix}.{f}" for f in ("echo", "lines", "sleep", "fd", "boom", "crash", "mark", "tidy")))

    @verb(n.echo, EchoArgs, cap=10)
    async def echo(ctx: HelperContext, args: EchoArgs, call: Call) -> dict[str, Any]:
        return {"text": args.text, "n": args.n}

    @verb(n.lines, CountArgs, cap=10, streaming=True)
    async def lines(ctx: HelperContext, args: CountArgs, call: Call) -> dict[str, Any]:
        for i in range(args.count):
            await call.line(f"line {i}")
        return {"sent": args.count}

    @verb(n.sleep, FileArgs, cap=60)
    async def sleep(ctx: HelperContext, args: FileArgs, call: Call) -> dict[str, Any]:
        # The shell's pid is its group's; the sleep is the grandchild that must die with it. The
        # pids are recorded here, not by the shell: once a line arrives privileged holds the process
        # and reaps its group on cancellation, which it does not yet while still spawning it.
        await privileged.stream_lines("sh", "-c", 'sleep 300 & echo "$$ $!"; wait',
                                      on_line=lambda line: write_pids(args.path, line), timeout=600)
        return {}

    @verb(n.fd, EchoArgs, cap=10, fds=("out",))
    async def write_fd(ctx: HelperContext, args: EchoArgs, call: Call) -> dict[str, Any]:
        return {"written": os.write(call.fds["out"], args.text.encode())}

    @verb(n.boom, NoArgs, cap=10)
    async def boom(ctx: HelperContext, args: NoArgs, call: Call) -> dict[str, Any]:
        raise RuntimeFailure("it failed", argv=["false"], returncode=1)

    @verb(n.crash, NoArgs, cap=10)
    async def crash(ctx: HelperContext, args: NoArgs, call: Call) -> dict[str, Any]:
        raise ValueError("a bug")

    @verb(n.mark, FileArgs, cap=10)
    async def mark(ctx: HelperContext, args: FileArgs, call: Call) -> dict[str, Any]:
        os.close(os.open(args.path, os.O_CREAT | os.O_WRONLY, 0o644))
        return {}

    @verb(n.tidy, FileArgs, cap=60)
    async def tidy(ctx: HelperContext, args: FileArgs, call: Call) -> dict[str, Any]:
        # Runs until cancelled, and then cleans up slowly, as runtime.launch deletes the instance
        # it was starting.
        _touch(args.path + ".started")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            _touch(args.path + ".cancelled")
            await asyncio.shield(_mark_when_let(args.path))
            raise
        return {}

    try:
        yield n
    finally:
        for name in n.__dict__.values():
            verbs.REGISTRY.pop(name, None)


# -- fixtures and helpers -----------------------------------------------------------------------


def ctx_for(root: Path) -> HelperContext:
    return HelperContext(data_dir=root / "data", cache_dir=root / "cache")


@pytest.fixture
async def served(tmp_path: Path, names: Names) -> AsyncIterator[tuple[HelperServer, HelperClient]]:
    path = tmp_path / "helper.sock"
    server = await serve(ctx_for(tmp_path), path, agent_uid=NOBODY, allow_root=True)
    try:
        yield server, HelperClient(path)
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory others can reach (pytest's tmp dirs are root-only)."""
    d = Path(tempfile.mkdtemp(prefix="space-rpc-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


def write_pids(path: str, line: str) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(line)
    tmp.rename(path)


def read_pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


async def recorded_pids(path: Path) -> list[int]:
    async def read() -> list[int]:
        return read_pids(path)
    return await await_for(read, DEADLINE, f"the pids in {path}")


# -- calls ----------------------------------------------------------------------------------------


async def test_round_trip(served: tuple[HelperServer, HelperClient], names: Names) -> None:
    _, client = served
    assert await client.call(names.echo, {"text": "héllo", "n": 3}) == {"text": "héllo", "n": 3}
    assert await client.call(names.echo, {"text": "x"}, timeout=5) == {"text": "x", "n": 0}


async def test_bad_arguments_and_unknown_verbs_are_invalid_requests(
        served: tuple[HelperServer, HelperClient], names: Names) -> None:
    _, client = served
    with pytest.raises(InvalidRequest, match="'n' has the wrong type"):
        await client.call(names.echo, {"text": "x", "n": "3"})
    with pytest.raises(InvalidRequest, match="unknown arguments"):
        await client.call(names.echo, {"text": "x", "path": "/etc"})
    with pytest.raises(InvalidRequest) as excinfo:
        await client.call("no.such.verb")
    assert excinfo.value.details == {"verb": "no.such.verb"}
    with pytest.raises(InvalidRequest, match="takes fds"):
        await client.call(names.echo, {"text": "x"}, fds={"out": 1})


async def test_lines_stream_in_order_then_the_result(served: tuple[HelperServer, HelperClient],
                                                     names: Names) -> None:
    _, client = served
    got: list[str] = []

    async def on_line(text: str) -> None:
        got.append(text)
    assert await client.call(names.lines, {"count": 300}, on_line=on_line) == {"sent": 300}
    assert got == [f"line {i}" for i in range(300)]
    got.clear()
    await client.call(names.lines, {"count": 3}, on_line=got.append)  # a plain callback too
    assert got == ["line 0", "line 1", "line 2"]


async def test_errors_keep_their_class_code_and_details(served: tuple[HelperServer, HelperClient],
                                                        names: Names) -> None:
    _, client = served
    with pytest.raises(RuntimeFailure) as failure:
        await client.call(names.boom)
    assert failure.value.message == "it failed"
    assert failure.value.details == {"argv": ["false"], "returncode": 1}
    with pytest.raises(Internal) as internal:
        await client.call(names.crash)
    assert internal.value.details == {"exception": "ValueError"}
    assert await client.call(names.echo, {"text": "still serving"}) == {"text": "still serving", "n": 0}


async def test_a_passed_fd_is_written_and_the_server_drops_its_copy(
        served: tuple[HelperServer, HelperClient], names: Names) -> None:
    _, client = served
    r, w = os.pipe()
    try:
        assert await client.call(names.fd, {"text": "through the pipe"}, fds={"out": w}) == {"written": 16}
        os.close(w)
        w = -1
        os.set_blocking(r, False)
        assert os.read(r, 100) == b"through the pipe"
        assert os.read(r, 100) == b""  # EOF: no other copy of the write end is left open
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


async def raw_exchange(path: Path, payload: bytes) -> bytes:
    """Send bytes that HelperClient would never send; everything the server answers, to EOF."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(payload)
        async with asyncio.timeout(DEADLINE):
            return await reader.read()
    finally:
        writer.close()


async def test_malformed_requests_are_closed_or_refused(served: tuple[HelperServer, HelperClient],
                                                        names: Names) -> None:
    server, client = served
    for bad in (b"not json", b'{"verb": "x", "timeout": NaN}', b"[1, 2]"):
        assert await raw_exchange(server.path, struct.pack(">I", len(bad)) + bad) == b""
    assert await raw_exchange(server.path, struct.pack(">I", (1 << 20) + 1)) == b""
    # Well-framed but wrong: answered with invalid_request.
    body = json.dumps({"verb": names.echo, "args": {"text": "x"}, "fds": ["out"]}).encode()
    reply = await raw_exchange(server.path, struct.pack(">I", len(body)) + body)
    assert json.loads(reply[4:])["error"]["code"] == "invalid_request"
    assert await client.call(names.echo, {"text": "fine"}) == {"text": "fine", "n": 0}


async def test_a_missing_socket_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match=r"nothing\.sock") as excinfo:
        await HelperClient(tmp_path / "nothing.sock").call("any.verb")
    assert excinfo.value.details["socket"] == str(tmp_path / "nothing.sock")


# -- timeouts and cancellation kill the verb's children --------------------------------------------


async def test_a_timeout_kills_the_process_group(served: tuple[HelperServer, HelperClient], names: Names,
                                                 tmp_path: Path) -> None:
    _, client = served
    pidfile = tmp_path / "pids"
    with pytest.raises(Timeout) as excinfo:
        await client.call(names.sleep, {"path": str(pidfile)}, timeout=2)
    assert excinfo.value.details == {"verb": names.sleep}
    for pid in await recorded_pids(pidfile):
        await await_exit(pid)


async def test_cancelling_the_client_kills_the_child(served: tuple[HelperServer, HelperClient], names: Names,
                                                     tmp_path: Path) -> None:
    _, client = served
    pidfile = tmp_path / "pids"
    task = asyncio.create_task(client.call(names.sleep, {"path": str(pidfile)}))
    pids = await recorded_pids(pidfile)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for pid in pids:
        await await_exit(pid)


async def test_stopping_the_server_kills_calls_in_flight(tmp_path: Path, names: Names) -> None:
    path = tmp_path / "helper.sock"
    server = await serve(ctx_for(tmp_path), path, agent_uid=0)
    pidfile = tmp_path / "pids"
    task = asyncio.create_task(HelperClient(path).call(names.sleep, {"path": str(pidfile)}))
    pids = await recorded_pids(pidfile)
    server.close()
    await server.wait_closed()
    with pytest.raises(Unavailable, match="without a reply"):
        await task
    for pid in pids:
        await await_exit(pid)
    assert not path.exists()


@pytest.mark.parametrize("client_left", [False, True], ids=["in-flight", "client-left"])
async def test_a_stop_waits_for_what_cancelled_verbs_do_on_cancellation(tmp_path: Path, names: Names,
                                                                        client_left: bool) -> None:
    """Either way a verb is cancelled -- by the stop, or earlier because its client went away -- the
    stop returns only once the verb's own cleanup has finished: cut short, it would leave a
    half-deleted runsc container behind (and the process exit would kill ``runsc delete``)."""
    path = tmp_path / "helper.sock"
    server = await serve(ctx_for(tmp_path), path, agent_uid=0)
    mark = tmp_path / "cleaned"
    task = asyncio.create_task(HelperClient(path).call(names.tidy, {"path": str(mark)}))

    async def exists(p: Path) -> bool:
        return _exists(p)

    gate = _GATES.setdefault(str(mark), asyncio.Event())
    closing = None
    try:
        await await_for(lambda: exists(tmp_path / "cleaned.started"), DEADLINE, "the verb to start")
        if client_left:
            task.cancel()
            await await_for(lambda: exists(tmp_path / "cleaned.cancelled"), DEADLINE, "the verb's cancellation")
        server.close()
        closing = asyncio.create_task(server.wait_closed())
        await await_for(lambda: exists(tmp_path / "cleaned.cancelled"), DEADLINE, "the verb's cancellation")
        # Not a wait for readiness: the stop must not end at all while the cleanup is held (the
        # old stop ended within a millisecond).
        ended, _ = await asyncio.wait({closing}, timeout=0.5)
        assert not ended, "the stop returned while the verb was still cleaning up"
        gate.set()
        await closing
        assert mark.exists()
    finally:
        gate.set()
        if closing is None:
            server.close()
            closing = asyncio.create_task(server.wait_closed())
        await closing
        _GATES.pop(str(mark), None)
    with pytest.raises((Unavailable, asyncio.CancelledError)):
        await task


async def test_connections_beyond_the_limit_wait_their_turn(tmp_path: Path, names: Names) -> None:
    path = tmp_path / "helper.sock"
    server = await serve(ctx_for(tmp_path), path, agent_uid=0, max_connections=2)
    try:
        client = HelperClient(path)
        results = await asyncio.gather(*(client.call(names.echo, {"text": "q", "n": i}) for i in range(12)))
        assert [r["n"] for r in results] == list(range(12))
    finally:
        server.close()
        await server.wait_closed()


# -- the peer check and the socket file --------------------------------------------------------------


RAW_CLIENT = """
import json, socket, struct, sys
body = json.dumps({"verb": sys.argv[2], "args": {"path": sys.argv[3]}}).encode()
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
try:
    s.sendall(struct.pack(">I", len(body)) + body)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    print("reply" if got else "eof")
except (BrokenPipeError, ConnectionResetError):
    print("eof")
"""


async def test_another_uid_is_refused_without_a_reply(open_dir: Path, names: Names) -> None:
    path = open_dir / "helper.sock"
    marker = open_dir / "ran"
    # The socket's group lets nobody connect, so that the peer check is what refuses it.
    server = await serve(ctx_for(open_dir), path, agent_uid=4242, allow_root=True, socket_gid=NOBODY)
    try:
        with capture_logs() as logs:
            proc = await asyncio.create_subprocess_exec(
                "/usr/bin/python3", "-c", RAW_CLIENT, str(path), names.mark, str(marker),
                user=NOBODY, group=NOBODY, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            async with asyncio.timeout(DEADLINE):
                out, err = await proc.communicate()
        assert (proc.returncode, out.decode().strip(), err) == (0, "eof", b"")
        refused = [e for e in logs if e["event"] == "helper.peer_refused"]
        assert [(e["uid"], e["pid"]) for e in refused] == [(NOBODY, proc.pid)]
        # Root (allow_root) is served on the same socket: the verb itself works.
        await HelperClient(path).call(names.mark, {"path": str(open_dir / "root-ran")})
        assert (open_dir / "root-ran").exists() and not marker.exists()
    finally:
        server.close()
        await server.wait_closed()


async def test_root_is_refused_without_allow_root(tmp_path: Path, names: Names) -> None:
    path = tmp_path / "helper.sock"
    server = await serve(ctx_for(tmp_path), path, agent_uid=NOBODY)
    try:
        with pytest.raises(Unavailable, match="without a reply"):
            await HelperClient(path).call(names.mark, {"path": str(tmp_path / "ran")})
        assert not (tmp_path / "ran").exists()
    finally:
        server.close()
        await server.wait_closed()


async def test_the_socket_is_0660_and_replaces_a_stale_one(tmp_path: Path, names: Names) -> None:
    path = tmp_path / "helper.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays behind, as after a crash
    server = await serve(ctx_for(tmp_path), path, agent_uid=0, socket_gid=NOBODY)
    try:
        st = path.stat()
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert (st.st_uid, st.st_gid) == (0, NOBODY)
        assert await HelperClient(path).call(names.echo, {"text": "new"}) == {"text": "new", "n": 0}
    finally:
        server.close()
        await server.wait_closed()
    path.write_text("not a socket")
    with pytest.raises(InvalidRequest, match="not a socket"):
        await serve(ctx_for(tmp_path), path, agent_uid=0)


# -- the helper process ------------------------------------------------------------------------------


async def test_the_helper_process_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    path = tmp_path / "helper.sock"
    (tmp_path / "data").mkdir()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "space.node.helper", "--data-dir", str(tmp_path / "data"),
        "--cache-dir", str(tmp_path / "cache"), "--socket", str(path), "--agent-uid", str(NOBODY),
        "--allow-root", cwd=REPO, stderr=asyncio.subprocess.PIPE)
    try:
        async def listening() -> bool:
            assert proc.returncode is None, "the helper exited"
            return path.exists()
        await await_for(listening, DEADLINE, "the helper's socket")
        client = HelperClient(path)
        # A real read-only verb: on a fresh data dir the node's network is not set up yet.
        with pytest.raises(Conflict, match="not set up"):
            await client.call("net.describe")
        with pytest.raises(InvalidRequest, match="unknown privileged verb"):
            await client.call("no.such.verb")
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(DEADLINE):
            _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert b"helper.stopped" in err and not path.exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_helper_process_stops_when_its_stop_pipe_closes(tmp_path: Path) -> None:
    """The unprivileged agent cannot signal its root helper: closing its end of the stop pipe is
    how it stops it (and what happens when the agent dies). A SIGTERM before that -- sent to the
    agent's whole group by Ctrl-C, or by a container runtime stopping a container in the host's PID
    namespace -- is not its stop: the agent still needs it to stop in order."""
    path = tmp_path / "helper.sock"
    (tmp_path / "data").mkdir()
    stop_r, stop_w = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "space.node.helper", "--data-dir", str(tmp_path / "data"),
            "--cache-dir", str(tmp_path / "cache"), "--socket", str(path), "--agent-uid", str(NOBODY),
            "--allow-root", "--stop-fd", str(stop_r), cwd=REPO, stderr=asyncio.subprocess.PIPE,
            pass_fds=(stop_r,))
    finally:
        os.close(stop_r)
    try:
        async def listening() -> bool:
            assert proc.returncode is None, "the helper exited"
            return path.exists()
        await await_for(listening, DEADLINE, "the helper's socket")
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        # Still serving after both signals were handled: a call answers.
        assert await HelperClient(path).call("helper.ping") is not None
        assert proc.returncode is None
        os.close(stop_w)
        stop_w = -1
        async with asyncio.timeout(DEADLINE):
            _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert b"helper.stopped" in err and not path.exists()
        assert err.count(b"helper.signal_ignored") == 2, err.decode()
    finally:
        if stop_w >= 0:
            os.close(stop_w)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_helper_imports_nothing_heavy() -> None:
    code = ("import sys, space.node.helper.__main__ as m; m.verbs.load_all(); "
            "print(sorted(n for n in ('fastapi', 'sqlalchemy', 'httpx', 'pydantic') if n in sys.modules))")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, cwd=REPO,
                                                stdout=asyncio.subprocess.PIPE)
    async with asyncio.timeout(DEADLINE):
        out, _ = await proc.communicate()
    assert (proc.returncode, out.strip()) == (0, b"[]")
