"""The commands the daemon started: their replay buffers, exits, reaping, stdin feeds and acks.

:class:`ProcessTable` is the process half of the daemon's state (``daemon.Daemon`` adds the channel
to it); the requests that start and steer commands are in guest_exec.py, their output pump in
guest_pump.py.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

if __package__:
    from . import protocol
    from .guest_base import GuestError, Writer, close_fd, log, write_all
    from .guest_pump import Pump
else:  # top-level inside the sandbox: daemon.py put this directory on sys.path
    import protocol  # type: ignore[no-redef, import-not-found]
    from guest_base import GuestError, Writer, close_fd, log, write_all  # type: ignore[no-redef, import-not-found]
    from guest_pump import Pump  # type: ignore[no-redef, import-not-found]

TYPE_CHECKING = False  # type checkers read it as true; importing typing costs boot time (see daemon.py)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .guest_base import Header

MAX_EXITED = 256
#: Replay buffers of exited commands share this budget; past it the oldest are trimmed to their exit.
EXITED_BUFFERS = 64 << 20
#: Bookkeeping cost charged per buffered event, so a flood of tiny events stays bounded too.
EVENT_OVERHEAD = 64


class Command:
    """One process started by ``exec`` and everything the host may still ask about it."""

    def __init__(self, cid: str, argv: list[str], pty: bool, buffer_limit: int) -> None:
        self.id = cid
        self.argv = argv
        self.pty = pty
        self.pid = 0
        self.proc: Any = None
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.reaped = False
        self.exiting = False  # the exit event is claimed (emitted by whoever set this)
        self.finished = False  # the exit event is in the buffer
        self.timed_out = False
        self.deadline: float | None = None
        self.open_streams: dict[int, int] = {}  # output fd -> 1|2, until EOF
        self.master: int | None = None  # pty master (output and input)
        self.stdin_fd: int | None = None
        self.stdin_closed = False  # eof requested (or the process is gone)
        self.stdin_q: deque[tuple[Any, bytes, bool]] = deque()
        self.stdin_busy = False
        # replay buffer
        self.seq = 0
        self.events: deque[tuple[Header, bytes]] = deque()
        self.buf_bytes = 0
        self.buf_limit = buffer_limit
        self.evicted_seq = 0
        self.evicted_end = 0
        self.evicted_marks: deque[tuple[int, int]] = deque(maxlen=4096)
        # flow control (absolute output offsets)
        self.out_off = 0
        self.sent = 0
        self.acked = 0
        self.paused = False
        self.stall_since = 0.0
        self.free = False  # host silent past STALL_TIMEOUT: no flow control until it acks again

    def state(self) -> str:
        return "exited" if self.finished else "running"

    def buffer(self, header: Header, payload: bytes) -> None:
        self.events.append((header, payload))
        self.buf_bytes += len(payload) + EVENT_OVERHEAD
        self.evict()

    def evict(self) -> None:
        """Drop the oldest events over the limit, always keeping the newest (the exit, once exited)."""
        while self.buf_bytes > self.buf_limit and len(self.events) > 1:
            old, data = self.events.popleft()
            self.buf_bytes -= len(data) + EVENT_OVERHEAD
            self.evicted_seq = old["seq"]
            if "off" in old:
                self.evicted_end = old["off"] + len(data)
            self.evicted_marks.append((self.evicted_seq, self.evicted_end))

    def offset_after(self, seq: int) -> int | None:
        """Output offset at the end of event ``seq``, if still known."""
        if seq == 0:
            return 0
        for s, end in self.evicted_marks:
            if s == seq:
                return end
        return None

    def describe(self) -> Header:
        argv = [a[:1024] for a in self.argv[:64]]  # a listing must fit in frame headers
        return {"id": self.id, "pid": self.pid, "argv": argv, "state": self.state(),
                "exit_code": self.exit_code, "signal": self.signal, "started_at": self.started_at,
                "ended_at": self.ended_at, "pty": self.pty, "out_bytes": self.out_off,
                "unacked": self.sent - self.acked, "buffered_bytes": self.buf_bytes, "seq": self.seq}


class ProcessTable:
    """Every command by id and by pid, and the writer and lock their events go through."""

    def __init__(self) -> None:
        self.writer = Writer()
        self.lock = threading.RLock()  # guards commands/uploads state; taken after writer.lock
        self.spawn_lock = threading.Lock()
        self.children = threading.Event()
        self.commands: dict[str, Command] = {}
        self.by_pid: dict[int, Command] = {}
        #: Children that are not commands (sudo's): the reaper hands each its exit code.
        self.watched: dict[int, tuple[Any, Callable[[int], None]]] = {}
        self.exited: deque[str] = deque()
        self.last_activity = time.time()
        self.pump: Pump | None = None
        self._reaper_started = False

    def ensure_threads(self) -> Pump:
        with self.lock:
            if self.pump is None:
                self.pump = Pump(self)
                self.pump.start()
            if not self._reaper_started:
                self._reaper_started = True
                threading.Thread(target=self.reap_forever, name="reaper", daemon=True).start()
            return self.pump

    # -- flow control -------------------------------------------------------------------------

    def on_ack(self, h: Header) -> None:
        wake = False
        with self.lock:
            cmd = self.commands.get(h.get("cmd"))  # type: ignore[arg-type]
            n = h.get("bytes")
            if cmd is None or not isinstance(n, int):
                return
            n = min(n, cmd.sent)
            if n > cmd.acked:
                cmd.acked = n
                cmd.free = False
                cmd.stall_since = time.monotonic()
                wake = cmd.paused
        if wake and self.pump is not None:
            self.pump.wake()

    # -- events -------------------------------------------------------------------------------

    def emit(self, cmd: Command, kind: str, fields: Header, payload: bytes = b"") -> None:
        with self.writer.lock:
            with self.lock:
                cmd.seq += 1
                header: Header = {"t": "ev", "kind": kind, "cmd": cmd.id, "seq": cmd.seq, **fields}
                if kind == "out":
                    header["off"] = cmd.out_off
                    cmd.out_off += len(payload)
                    cmd.sent = cmd.out_off
                elif kind == "exit":
                    cmd.finished = True  # with the event in the buffer: a replay sees both or neither
                cmd.buffer(header, payload)
                self.last_activity = time.time()
            self.writer.write_locked(protocol.encode(header, payload))

    def maybe_finish(self, cmd: Command) -> None:
        """Emit ``exit`` once the process is reaped and all of its output was read."""
        with self.lock:
            if cmd.exiting or not cmd.reaped or cmd.open_streams:
                return
            cmd.exiting = True
        self.emit(cmd, "exit", {"exit_code": cmd.exit_code, "signal": cmd.signal,
                                "timed_out": cmd.timed_out})
        with self.lock:
            if cmd.master is not None and not cmd.stdin_busy:
                close_fd(cmd.master)
                cmd.master = None
            if self.commands.get(cmd.id) is cmd:
                self.exited.append(cmd.id)
            while len(self.exited) > MAX_EXITED:
                old = self.exited.popleft()
                gone = self.commands.get(old)
                if gone is not None and gone.finished:
                    del self.commands[old]
            self._trim_exited()

    def _trim_exited(self) -> None:
        """Keep exited commands' buffers within EXITED_BUFFERS, trimming the oldest first."""
        done = [self.commands[c] for c in self.exited if c in self.commands]
        total = sum(c.buf_bytes for c in done)
        for old in done:
            if total <= EXITED_BUFFERS:
                return
            before = old.buf_bytes
            old.buf_limit = 0
            old.evict()
            total -= before - old.buf_bytes

    # -- reaping ------------------------------------------------------------------------------

    def reap_forever(self) -> None:
        while True:
            self.children.clear()
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                self.children.wait()
                continue
            except OSError as exc:
                log(f"waitpid: {exc}")
                time.sleep(0.1)
                continue
            with self.spawn_lock:  # a pid is registered before its spawn lock is released
                cmd = self.by_pid.pop(pid, None)
                watched = self.watched.pop(pid, None) if cmd is None else None
            if cmd is not None:
                self.on_reaped(cmd, status)
            elif watched is not None:
                proc, on_exit = watched
                code = os.waitstatus_to_exitcode(status)
                proc.returncode = code  # keeps subprocess from ever waiting on this pid itself
                on_exit(code)

    def watch_pid(self, pid: int, proc: Any, on_exit: Callable[[int], None]) -> None:
        """Hand ``pid``'s exit code to ``on_exit`` (on the reaper's thread: it must not block).
        Call with ``spawn_lock`` held, as the pid's spawn does, after :meth:`ensure_threads`."""
        self.watched[pid] = (proc, on_exit)

    def on_reaped(self, cmd: Command, status: int) -> None:
        code = os.waitstatus_to_exitcode(status)
        with self.lock:
            cmd.reaped = True
            cmd.ended_at = time.time()
            if code < 0:
                cmd.signal, cmd.exit_code = -code, 128 - code
            else:
                cmd.exit_code = code
            if cmd.proc is not None:
                cmd.proc.returncode = code  # keeps subprocess from ever waiting on this pid itself
            cmd.stdin_closed = True
            if cmd.stdin_fd is not None and not cmd.stdin_busy:
                close_fd(cmd.stdin_fd)
                cmd.stdin_fd = None
            self.last_activity = time.time()
        self.maybe_finish(cmd)

    def running(self) -> int:
        with self.lock:
            return sum(1 for c in self.commands.values() if not c.finished)

    # -- stdin --------------------------------------------------------------------------------

    def enqueue_stdin(self, rid: Any, h: Header, payload: bytes) -> None:
        """Queue input in arrival order on the command's own writer thread (the process may not
        read it for a long time; that must not hold up any other request)."""
        eof = bool(h.get("eof"))
        with self.lock:
            cmd = self.commands.get(h.get("cmd"))  # type: ignore[arg-type]
            err: tuple[str, str] | None = None
            if cmd is None:
                err = ("not_found", f"no command {h.get('cmd')!r}")
            elif cmd.stdin_closed or (cmd.stdin_fd is None and cmd.master is None):
                err = ("invalid_state", "stdin is not open")
            else:
                cmd.stdin_q.append((rid, payload, eof))
                if eof:
                    cmd.stdin_closed = True
                start = not cmd.stdin_busy
                cmd.stdin_busy = True
        if err is not None:
            self.writer.fail(rid, *err)
        elif start:
            threading.Thread(target=self._feed_stdin, args=(cmd,), name="stdin", daemon=True).start()

    def _feed_stdin(self, cmd: Command) -> None:
        while True:
            with self.lock:
                if not cmd.stdin_q:
                    cmd.stdin_busy = False
                    if cmd.reaped and cmd.stdin_fd is not None:
                        close_fd(cmd.stdin_fd)
                        cmd.stdin_fd = None
                    if cmd.finished and cmd.master is not None:
                        close_fd(cmd.master)
                        cmd.master = None
                    return
                rid, payload, eof = cmd.stdin_q.popleft()
                fd = cmd.master if cmd.pty else cmd.stdin_fd
            try:
                if fd is None:
                    raise GuestError("invalid_state", "stdin is not open")
                write_all(fd, payload)
                if eof:
                    if cmd.pty:
                        write_all(fd, b"\x04")  # VEOF: the line discipline turns it into EOF
                    else:
                        with self.lock:
                            if cmd.stdin_fd is not None:
                                close_fd(cmd.stdin_fd)
                                cmd.stdin_fd = None
                self.writer.reply(rid, {})
            except GuestError as exc:
                self.writer.fail(rid, exc.code, exc.message)
            except OSError as exc:
                self.writer.fail(rid, "invalid_state", f"stdin closed: {exc.strerror or exc}")

    # -- teardown (host tests; PID 1 never gets here) -----------------------------------------

    def shutdown(self) -> None:
        import signal

        with self.lock:
            pids = [c.pid for c in self.commands.values() if not c.reaped and c.pid]
        for pid in pids:
            try:  # noqa: SIM105 -- contextlib costs boot time
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
