"""The requests that start and steer commands: exec, signal, resize, list, forget and replay."""

from __future__ import annotations

import os
import time

if __package__:
    from .guest_base import GuestError, arg, close_fd, norm_path
    from .guest_procs import EVENT_OVERHEAD, Command, ProcessTable
    from .guest_users import DEFAULT_PATH, resolve_user, self_user, set_ctty, spawn_argv
else:  # top-level inside the sandbox: daemon.py put this directory on sys.path
    from guest_base import GuestError, arg, close_fd, norm_path  # type: ignore[no-redef, import-not-found]
    from guest_procs import EVENT_OVERHEAD, Command, ProcessTable  # type: ignore[no-redef, import-not-found]
    from guest_users import DEFAULT_PATH, resolve_user, self_user, set_ctty, spawn_argv  # type: ignore[no-redef, import-not-found]

TYPE_CHECKING = False  # type checkers read it as true; importing typing costs boot time (see daemon.py)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .guest_base import Header

DEFAULT_BUFFER = 4 << 20
MAX_BUFFER = 64 << 20


def op_exec(d: ProcessTable, rid: Any, h: Header, payload: bytes) -> Header:
    import subprocess

    cid = arg(h, "cmd", str, required=True)
    argv = h.get("argv")
    shell = h.get("shell")
    if argv is not None:
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise GuestError("invalid_request", "argv must be a non-empty list of strings")
    elif isinstance(shell, str):
        argv = (["/bin/bash", "-lc", shell] if os.path.exists("/bin/bash") else ["/bin/sh", "-c", shell])
    else:
        raise GuestError("invalid_request", "exec needs argv or shell")
    if any("\x00" in a for a in argv):
        raise GuestError("invalid_request", "argv contains a NUL byte")
    env_arg = arg(h, "env", dict, {})
    pty = arg(h, "pty", dict)
    want_stdin = bool(h.get("stdin", False))
    buffer_limit = arg(h, "buffer_bytes", int, DEFAULT_BUFFER)
    if not 0 <= buffer_limit <= MAX_BUFFER:
        raise GuestError("invalid_request", f"buffer_bytes must be within 0..{MAX_BUFFER}")
    # ``kill_after`` is the same thing under a name GuestConnection.request(timeout=...) leaves free.
    timeout = arg(h, "kill_after", (int, float), arg(h, "timeout", (int, float)))
    user_arg = h.get("user")
    user = resolve_user(user_arg) if user_arg is not None else None
    ident = user or self_user()
    cwd_arg = h.get("cwd")
    if cwd_arg is not None:
        cwd = norm_path(cwd_arg, "cwd")
    else:
        cwd = ident.home if os.path.isdir(ident.home) else "/"
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": ident.home, "USER": ident.name,
           "LOGNAME": ident.name}
    if pty is not None:
        env["TERM"] = "xterm-256color"
    for k, v in env_arg.items():
        if not isinstance(k, str) or "=" in k or not k or "\x00" in k:
            raise GuestError("invalid_request", f"bad environment name {k!r}")
        if v is None:
            env.pop(k, None)
        elif isinstance(v, str) and "\x00" not in v:
            env[k] = v
        else:
            raise GuestError("invalid_request", f"bad environment value for {k}")

    cmd = Command(cid, argv, pty is not None, buffer_limit)
    with d.lock:
        if cid in d.commands:
            raise GuestError("conflict", f"command {cid!r} exists")
        d.commands[cid] = cmd  # reserved: a concurrent exec with the same id gets conflict
    pump = d.ensure_threads()
    kw: dict[str, Any] = {"cwd": cwd, "env": env, "start_new_session": True, "close_fds": True}
    argv = spawn_argv(argv, user, kw, pty is not None)
    parent_fds: list[int] = []
    child_fds: list[int] = []
    try:
        if pty is not None:
            master, slave = os.openpty()
            parent_fds.append(master)
            child_fds.append(slave)
            _set_winsize(master, pty)
            kw.update(stdin=slave, stdout=slave, stderr=slave)
            if "preexec_fn" not in kw and kw.get("start_new_session"):
                kw["preexec_fn"] = set_ctty  # no setsid(1) in this template: the slow fork path
            streams = {master: 1}
            os.set_blocking(master, False)
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            parent_fds += [out_r, err_r]
            child_fds += [out_w, err_w]
            kw.update(stdout=out_w, stderr=err_w)
            streams = {out_r: 1, err_r: 2}
            for r, w in ((out_r, out_w), (err_r, err_w)):
                os.set_blocking(r, False)
                _grow_pipe(w)
            if want_stdin:
                in_r, in_w = os.pipe()
                parent_fds.append(in_w)
                child_fds.append(in_r)
                kw["stdin"] = in_r
            else:
                kw["stdin"] = subprocess.DEVNULL
        with d.spawn_lock:
            try:
                proc = subprocess.Popen(argv, **kw)
            except FileNotFoundError as exc:
                what = "working directory" if exc.filename == cwd else "executable"
                raise GuestError("not_found", f"{what} not found: {exc.filename}") from None
            except NotADirectoryError as exc:
                raise GuestError("invalid_request", f"not a directory: {exc.filename}") from None
            except PermissionError as exc:
                raise GuestError("forbidden", f"permission denied: {exc.filename}") from None
            except OSError as exc:
                raise GuestError("invalid_request", f"cannot start {argv[0]!r}: {exc}") from None
            with d.lock:
                cmd.proc = proc
                cmd.pid = proc.pid
                cmd.started_at = time.time()
                cmd.open_streams = dict(streams)
                if pty is not None:
                    cmd.master = parent_fds[0]
                elif want_stdin:
                    cmd.stdin_fd = parent_fds[-1]
                else:
                    cmd.stdin_closed = True
                if timeout is not None:
                    cmd.deadline = time.monotonic() + float(timeout)
                d.by_pid[proc.pid] = cmd
                d.last_activity = time.time()
            d.children.set()
    except BaseException:
        with d.lock:
            if d.commands.get(cid) is cmd:
                del d.commands[cid]
        for fd in parent_fds:
            close_fd(fd)
        raise
    finally:
        for fd in child_fds:
            close_fd(fd)
    pump.add(cmd)
    return {"pid": cmd.pid, "started_at": cmd.started_at}


