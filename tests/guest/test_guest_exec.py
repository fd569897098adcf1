"""Processes through daemon.py + shim + GuestConnection (the daemon runs on the host)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from typing import Any

import pytest

from space import errors
from space.node.sandboxes.guest_client import GuestConnection
from tests.guest.guest_harness import HostGuest, connected

_ids = itertools.count(1)


def cid() -> str:
    return f"c{next(_ids)}"


async def run(conn: GuestConnection, **args: Any) -> tuple[list[dict[str, Any]], bytes, bytes]:
    """Exec a command and collect all of its events; returns (headers, stdout, stderr)."""
    c = args.pop("cmd", None) or cid()
    await conn.request("exec", cmd=c, **args)
    return await collect(conn, c)


async def collect(conn: GuestConnection, c: str, after: int = 0
                  ) -> tuple[list[dict[str, Any]], bytes, bytes]:
    headers: list[dict[str, Any]] = []
    out = {1: bytearray(), 2: bytearray()}
    async with asyncio.timeout(30):
        async for ev, payload in conn.events(c, after):
            headers.append(ev)
            if ev["kind"] == "out":
                out[ev["fd"]] += payload
    return headers, bytes(out[1]), bytes(out[2])


async def test_hello_and_activity(conn: GuestConnection) -> None:
    assert conn.hello["version"] == 1
    assert conn.hello["boot_ms"] > 0
    act = await conn.request("activity")
    assert act["running"] == 0
    assert act["last_activity"] >= conn.hello["last_activity"]


async def test_exec_argv_exit_code_and_seq(conn: GuestConnection) -> None:
    evs, out, err = await run(conn, argv=["sh", "-c", "printf hello; exit 7"])
    assert out == b"hello" and err == b""
    assert evs[-1]["kind"] == "exit" and evs[-1]["exit_code"] == 7 and evs[-1]["signal"] is None
    assert [e["seq"] for e in evs] == list(range(1, len(evs) + 1))


async def test_exec_shell_stdout_stderr_separated_in_order(conn: GuestConnection) -> None:
    script = "for i in 1 2 3 4 5; do echo out$i; echo err$i >&2; done"
    _, out, err = await run(conn, shell=script)
    assert out == b"".join(b"out%d\n" % i for i in range(1, 6))
    assert err == b"".join(b"err%d\n" % i for i in range(1, 6))


async def test_stdin_and_eof(conn: GuestConnection) -> None:
    c = cid()
    await conn.request("exec", cmd=c, argv=["tr", "a-z", "A-Z"], stdin=True)
    await conn.request("stdin", b"hello ", cmd=c)
    await conn.request("stdin", b"world", cmd=c, eof=True)
    evs, out, _ = await collect(conn, c)
    assert out == b"HELLO WORLD" and evs[-1]["exit_code"] == 0
    with pytest.raises(errors.InvalidState):
        await conn.request("stdin", b"more", cmd=c)


async def test_stdin_closed_by_default(conn: GuestConnection) -> None:
    c = cid()
    _, out, _ = await run(conn, cmd=c, argv=["cat"])
    assert out == b""
    with pytest.raises(errors.InvalidState):
        await conn.request("stdin", b"x", cmd=c)


async def test_signal_by_name_and_number(conn: GuestConnection) -> None:
    for sig in ("TERM", "SIGINT", 9):
        c = cid()
        await conn.request("exec", cmd=c, argv=["sleep", "60"])
        await conn.request("signal", cmd=c, signal=sig)
        evs, _, _ = await collect(conn, c)
        expected = {"TERM": 15, "SIGINT": 2, 9: 9}[sig]
        assert evs[-1]["signal"] == expected and evs[-1]["exit_code"] == 128 + expected
    with pytest.raises(errors.InvalidRequest):
        await conn.request("signal", cmd=c, signal="NOPE")
    with pytest.raises(errors.InvalidState):
        await conn.request("signal", cmd=c, signal="TERM")


async def test_commands_get_default_signals_whatever_the_daemon_inherited() -> None:
    """The cause of test_signal_by_name_and_number's one timeout: started from a parent that ignores
    SIGINT (``make test &`` in a non-interactive shell ignores SIGINT and SIGQUIT, as do nohup and
    many CI runners), the daemon handed that to every command, so ``sleep 60`` shrugged off
    SIGINT and the test waited out its 30 s. Commands start with every signal at its default
    and none blocked, however the daemon itself was started."""
    g = HostGuest(ignored=(signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1),
                  blocked=(signal.SIGTERM, signal.SIGUSR2)).start()
    try:
        async with connected(g.socket, timeout=15) as c:
            _, out, _ = await run(c, argv=["grep", "-E", "^Sig(Ign|Blk):", "/proc/self/status"])
            masks = dict(line.split(":\t") for line in out.decode().splitlines())
            assert masks == {"SigIgn": "0000000000000000", "SigBlk": "0000000000000000"}, masks
            for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM):
                c_id = cid()
                await c.request("exec", cmd=c_id, argv=["sleep", "60"])
                await c.request("signal", cmd=c_id, signal=int(sig))
                evs, _, _ = await collect(c, c_id)
                assert evs[-1]["signal"] == sig, (sig, evs[-1])
            assert g.daemon is not None
            for sig in (signal.SIGINT, signal.SIGHUP):  # the daemon itself still ignores them
                os.kill(g.daemon.pid, sig)
            assert (await c.request("hello"))["version"] == 1
    finally:
        g.stop()


async def test_pty_output_and_resize(conn: GuestConnection) -> None:
    c = cid()
    await conn.request("exec", cmd=c, shell="stty size; read x; stty size; tty; echo $TERM",
                       pty={"rows": 30, "cols": 100})
    seen = bytearray()
    async with asyncio.timeout(30):
        async with contextlib.aclosing(conn.events(c)) as events:
            async for ev, payload in events:
                assert ev.get("fd", 1) == 1
                seen += payload
                if b"30 100" in seen:
                    break
    await conn.request("resize", cmd=c, rows=40, cols=120)
    await conn.request("stdin", b"go\n", cmd=c)
    evs, out, err = await collect(conn, c)
    assert err == b""
    assert b"40 120" in out and b"/dev/pts/" in out and b"xterm-256color" in out
    assert evs[-1]["exit_code"] == 0


async def test_resize_without_pty_is_invalid(conn: GuestConnection) -> None:
    c = cid()
    await run(conn, cmd=c, argv=["true"])
    with pytest.raises(errors.InvalidRequest):
        await conn.request("resize", cmd=c, rows=1, cols=1)


async def test_cwd_env_and_defaults(conn: GuestConnection, tmp_path: Any) -> None:
    _, out, _ = await run(conn, shell="pwd; echo $FOO; echo $LANG; echo $HOME",
                          cwd=str(tmp_path), env={"FOO": "bar"})
    assert out.decode().split("\n")[:4] == [str(tmp_path), "bar", "C.UTF-8", "/root"]
    _, out, _ = await run(conn, argv=["pwd"])
    assert out.strip() == b"/root"


async def test_user(conn: GuestConnection) -> None:
    if os.geteuid() != 0:
        pytest.skip("switching users needs root")
    _, out, _ = await run(conn, shell="id -un; echo $USER $LOGNAME", user="nobody")
    assert out.decode().split() == ["nobody", "nobody", "nobody"]
    with pytest.raises(errors.InvalidRequest):
        await conn.request("exec", cmd=cid(), argv=["true"], user="no-such-user-xyz")


async def test_bad_binary_and_cwd(conn: GuestConnection) -> None:
    with pytest.raises(errors.NotFound, match="executable"):
        await conn.request("exec", cmd=cid(), argv=["/no/such/binary"])
    with pytest.raises(errors.NotFound, match="working directory"):
        await conn.request("exec", cmd=cid(), argv=["true"], cwd="/no/such/dir")
    with pytest.raises(errors.InvalidRequest):
        await conn.request("exec", cmd=cid())
    c = cid()
    await run(conn, cmd=c, argv=["true"])
    with pytest.raises(errors.Conflict):
        await conn.request("exec", cmd=c, argv=["true"])
    assert (await conn.request("hello"))["version"] == 1  # still alive


async def test_timeout_kills_process_group(conn: GuestConnection) -> None:
    # exec's `timeout` is spelled kill_after here: request()'s own timeout is the answer deadline.
    # A plain sh, not `shell=` (bash -l): on the host that runs root's login profile, and a kill in
    # the middle of it can leave the machine's state half-written (pyenv's rehash lock, left behind,
    # made every later login shell on the machine wait 60 s).
    evs, _, _ = await run(conn, argv=["sh", "-c", "sleep 60 & sleep 60; wait"], kill_after=0.3)
    assert evs[-1]["signal"] == 9 and evs[-1]["timed_out"] is True


async def test_list_and_forget(conn: GuestConnection) -> None:
    c = cid()
    await conn.request("exec", cmd=c, argv=["sleep", "60"])
    listed = {x["id"]: x for x in (await conn.request("list"))["commands"]}
    assert listed[c]["state"] == "running" and listed[c]["argv"] == ["sleep", "60"]
    assert (await conn.request("activity"))["running"] == 1
    with pytest.raises(errors.InvalidState):
        await conn.request("forget", cmd=c)
    await conn.request("signal", cmd=c, signal="KILL")
    await collect(conn, c)
    listed = {x["id"]: x for x in (await conn.request("list"))["commands"]}
    assert listed[c]["state"] == "exited" and listed[c]["signal"] == 9
    await conn.request("forget", cmd=c)
    assert c not in {x["id"] for x in (await conn.request("list"))["commands"]}
    with pytest.raises(errors.NotFound):
        await conn.request("replay", cmd=c)


async def test_unknown_op(conn: GuestConnection) -> None:
    with pytest.raises(errors.InvalidRequest, match="unknown op"):
        await conn.request("no.such.op")


async def test_concurrent_requests(conn: GuestConnection) -> None:
    results = await asyncio.gather(*(run(conn, argv=["echo", str(i)]) for i in range(10)))
    assert [r[1] for r in results] == [b"%d\n" % i for i in range(10)]


async def test_orphans_are_reaped_and_exit_waits_for_output(conn: GuestConnection) -> None:
    # The shell exits at once; its background child keeps the pipe open and writes later.
    evs, out, _ = await run(conn, shell="(sleep 0.2; echo late) & echo early")
    assert out == b"early\nlate\n" and evs[-1]["kind"] == "exit"
