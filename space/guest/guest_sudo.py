"""sudo inside a sandbox: the guest daemon runs a command as another user for a process allowed to ask.

gVisor does not honour setuid binaries (an exec never changes the effective uid: google/gvisor#5299;
measured here, a setuid-root ``id`` run as ``user`` still reports uid 1000), so Debian's sudo cannot
work in a sandbox. The ``sudo`` beside this file (``/usr/bin/sudo`` in the base template) asks this
daemon instead, over a Unix socket only processes inside the sandbox can reach:

- **Who may**: the caller's uid comes from the kernel, never from the request: root, and members of
  group ``sudo`` (Debian's ``%sudo ALL=(ALL:ALL) ALL``), without a password, as E2B's base template
  gives its user. The kernel's word is ``SCM_CREDENTIALS`` on every piece of the request (the
  socket has ``SO_PASSCRED``: the sender's own uid is attached, and one it names that is not its own
  is refused with EPERM unless it is root), not ``SO_PEERCRED``: gVisor answers that with the
  *asker's* credentials (measured: the daemon read uid 0 for a client running as ``nobody``).
  Anyone else is refused before the request is parsed; the descriptors they sent are closed.
- **What runs**: the request's argv as the target user (root unless ``-u``), with the caller's own
  stdin, stdout, stderr and working directory (passed as descriptors: the command reads and writes
  exactly what the caller could hand it) and sudo's reset environment (``env_reset``: PATH is the
  secure path, HOME/USER/LOGNAME the target's, TERM and LANG kept, ``SUDO_*`` added; ``-E`` keeps the
  caller's). Never the daemon's CAP_SYS_RESOURCE (:func:`guest_users.spawn_argv`).
- **Bounds**: a request is at most 1 MiB and 4 descriptors and must arrive within 10 s; at most 64
  sessions run at once (a sudo'd command holds its session until it exits); signals the client
  forwards are a fixed set, sent to the command's process group; a client that goes away hangs the
  command up (SIGHUP), as a closed terminal would.

The reaper (``ProcessTable.reap_forever``) reaps these children too and hands their status back
through ``ProcessTable.watch_pid``: nothing else waits on them.

Standard library only, like all of the guest.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import threading

if __package__:
    from .guest_base import GuestError, close_fd, log
    from .guest_users import DEFAULT_PATH, resolve_user, spawn_argv
else:  # top-level inside the sandbox: daemon.py put this directory on sys.path
    from guest_base import GuestError, close_fd, log  # type: ignore[no-redef, import-not-found]
    from guest_users import DEFAULT_PATH, resolve_user, spawn_argv  # type: ignore[no-redef, import-not-found]

TYPE_CHECKING = False  # type checkers read it as true; importing typing costs boot time (see daemon.py)
if TYPE_CHECKING:
    from typing import Any

    from .guest_procs import ProcessTable

#: On the sandbox's own /dev (a tmpfs): gone with the sandbox's kernel, never in its disk.
SOCKET_PATH = "/dev/space-sudo.sock"
SUDO_GROUP = "sudo"
MAX_REQUEST = 1 << 20
MAX_SESSIONS = 64
REQUEST_SECONDS = 10.0
#: The signals a client forwards (what sudo relays to its command).
FORWARDED = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                       signal.SIGUSR2, signal.SIGWINCH})
#: What env_reset keeps of the caller's environment.
KEPT_ENV = ("TERM", "LANG", "LANGUAGE", "LC_ALL", "COLORTERM", "DISPLAY", "TZ")
_FD_BYTES = struct.calcsize("i")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def may_sudo(uid: int) -> tuple[bool, str]:
    """Whether ``uid`` may run commands as any user, and its name (read afresh: root may change the
    group, and no one else can)."""
    import grp
    import pwd

    if uid == 0:
        return True, "root"
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return False, f"#{uid}"
    try:
        group = grp.getgrnam(SUDO_GROUP)
    except KeyError:
        return False, pw.pw_name
    return pw.pw_gid == group.gr_gid or pw.pw_name in group.gr_mem, pw.pw_name


class Request:
    """What a client asks: ``argv`` as ``user``; the caller's ``env`` (kept whole with ``-E``,
    ``keep_env``), ``VAR=value`` assignments (``set``: always applied), ``login`` (``-i``: the
    target's home as working directory)."""

    def __init__(self, argv: list[str], user: str, env: dict[str, str], keep_env: bool, assign: dict[str, str],
                 login: bool) -> None:
        self.argv, self.user, self.env, self.keep_env, self.assign, self.login = \
            argv, user, env, keep_env, assign, login


def parse_request(raw: bytes) -> Request:
    try:
        req = json.loads(raw)
    except ValueError:
        raise GuestError("invalid_request", "the request is not JSON") from None
    if not isinstance(req, dict):
        raise GuestError("invalid_request", "the request is not an object")
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or len(argv) > 65536 or \
            not all(isinstance(a, str) and "\x00" not in a for a in argv):
        raise GuestError("invalid_request", "argv must be a non-empty list of strings")
    user = req.get("user", "root")
    if not isinstance(user, str) or not user or len(user) > 256:
        raise GuestError("invalid_request", "user must be a name or a uid")
    env, assign = req.get("env", {}), req.get("set", {})
    for what in (env, assign):
        if not isinstance(what, dict) or len(what) > 4096 or not all(
                isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\x00" not in k + v
                for k, v in what.items()):
            raise GuestError("invalid_request", "env and set must map names to strings")
    return Request(argv, user, env, req.get("keep_env") is True, assign, req.get("login") is True)


def command_env(req: Request, target: Any, caller: str, caller_uid: int, caller_gid: int) -> dict[str, str]:
    """sudo's environment for the command: env_reset unless ``-E``, then the target's identity."""
    env = dict(req.env) if req.keep_env else {k: req.env[k] for k in KEPT_ENV if k in req.env}
    import pwd

    try:
        shell = pwd.getpwuid(target.uid).pw_shell or "/bin/sh"
    except KeyError:
        shell = "/bin/sh"
    env.update({"HOME": target.home, "USER": target.name, "LOGNAME": target.name, "SHELL": shell,
                "SUDO_USER": caller, "SUDO_UID": str(caller_uid), "SUDO_GID": str(caller_gid),
                "SUDO_COMMAND": " ".join(req.argv)[:4096]})
    if not req.keep_env or "PATH" not in env:
        env["PATH"] = DEFAULT_PATH  # sudo's secure_path
    env.update(req.assign)
    return env


def find_program(prog: str, path: str, cwd: str) -> str | None:
    if "/" in prog:
        full = prog if prog.startswith("/") else os.path.join(cwd, prog)
        return full if os.access(full, os.X_OK) and not os.path.isdir(full) else None
    for d in path.split(":"):
        full = os.path.join(d or ".", prog)
        if os.access(full, os.X_OK) and not os.path.isdir(full):
            return full
    return None


class SudoService:
    """The listening socket and its sessions."""

    def __init__(self, table: ProcessTable, path: str = SOCKET_PATH) -> None:
        self.table, self.path = table, path
        self.slots = threading.BoundedSemaphore(MAX_SESSIONS)

    def start(self) -> None:
        threading.Thread(target=self._serve, name="sudo", daemon=True).start()

    def _serve(self) -> None:
        try:
            listener = self._listen()
        except OSError as exc:
            log(f"sudo: not offered ({exc})")
            return
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                log(f"sudo: accept: {exc}")
                continue
            if not self.slots.acquire(blocking=False):
                _answer(conn, {"error": f"too many sudo sessions in this sandbox ({MAX_SESSIONS})", "exit": 1})
                conn.close()
                continue
            threading.Thread(target=self._session, args=(conn,), name="sudo-session", daemon=True).start()

    def _listen(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:  # noqa: SIM105 -- contextlib costs boot time
            os.unlink(self.path)  # a socket left by an earlier daemon of a restored sandbox
        except FileNotFoundError:
            pass
        s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # accepted sockets inherit it
        s.bind(self.path)
        os.chmod(self.path, 0o666)  # anyone may ask; the kernel says who asked
        s.listen(64)
        return s

    def _session(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            with conn:
                fds = self._run(conn)
        except Exception as exc:  # a session never takes the daemon down
            log(f"sudo: session failed: {type(exc).__name__}: {exc}")
        finally:
            for fd in fds:
                close_fd(fd)
            self.slots.release()

    def _run(self, conn: socket.socket) -> list[int]:
        """Serve one request; returns the descriptors received (the caller closes them)."""
        conn.settimeout(REQUEST_SECONDS)
        raw, fds, truncated, senders = _receive(conn)
        if len(senders) != 1:  # none (nothing sent), or pieces from more than one user
            _answer(conn, {"error": "the request's sender is unknown", "exit": 1})
            return fds
        ((uid, gid),) = senders
        allowed, caller = may_sudo(uid)
        if not allowed:  # before the request is parsed; what it carried is closed
            _answer(conn, {"error": f"{caller} is not in the sudoers file (group {SUDO_GROUP})", "exit": 1})
            return fds
        if truncated or len(fds) != 4:
            _answer(conn, {"error": "a request carries stdin, stdout, stderr and the working directory", "exit": 1})
            return fds
        try:
            req = parse_request(raw)
            target = resolve_user(req.user)
        except GuestError as exc:
            _answer(conn, {"error": exc.message, "exit": 1})
            return fds
        cwd = target.home if req.login and os.path.isdir(target.home) else _directory_of(fds[3])
        env = command_env(req, target, caller, uid, gid)
        if find_program(req.argv[0], env["PATH"], cwd) is None:
            _answer(conn, {"error": f"{req.argv[0]}: command not found", "exit": 1})
            return fds
        self._spawn_and_wait(conn, req.argv, target, env, cwd, fds)
        return fds

    def _spawn_and_wait(self, conn: socket.socket, argv: list[str], target: Any, env: dict[str, str], cwd: str,
                        fds: list[int]) -> None:
        import subprocess

        kw: dict[str, Any] = {"cwd": cwd, "env": env, "start_new_session": True, "close_fds": True,
                              "stdin": fds[0], "stdout": fds[1], "stderr": fds[2]}
        switch = target if target.uid != os.getuid() else None
        wake_r, wake_w = os.pipe()
        status: list[int] = []

        def reaped(code: int) -> None:  # on the reaper's thread: never blocks
            status.append(code)
            os.write(wake_w, b"x")

        try:
            try:
                full = spawn_argv(argv, switch, kw, False)
                self.table.ensure_threads()  # the reaper
                with self.table.spawn_lock:  # registered before the reaper can see the pid
                    proc = subprocess.Popen(full, **kw)
                    self.table.watch_pid(proc.pid, proc, reaped)
            except (GuestError, OSError) as exc:
                _answer(conn, {"error": f"{argv[0]}: {getattr(exc, 'message', None) or exc}", "exit": 1})
                return
            self.table.children.set()
            for fd in fds:  # the command has its own copies
                close_fd(fd)
            fds.clear()
            self._relay(conn, proc.pid, wake_r, status)
        finally:
            close_fd(wake_r)
            close_fd(wake_w)

    def _relay(self, conn: socket.socket, pid: int, wake_r: int, status: list[int]) -> None:
        """Forward the client's signals until the command exits, then tell it how."""
        conn.setblocking(False)
        pending = b""
        client = True
        while not status:
            ready, _, _ = select.select([wake_r, conn.fileno()] if client else [wake_r], [], [])
            if conn.fileno() in ready:
                try:
                    chunk = conn.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                if not chunk:  # the client went away: hang the command up, as a closed terminal would
                    client = False
                    _kill(pid, signal.SIGHUP)
                    continue
                pending = (pending + chunk)[-4096:]
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    _forward(pid, line)
        if client:
            code = status[0]
            conn.setblocking(True)
            conn.settimeout(5)
            _answer(conn, {"exit": 128 - code if code < 0 else code, **({"signal": -code} if code < 0 else {})})


def _forward(pid: int, line: bytes) -> None:
    try:
        signum = int(json.loads(line).get("signal"))
    except (ValueError, TypeError, AttributeError):
        return
    if signum in FORWARDED:
        _kill(pid, signum)


def _kill(pid: int, signum: int) -> None:
    try:  # noqa: SIM105 -- contextlib costs boot time
        os.killpg(pid, signum)  # the command leads its own process group (its own session)
    except (ProcessLookupError, PermissionError):
        pass


def _receive(conn: socket.socket) -> tuple[bytes, list[int], bool, set[tuple[int, int]]]:
    """The request line, the descriptors that came with it, whether more came than fit, and the
    (uid, gid) the kernel attached to each piece (``SO_PASSCRED``)."""
    data = b""
    fds: list[int] = []
    senders: set[tuple[int, int]] = set()
    truncated = False
    space = socket.CMSG_SPACE(8 * _FD_BYTES) + socket.CMSG_SPACE(_CRED.size)
    while b"\n" not in data:
        msg, ancillary, flags, _ = conn.recvmsg(65536, space)
        for level, kind, payload in ancillary:
            if level != socket.SOL_SOCKET:
                continue
            if kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % _FD_BYTES
                fds.extend(struct.unpack(f"{usable // _FD_BYTES}i", payload[:usable]))
            elif kind == socket.SCM_CREDENTIALS and len(payload) >= _CRED.size:
                _pid, uid, gid = _CRED.unpack(payload[:_CRED.size])
                senders.add((uid, gid))
        truncated = truncated or bool(flags & socket.MSG_CTRUNC)
        if not msg or len(senders) > 1 or not all(may_sudo(uid)[0] for uid, _ in senders):
            break  # nothing more to read: a caller who may not is answered now, not after its request
        data += msg
        if len(data) > MAX_REQUEST:
            for fd in fds:
                close_fd(fd)
            raise GuestError("invalid_request", "the request is too large")
    return data.partition(b"\n")[0], fds, truncated, senders


def _directory_of(fd: int) -> str:
    """The caller's working directory (where its descriptor points), or / if it is gone."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "/"
    return path if path.startswith("/") and os.path.isdir(path) else "/"


def _answer(conn: socket.socket, body: dict[str, Any]) -> None:
    try:  # noqa: SIM105 -- contextlib costs boot time
        conn.sendall(json.dumps(body).encode() + b"\n")
    except OSError:
        pass