def _set_winsize(fd: int, size: Header) -> None:
    import fcntl
    import struct
    import termios

    rows = arg(size, "rows", int, 24)
    cols = arg(size, "cols", int, 80)
    if not (0 < rows < 65536 and 0 < cols < 65536):
        raise GuestError("invalid_request", "rows/cols out of range")
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _command(d: ProcessTable, h: Header) -> Command:
    cid = h.get("cmd")
    with d.lock:
        cmd = d.commands.get(cid) if isinstance(cid, str) else None
    if cmd is None or cmd.pid == 0:
        raise GuestError("not_found", f"no command {cid!r}")
    return cmd


def op_signal(d: ProcessTable, rid: Any, h: Header, payload: bytes) -> Header:
    import signal

    cmd = _command(d, h)
    sig = h.get("signal")
    if isinstance(sig, str):
        name = sig.upper()
        num = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
        if not isinstance(num, int) or name.startswith("SIG_"):
            raise GuestError("invalid_request", f"unknown signal {sig!r}")
        sig = int(num)
    if not isinstance(sig, int) or isinstance(sig, bool) or not 0 < sig < 65:
        raise GuestError("invalid_request", "signal must be a number or a name")
    if cmd.reaped:
        raise GuestError("invalid_state", f"command {cmd.id} has exited")
    try:
        os.killpg(cmd.pid, sig)
    except ProcessLookupError:
        raise GuestError("invalid_state", f"command {cmd.id} has exited") from None
    return {}


def op_resize(d: ProcessTable, rid: Any, h: Header, payload: bytes) -> Header:
    cmd = _command(d, h)
    with d.lock:
        master = cmd.master
    if not cmd.pty:
        raise GuestError("invalid_request", f"command {cmd.id} has no pty")
    if master is None:
        raise GuestError("invalid_state", f"command {cmd.id} has exited")
    _set_winsize(master, h)
    return {}


def op_list(d: ProcessTable, rid: Any, h: Header, payload: bytes) -> Header:
    with d.lock:
        cmds = [c.describe() for c in d.commands.values() if c.pid]
    return {"commands": cmds}


def op_forget(d: ProcessTable, rid: Any, h: Header, payload: bytes) -> Header:
    cmd = _command(d, h)
    with d.lock:
        if not cmd.finished:
            raise GuestError("invalid_state", f"command {cmd.id} is still running")
        d.commands.pop(cmd.id, None)
        try:  # noqa: SIM105 -- contextlib costs boot time
            d.exited.remove(cmd.id)
        except ValueError:
            pass
    return {}


def op_replay(d: ProcessTable, rid: Any, h: Header, payload: bytes) -> Header:
    """Events after ``after``; with ``max_bytes``, only as many as fit (payload + EVENT_OVERHEAD
    each, at least one) and ``more: true`` when some were left for the next request."""
    cmd = _command(d, h)
    after = arg(h, "after", int, 0)
    after_off = arg(h, "after_off", int)
    window = arg(h, "max_bytes", int)
    more = False
    with d.lock:
        events = [e for e in cmd.events if e[0]["seq"] > after]
        if window is not None:
            used = 0
            for i, (_, data) in enumerate(events):
                used += len(data) + EVENT_OVERHEAD
                if i and used > window:
                    events, more = events[:i], True
                    break
        last_seq = cmd.seq
        state = cmd.state()
        gap: Header | None = None
        if cmd.evicted_seq > after:
            start = after_off if after_off is not None else cmd.offset_after(after)
            gap = {"kind": "gap", "cmd": cmd.id, "seq": cmd.evicted_seq,
                   "lost_bytes": max(0, cmd.evicted_end - (start or 0))}
    if gap is not None:
        d.writer.send({"t": "chunk", "id": rid, "ev": gap})
    for header, data in events:
        d.writer.send({"t": "chunk", "id": rid, "ev": header}, data)
    return {"last_seq": last_seq, "state": state, **({"more": True} if more else {})}


def _grow_pipe(fd: int) -> None:
    """A roomier pipe lets a producer run ahead while its output lingers (fewer, fuller frames)."""
    try:
        import fcntl

        fcntl.fcntl(fd, 1031, 256 * 1024)  # F_SETPIPE_SZ
    except OSError:
        pass


OPS: dict[str, Callable[[ProcessTable, Any, Header, bytes], Header]] = {
    "exec": op_exec, "signal": op_signal, "resize": op_resize, "list": op_list, "forget": op_forget,
    "replay": op_replay,
}
