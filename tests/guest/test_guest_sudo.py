"""sudo through the guest daemon (space/guest/guest_sudo.py and the ``sudo`` client beside it), on
the host: the service runs in a process of its own (its reaper waits on every child of its
process, which must not be pytest's), the real client script talks to it over a Unix socket.

What must hold: a member of group sudo (root here) runs commands as root or ``-u`` another user
with its own stdin, stdout, stderr and working directory and sudo's reset environment; the exit
status, a signal the client gets and the client's death reach the command; a caller outside the
group is refused before anything runs; hostile requests (too many descriptors, garbage, a request
that never ends, too many sessions) are refused and free their session. The same inside a real
sandbox: tests/e2e/test_sudo.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.waiting import wait_for

CLIENT = Path(__file__).resolve().parents[2] / "space" / "guest" / "sudo"
#: The client runs on the system's python3, as in a sandbox (and every user can run it).
CLIENT_PYTHON = "/usr/bin/python3"
SERVICE = """
import sys, threading
from space.guest import daemon, guest_sudo
from space.guest.guest_procs import ProcessTable
daemon.reset_inherited_signals()  # as the daemon starts: a runner's nohup must not reach the commands
guest_sudo.MAX_SESSIONS = int(sys.argv[2])
table = ProcessTable()
table.ensure_threads()
guest_sudo.SudoService(table, path=sys.argv[1]).start()
threading.Event().wait()
"""

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="runs commands as other users (needs root)")


class Sudo:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, *args: str, env: dict[str, str] | None = None, cwd: str | None = None,
                 user: int | None = None, stdin: str | None = None,
                 timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CLIENT_PYTHON, "-IS", str(CLIENT), *args], input=stdin, capture_output=True,
                              text=True, timeout=timeout, cwd=cwd, user=user,
                              env={"PATH": "/usr/bin:/bin", "SPACE_SUDO_SOCKET": str(self.path), **(env or {})})

    def popen(self, *args: str, user: int | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen([CLIENT_PYTHON, "-IS", str(CLIENT), *args], stdout=subprocess.PIPE, text=True,
                                user=user, env={"PATH": "/usr/bin:/bin", "SPACE_SUDO_SOCKET": str(self.path)})


def start_service(path: Path, sessions: int = 64) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", SERVICE, str(path), str(sessions)],
                            cwd=Path(__file__).resolve().parents[2])
    wait_for(path.exists, timeout=20, what="the sudo socket")
    return proc


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A directory every user may reach (pytest's own are root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="space-sudo-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sudo(sock_dir: Path) -> Iterator[Sudo]:
    path = sock_dir / "sudo.sock"
    proc = start_service(path)
    try:
        yield Sudo(path)
    finally:
        proc.kill()
        proc.wait()


def pid_in(path: Path) -> int:
    wait_for(lambda: path.exists() and path.read_text().strip().isdigit(), timeout=20, what=f"{path.name}")
    return int(path.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"


def end(pid: int) -> None:
    """Whatever a test left running (by its pid)."""
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


def test_runs_as_root_with_the_callers_streams_and_directory(sudo: Sudo, tmp_path: Path) -> None:
    r = sudo("id", "-u")
    assert (r.returncode, r.stdout, r.stderr) == (0, "0\n", "")
    assert sudo("-u", "nobody", "id", "-un").stdout == "nobody\n"
    assert sudo("--user=nobody", "id", "-un").stdout == "nobody\n"
    assert sudo("cat", stdin="from the caller's stdin\n").stdout == "from the caller's stdin\n"
    assert sudo("pwd", cwd=str(tmp_path)).stdout == f"{tmp_path}\n"
    r = sudo("sh", "-c", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")


def test_the_environment_is_reset_unless_kept(sudo: Sudo) -> None:
    show = 'echo "${FOO:-unset} $HOME $USER $SUDO_USER $PATH"'
    secure = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert sudo("sh", "-c", show, env={"FOO": "bar"}).stdout == f"unset /root root root {secure}\n"
    assert sudo("-E", "sh", "-c", 'echo "$FOO"', env={"FOO": "bar"}).stdout == "bar\n"
    assert sudo("FOO=given", "sh", "-c", 'echo "$FOO"', env={"FOO": "bar"}).stdout == "given\n"
    assert sudo("-i", "pwd").stdout == "/root\n"  # a login shell starts in the target's home


def test_refusals_and_options(sudo: Sudo, tmp_path: Path) -> None:
    r = sudo("no-such-program")
    assert (r.returncode, r.stderr) == (1, "sudo: no-such-program: command not found\n")
    r = sudo("-u", "no-such-user", "id")
    assert r.returncode == 1 and "unknown user 'no-such-user'" in r.stderr
    r = sudo("-Z", "id")
    assert r.returncode == 1 and "invalid option -- 'Z'" in r.stderr
    r = sudo()
    assert r.returncode == 1 and "usage: sudo" in r.stderr
    assert sudo("-k").returncode == 0 and sudo("-nv").returncode == 0
    assert "NOPASSWD: ALL" in sudo("-l").stdout


def test_a_caller_outside_group_sudo_is_refused_before_anything_runs(sudo: Sudo, sock_dir: Path) -> None:
    marker = sock_dir / "ran"
    r = sudo("touch", str(marker), user=65534)
    assert r.returncode == 1
    assert "nobody is not in the sudoers file" in r.stderr
    assert not marker.exists()


def test_signals_reach_the_command_and_a_dead_client_hangs_it_up(sudo: Sudo, sock_dir: Path) -> None:
    pidfile = sock_dir / "sleep.pid"
    client = sudo.popen("sh", "-c", f"echo $$ > {pidfile}; exec sleep 60")
    pid = pid_in(pidfile)
    try:
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=20) == -signal.SIGTERM  # sudo dies of the command's signal
        wait_for(lambda: not alive(pid), timeout=20, what="the sudo'd sleep to end")
    finally:
        end(pid)

    hung, pidfile = sock_dir / "hung-up", sock_dir / "sh.pid"
    # The pid is written once the trap is set: the client is killed as soon as it appears.
    client = sudo.popen("sh", "-c", f"trap 'echo hup > {hung}; exit 0' HUP; echo $$ > {pidfile}; "
                                    "sleep 61 & wait")
    pid = pid_in(pidfile)
    try:
        client.kill()  # SIGKILL: the client cannot forward anything; its connection closes
        client.wait()
        wait_for(hung.exists, timeout=20, what="the command's SIGHUP")
    finally:
        end(pid)


def _raw(path: Path, payload: bytes, fds: list[int]) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(path))
        s.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, sys.byteorder)
                                                                            for fd in fds))] if fds else [])
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return data.decode()


def test_hostile_requests_are_refused(sudo: Sudo) -> None:
    req = json.dumps({"argv": ["id"], "env": {}}).encode() + b"\n"
    r, w = os.pipe()
    try:
        assert "carries stdin, stdout, stderr" in _raw(sudo.path, req, [r, w, w, w, w])  # five
        assert "carries stdin, stdout, stderr" in _raw(sudo.path, req, [])
        assert "not JSON" in _raw(sudo.path, b"{nope\n", [r, w, w, r])
        assert "argv must be" in _raw(sudo.path, b'{"argv": []}\n', [r, w, w, r])
        assert "env and set must" in _raw(sudo.path, b'{"argv": ["id"], "env": {"A=B": "c"}}\n', [r, w, w, r])
        assert _raw(sudo.path, b"x" * (2 << 20), [r, w, w, r]) == ""  # too large: dropped
    finally:
        os.close(r)
        os.close(w)
    assert sudo("true").returncode == 0  # the service still serves


def test_sessions_are_bounded_and_freed(sock_dir: Path) -> None:
    path = sock_dir / "sudo.sock"
    service = start_service(path, sessions=2)
    pids: list[int] = []
    try:
        sudo = Sudo(path)
        held = [sudo.popen("sh", "-c", f"echo $$ > {sock_dir}/{i}.pid; exec sleep 62") for i in range(2)]
        pids = [pid_in(sock_dir / f"{i}.pid") for i in range(2)]
        r = sudo("true")
        assert r.returncode == 1 and "too many sudo sessions in this sandbox (2)" in r.stderr
        for c in held:
            c.send_signal(signal.SIGINT)
            c.wait(timeout=20)
        deadline = time.monotonic() + 20
        while sudo("true").returncode != 0:  # the slots come back as the sessions end
            assert time.monotonic() < deadline
    finally:
        for pid in pids:
            end(pid)
        service.kill()
        service.wait()
