"""The official E2B SDK's commands against SPACE: run, stream, background, connect, kill, stdin, PTY.

Mirrors E2B's own ``packages/python-sdk/tests/{sync,async}/sandbox_*/commands`` and ``pty``.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e import e2b_env
from tests.e2e.harness import runtime_available
from tests.waiting import await_for, wait_for

pytestmark = [pytest.mark.runtime, pytest.mark.skipif(runtime_available() is not None,
                                                      reason=str(runtime_available()))]

e2b = pytest.importorskip("e2b")


@pytest.fixture
def sbx(made: e2b_env.Sandboxes) -> e2b.Sandbox:
    s = e2b.Sandbox.create(metadata={"test": "commands"})
    made.add(s.sandbox_id)
    return s


def test_run_returns_output_and_exit_code(sbx: e2b.Sandbox) -> None:
    r = sbx.commands.run("echo hello; echo oops >&2")
    assert r.exit_code == 0
    assert r.stdout == "hello\n"
    assert r.stderr == "oops\n"


def test_python_is_there_as_agent_code_calls_it(sbx: e2b.Sandbox) -> None:
    """E2B's base has ``python`` as well as ``python3``: agent code runs ``python x.py``."""
    r = sbx.commands.run("python -c 'import sys; print(sys.version_info[0])'")
    assert (r.exit_code, r.stdout) == (0, "3\n")


def test_sudo_as_on_e2b_through_the_guest_daemon(sbx: e2b.Sandbox) -> None:
    """E2B's base lets its user ``sudo`` without a password; setuid binaries do not work in gVisor,
    so SPACE's ``sudo`` asks the guest daemon (space/guest/guest_sudo.py), which checks who asks."""
    r = sbx.commands.run("sudo whoami; sudo -u nobody id -un; sudo sh -c 'echo $HOME $SUDO_USER'; whoami")
    assert r.stdout == "root\nnobody\n/root user\nuser\n"
    # E2B's test_bash_command_scoped_env_vars: the command's env stays with it.
    assert sbx.commands.run("echo $FOO", envs={"FOO": "bar"}).stdout == "bar\n"
    r = sbx.commands.run('sudo echo "$FOO"')
    assert (r.exit_code, r.stdout) == (0, "\n")
    with pytest.raises(e2b.CommandExitException) as info:
        sbx.commands.run("cd /tmp && echo piped | sudo tee /root/from-user >/dev/null && sudo cat /root/from-user "
                         "&& sudo pwd && sudo sh -c 'exit 9'")
    assert (info.value.exit_code, info.value.stdout) == (9, "piped\n/tmp\n")
    # Only the template's user (group sudo) and root: another user is refused, and nothing runs.
    sbx.commands.run("useradd -m bob", user="root")
    with pytest.raises(e2b.CommandExitException) as info:
        sbx.commands.run("sudo touch /root/by-bob", user="bob")
    assert info.value.exit_code == 1 and "bob is not in the sudoers file" in info.value.stderr
    assert not sbx.files.exists("/root/by-bob")
    # A paused and resumed sandbox (a restored daemon) still answers.
    sbx.pause()
    sbx.connect()
    assert sbx.commands.run("sudo id -u").stdout == "0\n"


def test_run_special_characters_multiline_and_broken_utf8(sbx: e2b.Sandbox) -> None:
    assert sbx.commands.run('echo "!@#$%^&*()_+"').stdout == "!@#$%^&*()_+\n"
    assert sbx.commands.run('echo "Hello,\nWorld!"').stdout == "Hello,\nWorld!\n"
    long_str = "a" * 8191 + "\\xe2"
    r = sbx.commands.run(f'printf "{long_str}"')
    assert r.stdout == "a" * 8191 + "\ufffd"


def test_nonzero_exit_raises_command_exit(sbx: e2b.Sandbox) -> None:
    with pytest.raises(e2b.CommandExitException) as info:
        sbx.commands.run("echo out; echo err >&2; exit 3")
    assert info.value.exit_code == 3
    assert info.value.stdout == "out\n"
    assert info.value.stderr == "err\n"
    assert "exit status 3" in (info.value.error or "")


def test_envs_cwd_and_user(sbx: e2b.Sandbox) -> None:
    assert sbx.commands.run("echo $FOO", envs={"FOO": "bar"}).stdout.strip() == "bar"
    # Per-command variables do not leak into later commands.
    assert sbx.commands.run("echo ${FOO:-unset}").stdout.strip() == "unset"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout.strip() == "/tmp"
    assert sbx.commands.run("whoami").stdout.strip() == "user"
    assert sbx.commands.run("pwd").stdout.strip() == "/home/user"
    assert sbx.commands.run("whoami", user="root").stdout.strip() == "root"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_sandbox_env_vars_reach_every_command(made: e2b_env.Sandboxes, api: httpx.Client, warm: bool) -> None:
    if warm:  # a sandbox booted before its env was known, claimed with it
        assert api.put("/v1/pools/base", json={"size": 1, "memory_mb": 512}).status_code == 200

        def ready() -> bool:
            pools = api.get("/v1/pools").json()["pools"]
            return any(p["template"] == "base" and p["memory_mb"] == 512 and p["ready"] >= 1 for p in pools)

        wait_for(ready, timeout=120, what="a warm sandbox")
    try:
        s = e2b.Sandbox.create(envs={"FOO": "sandbox-wide"})
    finally:
        if warm:
            api.put("/v1/pools/base", json={"size": 0, "memory_mb": 512})
    made.add(s.sandbox_id)
    assert s.commands.run("echo $FOO").stdout.strip() == "sandbox-wide"
    assert s.commands.run("echo $FOO", envs={"FOO": "mine"}).stdout.strip() == "mine"
    # Also where services the template started before the sandbox had an env can read it.
    assert json.loads(s.files.read("/run/space/env.json")) == {"FOO": "sandbox-wide"}


def test_timeout_is_enforced_by_the_server(sbx: e2b.Sandbox) -> None:
    assert sbx.commands.run('echo "Hello"', timeout=10).exit_code == 0
    with pytest.raises(e2b.TimeoutException):
        sbx.commands.run("sleep 30", timeout=2)
    handle = sbx.commands.run("sleep 30", timeout=2, background=True)
    with pytest.raises(e2b.TimeoutException):
        for _ in handle:
            pass
    # The process itself was killed, not just the client's wait.
    assert str(handle.pid) not in sbx.commands.run("ps -eo pid").stdout.split()


def test_streaming_callbacks_and_background(sbx: e2b.Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    r = sbx.commands.run("for i in 1 2 3; do echo line$i; echo e$i >&2; done", on_stdout=out.append,
                         on_stderr=err.append)
    assert "".join(out) == "line1\nline2\nline3\n" == r.stdout
    assert "".join(err) == "e1\ne2\ne3\n"
    handle = sbx.commands.run("echo started; sleep 30; echo done", background=True)
    seen = []
    for stdout, _, _ in handle:
        if stdout:
            seen.append(stdout)
            break
    assert seen == ["started\n"]
    handle.kill()


def test_disconnect_keeps_the_process_and_connect_gets_new_output(sbx: e2b.Sandbox) -> None:
    handle = sbx.commands.run("sleep 2; echo after-connect", background=True, timeout=0)
    handle.disconnect()
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    again = sbx.commands.connect(handle.pid)
    assert again.pid == handle.pid
    result = again.wait()
    assert result.exit_code == 0
    assert result.stdout == "after-connect\n"


def test_list_shows_running_commands_only(sbx: e2b.Sandbox) -> None:
    handle = sbx.commands.run("sleep 30", background=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert handle.pid in listed
    assert listed[handle.pid].cmd == "/bin/bash"
    assert listed[handle.pid].args[-1] == "sleep 30"
    handle.kill()
    assert handle.pid not in [p.pid for p in sbx.commands.list()]


def test_kill(sbx: e2b.Sandbox) -> None:
    handle = sbx.commands.run("sleep 30", background=True)
    assert sbx.commands.kill(handle.pid) is True
    with pytest.raises(e2b.CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1
    assert "signal: killed" in (info.value.error or "")
    with pytest.raises(e2b.CommandExitException):
        sbx.commands.run(f"kill -0 {handle.pid}")
    assert sbx.commands.kill(999999) is False


def test_send_stdin_and_close_it(sbx: e2b.Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "Hello,\nWorld! !@#$%^&*()_+")
    for stdout, _, _ in handle:
        assert stdout == "Hello,\nWorld! !@#$%^&*()_+"
        break
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().exit_code == 0


def test_sandbox_killed_during_run(sbx: e2b.Sandbox) -> None:
    handle = sbx.commands.run("sleep 60", background=True)
    sbx.kill()
    with pytest.raises(e2b.SandboxException) as info:
        handle.wait()
    assert "sandbox was killed or reached its end of life" in str(info.value)
    assert sbx.is_running() is False


def test_pty_create_input_resize_connect_kill(sbx: e2b.Sandbox) -> None:
    from e2b.sandbox.commands.command_handle import PtySize

    term = sbx.pty.create(PtySize(cols=80, rows=24), envs={"ABC": "123"}, cwd="/")
    sbx.pty.send_stdin(term.pid, b"echo $ABC; pwd; tput cols\nexit\n")
    chunks: list[bytes] = []
    assert term.wait(on_pty=chunks.append).exit_code == 0
    text = b"".join(chunks).decode()
    assert "123" in text
    assert "80" in text

    term = sbx.pty.create(PtySize(cols=80, rows=24), envs={"FOO": "bar"})
    sbx.pty.resize(term.pid, PtySize(cols=100, rows=24))
    term.disconnect()
    again = sbx.pty.connect(term.pid)
    sbx.pty.send_stdin(term.pid, b"echo $FOO; tput cols\nexit\n")
    chunks = []
    assert again.wait(on_pty=chunks.append).exit_code == 0
    text = b"".join(chunks).decode()
    assert "bar" in text and "100" in text

    term = sbx.pty.create(PtySize(cols=80, rows=24))
    assert sbx.pty.kill(term.pid) is True
    with pytest.raises(e2b.CommandExitException):
        term.wait()


# -- async --------------------------------------------------------------------------------------


async def test_async_commands(made: e2b_env.Sandboxes) -> None:
    s = await e2b.AsyncSandbox.create()
    made.add(s.sandbox_id)
    r = await s.commands.run("echo hi; echo $X", envs={"X": "y"})
    assert r.stdout == "hi\ny\n"
    with pytest.raises(e2b.CommandExitException):
        await s.commands.run("exit 2")
    with pytest.raises(e2b.TimeoutException):
        await s.commands.run("sleep 30", timeout=2)
    got: list[str] = []
    handle = await s.commands.run("cat", background=True, stdin=True, on_stdout=got.append)
    await s.commands.send_stdin(handle.pid, "ping")
    async def echoed() -> bool:
        return "".join(got) == "ping"

    await await_for(echoed, timeout=30, what="the echoed stdin")
    assert handle.pid in [p.pid for p in await s.commands.list()]
    assert await s.commands.kill(handle.pid) is True
    with pytest.raises(e2b.CommandExitException):
        await handle.wait()
    assert await s.commands.kill(999999) is False
