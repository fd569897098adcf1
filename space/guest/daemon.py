"""The SPACE guest daemon: PID 1 of every sandbox, the only door into it.

Runs on the template's own python3 (standard library only) as
``python3 -I -S /opt/space/guest/daemon.py`` and speaks :mod:`protocol` frames on stdin/stdout.
It runs processes (pipes or a PTY, with a bounded replay buffer per command and ack-based flow
control), serves files, reaps every child (it is PID 1) and reports activity.

Threads: the main thread reads stdin frames and answers the cheap requests itself (a thread handoff
costs more than the work, and much more under gVisor); anything that may block on something else than
the channel (exec, files, replays) runs on a small worker pool; one pump thread reads every process's
output through epoll; one reaper thread waits for every child; a stdin thread per command feeds its
input in order. The main thread blocks on stdout only while the host is not reading the channel, so
the host side must never stop reading guest output because a write to the guest is pending (the
shim buffers its writes to us for that reason).
Only fd numbers 0 and 1 are remembered about the channel, so checkpoint/restore may swap the pipes.
Off PID 1 (host tests) the end of stdin ends the daemon and its commands; PID 1 waits for a new channel.

Wire details beyond the brief (see also protocol.py's conventions):
- ``out`` events carry ``off`` (stream offset); acks are absolute offsets, so stale ones are harmless.
- ``exit`` has ``exit_code`` (128+N when killed by signal N), ``signal`` and ``timed_out``.
- ``exec`` takes its kill timeout as ``timeout`` or ``kill_after`` (GuestConnection.request's own
  ``timeout`` keyword is the answer deadline). Send ``stdin`` only after ``exec`` answered; input of
  one command is written in arrival order. ``eof`` on a PTY sends VEOF (^D).
- ``replay`` takes ``after_off`` (the offset after event ``after``) so a ``gap`` can say exactly how
  many bytes were lost; without it the count covers everything evicted when ``after`` is unknown.
- ``list`` entries add ``out_bytes``, ``unacked`` and ``buffered_bytes``.
- Exited commands' buffers share EXITED_BUFFERS; the oldest are trimmed (a replay then shows a gap).
"""

from __future__ import annotations

import time

_T0 = time.monotonic()

import os  # noqa: E402 -- the boot timestamp above must come first
import sys  # noqa: E402
import threading  # noqa: E402
from collections import deque  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

if __package__:
    from . import protocol
else:  # run as a script inside the sandbox: protocol.py sits beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import protocol  # type: ignore[no-redef, import-not-found]

VERSION = protocol.PROTOCOL_VERSION
WINDOW = 4 << 20
#: Seconds without ack progress after which a stalled command runs on unthrottled (host gone).
STALL_TIMEOUT = float(os.environ.get("SPACE_GUEST_STALL_TIMEOUT", "30"))
DEFAULT_BUFFER = 4 << 20
MAX_BUFFER = 64 << 20
MAX_EXITED = 256
#: Replay buffers of exited commands share this budget; past it the oldest are trimmed to their exit.
EXITED_BUFFERS = 64 << 20
#: Bookkeeping cost charged per buffered event, so a flood of tiny events stays bounded too.
EVENT_OVERHEAD = 64
#: A stream that produced output within BUSY seconds waits up to LINGER seconds to fill a frame:
#: per-frame costs dominate bulk throughput, while a lone keystroke echo still goes out at once.
BUSY = 0.005
LINGER = 0.002
UPLOAD_IDLE = 120.0
MAX_LIST_ENTRIES = 100_000
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

Header = dict[str, Any]


class GuestError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_ERRNO_CODES: dict[str, str] = {
    "ENOENT": "not_found", "EEXIST": "conflict", "ENOTEMPTY": "conflict", "EBUSY": "conflict",
    "EACCES": "forbidden", "EPERM": "forbidden", "EROFS": "forbidden", "ENOTDIR": "invalid_path",
    "EISDIR": "invalid_request", "ENAMETOOLONG": "invalid_path", "ELOOP": "invalid_path",
    "EINVAL": "invalid_request", "EXDEV": "invalid_request",
}


def os_error(exc: OSError, what: str = "") -> GuestError:
    import errno

    name = errno.errorcode.get(exc.errno or 0, "")
    code = _ERRNO_CODES.get(name, "internal")
    where = what or (exc.filename if isinstance(exc.filename, str) else "")
    return GuestError(code, f"{exc.strerror or exc}: {where}" if where else str(exc.strerror or exc))


_log_budget = [200]


def log(msg: str) -> None:
    """Log to stderr, sparingly: a broken host must not make the guest spend its life logging."""
    if _log_budget[0] <= 0:
        return
    _log_budget[0] -= 1
    try:  # noqa: SIM105 -- contextlib costs boot time
        os.write(2, f"space-guest[{os.getpid()}]: {msg}\n".encode(errors="replace"))
    except OSError:
        pass


# ---------------------------------------------------------------------------------------- channel


class Writer:
    """Serializes frames onto fd 1, in writes of at most MAX_WRITE bytes (gVisor stalls bigger ones)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._broken = False

    def send(self, header: Header, payload: bytes = b"") -> None:
        data = protocol.encode(header, payload)
        with self.lock:
            self.write_locked(data)

    def write_locked(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(1, view[: protocol.MAX_WRITE])
            except OSError as exc:
                # No host (EPIPE) or a channel being swapped: drop the frame, the replay buffer has it.
                if not self._broken:
                    log(f"channel write failed: {exc}")
                self._broken = True
                return
            self._broken = False
            view = view[n:]


class Pool:
    """A minimal grow-on-demand worker pool (concurrent.futures costs startup time we don't need)."""

    def __init__(self, max_workers: int = 64) -> None:
        import queue

        self._empty = queue.Empty
        self._q: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._pending = 0
        self._workers = 0
        self._max = max_workers

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            self._q.put((fn, args))
            self._pending += 1
            spawn = self._pending > self._idle and self._workers < self._max
            if spawn:
                self._workers += 1
        if spawn:
            threading.Thread(target=self._work, name="worker", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                fn, args = self._q.get(timeout=60)
            except self._empty:
                with self._lock:
                    self._idle -= 1
                    if self._pending == 0:
                        self._workers -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            try:
                fn(*args)
            except Exception as exc:  # a worker must survive any request
                log(f"worker: {exc!r}")


# ---------------------------------------------------------------------------------------- commands


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
                "unacked": self.sent - self.acked, "buffered_bytes": self.buf_bytes}


class Upload:
    def __init__(self) -> None:
        import queue

        self.q: queue.Queue[tuple[bytes, bool] | None] = queue.Queue(maxsize=64)
        self.aborted = False

    def drain(self) -> None:
        while not self.q.empty():
            self.q.get_nowait()


# ---------------------------------------------------------------------------------------- daemon


class Daemon:
    def __init__(self) -> None:
        self.writer = Writer()
        self.lock = threading.RLock()  # guards commands/uploads state; taken after writer.lock
        self.spawn_lock = threading.Lock()
        self.children = threading.Event()
        self.commands: dict[str, Command] = {}
        self.by_pid: dict[int, Command] = {}
        self.exited: deque[str] = deque()
        self.uploads: dict[Any, Upload] = {}
        self.last_activity = time.time()
        self.pool = Pool()
        self.pump: Pump | None = None
        self.boot_ms = 0.0
        self._reaper_started = False

    # -- startup ------------------------------------------------------------------------------

    def announce(self) -> None:
        self.boot_ms = round((time.monotonic() - _T0) * 1000, 3)
        self.writer.send({"t": "ev", "kind": "ready", "version": VERSION, "boot_ms": self.boot_ms,
                          "pid": os.getpid()})
        # Warm the modules the first exec needs, off the critical path.
        threading.Thread(target=_warm_imports, name="warm", daemon=True).start()

    def ensure_threads(self) -> Pump:
        with self.lock:
            if self.pump is None:
                self.pump = Pump(self)
                self.pump.start()
            if not self._reaper_started:
                self._reaper_started = True
                threading.Thread(target=self.reap_forever, name="reaper", daemon=True).start()
            return self.pump

    # -- stdin frames -------------------------------------------------------------------------

    def serve(self) -> None:
        buf = bytearray()
        eof_logged = False
        while True:
            try:
                # 64 KiB: big enough for a full pipe, small enough to stay off mmap (costly in gVisor).
                data = os.read(0, 1 << 16)
            except OSError as exc:
                log(f"channel read failed: {exc}")
                data = b""
            if not data:
                if os.getpid() != 1:
                    self.shutdown()
                    return
                # PID 1 must never exit (that ends the sandbox): wait for a restore to hand us a new
                # channel on fd 0.
                if not eof_logged:
                    log("channel closed; waiting for a new one")
                    eof_logged = True
                buf.clear()
                time.sleep(1.0)
                continue
            eof_logged = False
            buf += data
            self._drain(buf)

    def _drain(self, buf: bytearray) -> None:
        while len(buf) >= 8:
            try:
                rest, hlen = protocol.decode_lengths(bytes(buf[:8]))
            except protocol.ProtocolError as exc:
                skip = protocol.resync(buf)
                log(f"bad frame ({exc}); skipped {skip} bytes")
                del buf[:skip]
                continue
            if len(buf) < 8 + rest:
                return
            body = bytes(buf[8 : 8 + rest])
            del buf[: 8 + rest]
            try:
                header, payload = protocol.decode_body(body, hlen)
            except protocol.ProtocolError as exc:
                log(f"bad frame: {exc}")
                continue
            try:
                self.on_frame(header, payload)
            except Exception as exc:
                log(f"frame handling failed: {exc!r}")

    def on_frame(self, h: Header, payload: bytes) -> None:
        t = h.get("t")
        if t == "ack":
            self.on_ack(h)
        elif t == "data":
            with self.lock:
                up = self.uploads.get(h.get("id"))
            if up is None:
                return
            if h.get("abort"):
                up.aborted = True
                up.q.put(None)
            else:
                # Blocks only while the disk is behind the channel: that is the upload's backpressure.
                up.q.put((payload, bool(h.get("eof"))))
        elif t == "req":
            self.last_activity = time.time()
            op = h.get("op")
            rid = h.get("id")
            if op == "fs.write":
                with self.lock:
                    self.uploads[rid] = Upload()
            elif op == "stdin":
                self.enqueue_stdin(rid, h, payload)
                return
            elif op == "hello":
                self.on_hello()
            if op in _INLINE or op not in _OPS:
                self.handle(h, payload)
            else:
                self.pool.submit(self.handle, h, payload)
        else:
            log(f"unexpected frame kind {t!r}")

    def handle(self, h: Header, payload: bytes) -> None:
        rid = h.get("id")
        op = h.get("op")
        try:
            fn = _OPS.get(op) if isinstance(op, str) else None
            if fn is None:
                raise GuestError("invalid_request", f"unknown op {op!r}")
            result = fn(self, rid, h, payload)
            self.reply(rid, result)
        except GuestError as exc:
            self.fail(rid, exc.code, exc.message)
        except OSError as exc:
            err = os_error(exc)
            self.fail(rid, err.code, err.message)
        except (KeyError, TypeError, ValueError) as exc:
            self.fail(rid, "invalid_request", f"bad arguments for {op}: {exc!r}")
        except Exception as exc:
            log(f"{op} failed: {exc!r}")
            self.fail(rid, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            if op == "fs.write":
                with self.lock:
                    up = self.uploads.pop(rid, None)
                if up is not None:
                    up.drain()  # frees the reader if it is blocked on this upload's full queue

    def reply(self, rid: Any, result: Header) -> None:
        parts = {k: v for k, v in result.items() if k in ("entries", "commands")}
        for key, items in parts.items():
            batches = protocol.batch_items(items)
            for batch in batches[:-1]:
                self.writer.send({"t": "chunk", "id": rid, "part": key, key: batch})
            result[key] = batches[-1]
        self.writer.send({"t": "res", "id": rid, "ok": True, **result})

    def fail(self, rid: Any, code: str, message: str) -> None:
        self.writer.send({"t": "res", "id": rid, "ok": False,
                          "error": {"code": code, "message": message[:2000]}})

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

    def on_hello(self) -> None:
        """A new host connected: whatever the old one did not ack is gone; its uploads are dead."""
        with self.lock:
            for cmd in self.commands.values():
                cmd.acked = cmd.sent
            for up in self.uploads.values():
                up.aborted = True
        if self.pump is not None:
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
                _close(cmd.master)
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
            if cmd is not None:
                self.on_reaped(cmd, status)

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
                _close(cmd.stdin_fd)
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
            self.fail(rid, *err)
        elif start:
            threading.Thread(target=self._feed_stdin, args=(cmd,), name="stdin", daemon=True).start()

    def _feed_stdin(self, cmd: Command) -> None:
        while True:
            with self.lock:
                if not cmd.stdin_q:
                    cmd.stdin_busy = False
                    if cmd.reaped and cmd.stdin_fd is not None:
                        _close(cmd.stdin_fd)
                        cmd.stdin_fd = None
                    if cmd.finished and cmd.master is not None:
                        _close(cmd.master)
                        cmd.master = None
                    return
                rid, payload, eof = cmd.stdin_q.popleft()
                fd = cmd.master if cmd.pty else cmd.stdin_fd
            try:
                if fd is None:
                    raise GuestError("invalid_state", "stdin is not open")
                _write_all(fd, payload)
                if eof:
                    if cmd.pty:
                        _write_all(fd, b"\x04")  # VEOF: the line discipline turns it into EOF
                    else:
                        with self.lock:
                            if cmd.stdin_fd is not None:
                                _close(cmd.stdin_fd)
                                cmd.stdin_fd = None
                self.reply(rid, {})
            except GuestError as exc:
                self.fail(rid, exc.code, exc.message)
            except OSError as exc:
                self.fail(rid, "invalid_state", f"stdin closed: {exc.strerror or exc}")

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


# ---------------------------------------------------------------------------------------- pump


class Pump(threading.Thread):
    """Reads every command's output through one epoll, stopping a command when its window is full."""

    def __init__(self, daemon: Daemon) -> None:
        super().__init__(name="pump", daemon=True)
        import select

        self.d = daemon
        self.ep = select.epoll()
        self._in = select.EPOLLIN
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.ep.register(self.wake_r, self._in)
        self.fds: dict[int, tuple[Command, int]] = {}
        self.incoming: list[Command] = []
        self.paused: set[Command] = set()
        self.timed: set[Command] = set()
        self.partial: dict[int, bytes] = {}  # fd -> output read but not sent yet (lingering)
        self.flush_at: dict[int, float] = {}  # lingering fds (out of epoll until then)
        self.last_emit: dict[int, float] = {}
        self.registered: set[int] = set()

    def _register(self, fd: int) -> None:
        if fd not in self.registered and fd in self.fds:
            self.ep.register(fd, self._in)
            self.registered.add(fd)

    def _unregister(self, fd: int) -> None:
        if fd in self.registered:
            self.registered.discard(fd)
            self.ep.unregister(fd)

    def add(self, cmd: Command) -> None:
        with self.d.lock:
            self.incoming.append(cmd)
        self.wake()

    def wake(self) -> None:
        try:  # noqa: SIM105 -- contextlib costs boot time
            os.write(self.wake_w, b"x")
        except OSError:
            pass  # already awake (pipe full)

    def run(self) -> None:
        while True:
            try:
                ready = self.ep.poll(self._timeout())
            except InterruptedError:
                continue
            for fd, _ in ready:
                if fd == self.wake_r:
                    try:
                        while os.read(self.wake_r, 4096):
                            pass
                    except OSError:
                        pass
                elif fd in self.fds:
                    self._read(fd)
            if self.flush_at:
                now = time.monotonic()
                for fd in [f for f, t in self.flush_at.items() if t <= now]:
                    self._read(fd, lingered=True)
            self._maintain()

    def _timeout(self) -> float:
        now = time.monotonic()
        t = 3600.0
        with self.d.lock:
            for cmd in self.timed:
                if cmd.deadline is not None:
                    t = min(t, cmd.deadline - now)
            for cmd in self.paused:
                t = min(t, cmd.stall_since + STALL_TIMEOUT - now)
        for at in self.flush_at.values():
            t = min(t, at - now)
        return max(t, 0.0)

    def _read(self, fd: int, lingered: bool = False) -> None:
        """Read what the stream has. A busy stream's short read is held back for LINGER seconds,
        out of epoll (no wakeup per small write), then topped up and sent as one frame."""
        cmd, _ = self.fds[fd]
        held = self.partial.get(fd, b"")
        try:
            data = os.read(fd, protocol.MAX_PAYLOAD - len(held))
        except BlockingIOError:
            data = None
        except OSError:  # EIO on a pty master: every slave end is closed
            data = b""
        if data == b"":
            self._emit(fd)
            self._unregister(fd)
            del self.fds[fd]
            self.last_emit.pop(fd, None)
            with self.d.lock:
                cmd.open_streams.pop(fd, None)
                if fd != cmd.master:
                    _close(fd)
            self.d.maybe_finish(cmd)
            return
        if data:
            held += data
            self.partial[fd] = held
        now = time.monotonic()
        if lingered or len(held) >= protocol.MAX_PAYLOAD:
            self._emit(fd)
        elif held and fd not in self.flush_at:
            if now - self.last_emit.get(fd, 0.0) < BUSY:
                self.flush_at[fd] = now + LINGER
                self._unregister(fd)
                return
            self._emit(fd)
        if lingered and not cmd.paused:
            self._register(fd)

    def _emit(self, fd: int) -> None:
        cmd, which = self.fds[fd]
        if self.flush_at.pop(fd, None) is not None and not cmd.paused:
            self._register(fd)
        data = self.partial.pop(fd, b"")
        if not data:
            return
        self.d.emit(cmd, "out", {"fd": which}, data)
        self.last_emit[fd] = time.monotonic()
        with self.d.lock:
            stop = not cmd.free and cmd.sent - cmd.acked >= WINDOW
            if stop:
                cmd.paused = True
                cmd.stall_since = time.monotonic()
                self.paused.add(cmd)
        if stop:
            for f in cmd.open_streams:
                self._unregister(f)

    def _maintain(self) -> None:
        import signal

        now = time.monotonic()
        resume: list[Command] = []
        kill: list[Command] = []
        with self.d.lock:
            for cmd in self.incoming:
                for fd, which in cmd.open_streams.items():
                    self.fds[fd] = (cmd, which)
                    self._register(fd)
                if cmd.deadline is not None:
                    self.timed.add(cmd)
            self.incoming.clear()
            for cmd in list(self.paused):
                if cmd.sent - cmd.acked >= WINDOW and not cmd.free:
                    if now - cmd.stall_since < STALL_TIMEOUT:
                        continue
                    # Nobody acked for STALL_TIMEOUT: the host is gone or stuck. Keep running; the
                    # output now only lives in the replay buffer.
                    cmd.acked = cmd.sent
                    cmd.free = True
                cmd.paused = False
                self.paused.discard(cmd)
                resume.append(cmd)
            for cmd in list(self.timed):
                if cmd.reaped:
                    self.timed.discard(cmd)
                elif cmd.deadline is not None and now >= cmd.deadline:
                    cmd.timed_out = True
                    self.timed.discard(cmd)
                    kill.append(cmd)
            for cmd in resume:
                for fd in cmd.open_streams:
                    if fd not in self.flush_at:
                        self._register(fd)
        for cmd in kill:
            try:  # noqa: SIM105 -- contextlib costs boot time
                os.killpg(cmd.pid, signal.SIGKILL)
            except OSError:
                pass


# ---------------------------------------------------------------------------------------- helpers


def _warm_imports() -> None:
    try:
        import fcntl  # noqa: F401
        import pwd  # noqa: F401
        import select  # noqa: F401
        import signal  # noqa: F401
        import subprocess  # noqa: F401
        import termios  # noqa: F401
    except ImportError:
        pass


def _close(fd: int) -> None:
    try:  # noqa: SIM105 -- contextlib costs boot time
        os.close(fd)
    except OSError:
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view[: protocol.MAX_WRITE])
        except BlockingIOError:  # a pty master is non-blocking (the pump reads it)
            import select

            select.select([], [fd], [])
            continue
        view = view[n:]


def _grow_pipe(fd: int) -> None:
    """A roomier pipe lets a producer run ahead while its output lingers (fewer, fuller frames)."""
    try:
        import fcntl

        fcntl.fcntl(fd, 1031, 256 * 1024)  # F_SETPIPE_SZ
    except OSError:
        pass


def _arg(h: Header, key: str, kind: type | tuple[type, ...], default: Any = None,
         *, required: bool = False) -> Any:
    v = h.get(key, default)
    if v is None and not required:
        return default
    if isinstance(v, bool) and kind in (int, float):
        raise GuestError("invalid_request", f"{key} must be {kind}")
    if not isinstance(v, kind):
        raise GuestError("invalid_request", f"{key} is missing or has the wrong type")
    return v


def norm_path(p: Any, key: str = "path") -> str:
    """Lexically normalize an absolute path; refuse one whose ``..`` climbs above ``/``."""
    if not isinstance(p, str) or not p:
        raise GuestError("invalid_path", f"{key} must be a non-empty string")
    if "\x00" in p:
        raise GuestError("invalid_path", f"{key} contains a NUL byte")
    if not p.startswith("/"):
        raise GuestError("invalid_path", f"{key} must be absolute: {p!r}")
    parts: list[str] = []
    for seg in p.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if not parts:
                raise GuestError("invalid_path", f"{key} escapes the root: {p!r}")
            parts.pop()
        else:
            parts.append(seg)
    return "/" + "/".join(parts)


_owners: dict[int, str] = {}


def _owner(uid: int) -> str:
    name = _owners.get(uid)
    if name is None:
        try:
            import pwd

            name = pwd.getpwuid(uid).pw_name
        except (KeyError, ImportError):
            name = str(uid)
        _owners[uid] = name
    return name


def file_entry(path: str) -> Header:
    import stat as st

    s = os.lstat(path)
    m = s.st_mode
    kind = ("dir" if st.S_ISDIR(m) else "file" if st.S_ISREG(m) else
            "symlink" if st.S_ISLNK(m) else "other")
    target = None
    if kind == "symlink":
        try:
            target = os.readlink(path)
        except OSError:
            target = None
    return {"name": os.path.basename(path) or "/", "path": path, "type": kind, "size": s.st_size,
            "mode": st.S_IMODE(m), "mtime": s.st_mtime, "owner": _owner(s.st_uid),
            "symlink_target": target}


class User:
    def __init__(self, uid: int, gid: int, groups: list[int], name: str, home: str) -> None:
        self.uid, self.gid, self.groups, self.name, self.home = uid, gid, groups, name, home


def resolve_user(user: Any) -> User:
    import pwd

    pw: Any = None
    if (isinstance(user, int) and not isinstance(user, bool)) or (isinstance(user, str) and user.isdigit()):
        uid = int(user)
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return User(uid, uid, [uid], str(uid), "/")
    elif isinstance(user, str) and user:
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            raise GuestError("invalid_request", f"unknown user {user!r}") from None
    else:
        raise GuestError("invalid_request", "user must be a name or a uid")
    try:
        groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    except OSError:
        groups = [pw.pw_gid]
    return User(pw.pw_uid, pw.pw_gid, groups, pw.pw_name, pw.pw_dir or "/")


def _makedirs(path: str, user: User | None) -> None:
    """mkdir -p that chowns exactly the directories it created."""
    missing: list[str] = []
    p = path
    while not os.path.isdir(p):
        if os.path.lexists(p):
            raise GuestError("conflict", f"{p} exists and is not a directory")
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:
            if not os.path.isdir(d):
                raise GuestError("conflict", f"{d} exists and is not a directory") from None
            continue
        if user is not None:
            os.chown(d, user.uid, user.gid)


_TOOLS: dict[str, str | None] = {}


def _tool(name: str) -> str | None:
    if name not in _TOOLS:
        found = None
        for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
            if os.access(f"{d}/{name}", os.X_OK):
                found = f"{d}/{name}"
                break
        _TOOLS[name] = found
    return _TOOLS[name]


def _spawn_argv(argv: list[str], user: User | None, kw: dict[str, Any], pty: bool) -> list[str]:
    """Keep subprocess on its vfork path: switching users or taking a controlling terminal in
    Popen itself forces a full fork of this daemon, ~35 ms under gVisor (vfork: ~2 ms). The static
    ``space-spawn`` beside this file (built by the node) does those steps after the exec for ~10 ms;
    util-linux's setpriv/setsid for ~24 ms; without either, Popen's own slow way is used."""
    switch = user is not None and (user.uid, user.gid) != (os.getuid(), os.getgid())
    if not switch and not pty:
        return argv
    # A wrapper would turn a missing program into exit 127; keep it a clean not_found.
    _require_executable(argv[0], kw["env"].get("PATH", DEFAULT_PATH), kw["cwd"])
    helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "space-spawn")
    if os.access(helper, os.X_OK):
        pre = [helper]
        if switch and user is not None:
            pre += ["-u", str(user.uid), "-g", str(user.gid), "-G", ",".join(str(g) for g in user.groups)]
        if pty:
            pre.append("-t")  # Popen's start_new_session made the session; take the pty as its tty
        return [*pre, "--", *argv]
    if switch and user is not None:
        setpriv = _tool("setpriv")
        if setpriv is None:
            kw.update(user=user.uid, group=user.gid, extra_groups=user.groups)
        else:
            groups = ",".join(str(g) for g in user.groups)
            argv = [setpriv, f"--reuid={user.uid}", f"--regid={user.gid}",
                    f"--groups={groups}" if groups else "--clear-groups", "--", *argv]
    if pty:
        setsid = _tool("setsid")
        if setsid is not None and "user" not in kw:
            # setsid(1) makes the session and takes the pty (its stdin) as controlling terminal.
            kw["start_new_session"] = False
            argv = [setsid, "--ctty", "--", *argv]
    return argv


def _require_executable(prog: str, path: str, cwd: str) -> None:
    if "/" in prog:
        full = prog if prog.startswith("/") else os.path.join(cwd, prog)
        if os.access(full, os.X_OK) and not os.path.isdir(full):
            return
    else:
        for d in path.split(":"):
            full = os.path.join(d or ".", prog)
            if os.access(full, os.X_OK) and not os.path.isdir(full):
                return
    raise GuestError("not_found", f"executable not found: {prog}")


def _set_ctty() -> None:  # runs in the child between fork and exec (pty commands only)
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


# ---------------------------------------------------------------------------------------- ops


def op_hello(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    return {"version": VERSION, "boot_ms": d.boot_ms, "uptime": time.monotonic() - _T0,
            "last_activity": d.last_activity, "running": d.running(), "pid": os.getpid()}


def op_activity(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    return {"last_activity": d.last_activity, "running": d.running()}


def op_exec(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    import subprocess

    cid = _arg(h, "cmd", str, required=True)
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
    env_arg = _arg(h, "env", dict, {})
    pty = _arg(h, "pty", dict)
    want_stdin = bool(h.get("stdin", False))
    buffer_limit = _arg(h, "buffer_bytes", int, DEFAULT_BUFFER)
    if not 0 <= buffer_limit <= MAX_BUFFER:
        raise GuestError("invalid_request", f"buffer_bytes must be within 0..{MAX_BUFFER}")
    # ``kill_after`` is the same thing under a name GuestConnection.request(timeout=...) leaves free.
    timeout = _arg(h, "kill_after", (int, float), _arg(h, "timeout", (int, float)))
    user_arg = h.get("user")
    user = resolve_user(user_arg) if user_arg is not None else None
    ident = user or _self_user()
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
    argv = _spawn_argv(argv, user, kw, pty is not None)
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
                kw["preexec_fn"] = _set_ctty  # no setsid(1) in this template: the slow fork path
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
            _close(fd)
        raise
    finally:
        for fd in child_fds:
            _close(fd)
    pump.add(cmd)
    return {"pid": cmd.pid, "started_at": cmd.started_at}


_SELF: list[User] = []


def _self_user() -> User:
    if not _SELF:
        try:
            _SELF.append(resolve_user(os.getuid()))
        except GuestError:
            _SELF.append(User(os.getuid(), os.getgid(), [], str(os.getuid()), "/"))
    return _SELF[0]


def _set_winsize(fd: int, size: Header) -> None:
    import fcntl
    import struct
    import termios

    rows = _arg(size, "rows", int, 24)
    cols = _arg(size, "cols", int, 80)
    if not (0 < rows < 65536 and 0 < cols < 65536):
        raise GuestError("invalid_request", "rows/cols out of range")
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _command(d: Daemon, h: Header) -> Command:
    cid = h.get("cmd")
    with d.lock:
        cmd = d.commands.get(cid) if isinstance(cid, str) else None
    if cmd is None or cmd.pid == 0:
        raise GuestError("not_found", f"no command {cid!r}")
    return cmd


def op_signal(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
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


def op_resize(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    cmd = _command(d, h)
    with d.lock:
        master = cmd.master
    if not cmd.pty:
        raise GuestError("invalid_request", f"command {cmd.id} has no pty")
    if master is None:
        raise GuestError("invalid_state", f"command {cmd.id} has exited")
    _set_winsize(master, h)
    return {}


def op_list(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    with d.lock:
        cmds = [c.describe() for c in d.commands.values() if c.pid]
    return {"commands": cmds}


def op_forget(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
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


def op_replay(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    cmd = _command(d, h)
    after = _arg(h, "after", int, 0)
    after_off = _arg(h, "after_off", int)
    with d.lock:
        events = [e for e in cmd.events if e[0]["seq"] > after]
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
    return {"last_seq": last_seq, "state": state}


def op_fs_read(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    import stat as st

    path = norm_path(h.get("path"))
    offset = _arg(h, "offset", int, 0)
    length = _arg(h, "length", int)
    if offset < 0 or (length is not None and length < 0):
        raise GuestError("invalid_request", "offset and length must not be negative")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        s = os.fstat(fd)
        if st.S_ISDIR(s.st_mode):
            raise GuestError("invalid_request", f"{path} is a directory")
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        sent = 0
        while length is None or sent < length:
            want = protocol.MAX_PAYLOAD if length is None else min(protocol.MAX_PAYLOAD, length - sent)
            data = os.read(fd, want)
            if not data:
                break
            d.writer.send({"t": "chunk", "id": rid}, data)
            sent += len(data)
    finally:
        os.close(fd)
    return {"size": s.st_size, "read": sent}


def op_fs_write(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    import queue

    with d.lock:
        up = d.uploads.get(rid)
    if up is None:
        raise GuestError("invalid_request", "duplicate or missing upload id")
    path = norm_path(h.get("path"))
    mode = _arg(h, "mode", int, 0o644) & 0o7777
    mkdirs = bool(h.get("mkdirs", True))
    user = resolve_user(h["user"]) if h.get("user") is not None else None
    if path == "/":
        raise GuestError("invalid_path", "cannot write to /")
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise GuestError("conflict", f"{path} is a directory")
    if mkdirs:
        _makedirs(parent, user)
    elif not os.path.isdir(parent):
        raise GuestError("not_found", f"directory not found: {parent}")
    tmp = os.path.join(parent, f".space-upload-{os.urandom(8).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        idle_since = time.monotonic()
        while True:
            if up.aborted:
                raise GuestError("invalid_request", "upload aborted")
            try:
                item = up.q.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() - idle_since > UPLOAD_IDLE:
                    raise GuestError("invalid_request", "upload stalled") from None
                continue
            idle_since = time.monotonic()
            if item is None:
                raise GuestError("invalid_request", "upload aborted")
            data, eof = item
            if data:
                _write_all(fd, data)
            if eof:
                break
        os.fchmod(fd, mode)
        if user is not None:
            os.fchown(fd, user.uid, user.gid)
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
    except BaseException:
        if fd >= 0:
            _close(fd)
        try:  # noqa: SIM105 -- contextlib costs boot time
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return {"entry": file_entry(path)}


def op_fs_stat(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    return {"entry": file_entry(norm_path(h.get("path")))}


def op_fs_list(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    import stat as st

    path = norm_path(h.get("path"))
    depth = _arg(h, "depth", int, 1)
    if depth < 1:
        raise GuestError("invalid_request", "depth must be at least 1")
    if not st.S_ISDIR(os.stat(path).st_mode):
        raise GuestError("invalid_request", f"{path} is not a directory")
    entries: list[Header] = []
    truncated = False

    def walk(directory: str, level: int) -> None:
        nonlocal truncated
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            if directory == path:
                raise
            return  # an unreadable subdirectory does not spoil the listing
        for name in names:
            if len(entries) >= MAX_LIST_ENTRIES:
                truncated = True
                return
            child = os.path.join(directory, name)
            try:
                entry = file_entry(child)
            except OSError:
                continue
            entries.append(entry)
            if level > 1 and entry["type"] == "dir":
                walk(child, level - 1)

    walk(path, depth)
    return {"entries": entries, "truncated": truncated}


def op_fs_mkdir(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    path = norm_path(h.get("path"))
    user = resolve_user(h["user"]) if h.get("user") is not None else None
    if os.path.isdir(path):
        return {"entry": file_entry(path)}
    if os.path.lexists(path):
        raise GuestError("conflict", f"{path} exists and is not a directory")
    if h.get("parents", True):
        _makedirs(path, user)
    else:
        os.mkdir(path, 0o755)
        if user is not None:
            os.chown(path, user.uid, user.gid)
    return {"entry": file_entry(path)}


def op_fs_move(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    src = norm_path(h.get("src"), "src")
    dst = norm_path(h.get("dst"), "dst")
    if src == "/" or dst == "/":
        raise GuestError("invalid_path", "cannot move /")
    if not os.path.lexists(src):
        raise GuestError("not_found", f"not found: {src}")
    if os.path.isdir(dst) and not os.path.islink(dst):
        raise GuestError("conflict", f"{dst} exists and is a directory")
    if (dst + "/").startswith(src + "/"):
        raise GuestError("invalid_request", "cannot move a directory into itself")
    if not os.path.isdir(os.path.dirname(dst)):
        raise GuestError("not_found", f"directory not found: {os.path.dirname(dst)}")
    try:
        os.rename(src, dst)
    except OSError as exc:
        import errno

        if exc.errno != errno.EXDEV:
            raise
        import shutil

        shutil.move(src, dst)
    return {"entry": file_entry(dst)}


def op_fs_remove(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    import stat as st

    path = norm_path(h.get("path"))
    if path == "/":
        raise GuestError("forbidden", "cannot remove /")
    s = os.lstat(path)
    if st.S_ISDIR(s.st_mode):
        if h.get("recursive"):
            import shutil

            shutil.rmtree(path)
        else:
            try:
                os.rmdir(path)
            except OSError as exc:
                import errno

                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise GuestError("conflict", f"directory not empty: {path}") from None
                raise
    else:
        os.unlink(path)
    return {}


_OPS: dict[str, Callable[[Daemon, Any, Header, bytes], Header]] = {
    "hello": op_hello, "activity": op_activity, "exec": op_exec, "signal": op_signal,
    "resize": op_resize, "list": op_list, "forget": op_forget, "replay": op_replay,
    "fs.read": op_fs_read, "fs.write": op_fs_write, "fs.stat": op_fs_stat, "fs.list": op_fs_list,
    "fs.mkdir": op_fs_mkdir, "fs.move": op_fs_move, "fs.remove": op_fs_remove,
}
#: Answered on the reader thread: no waiting on anything but the channel itself.
_INLINE = frozenset({"hello", "activity", "list", "signal", "resize", "forget"})


def main() -> None:
    d = Daemon()
    d.announce()
    if os.getpid() != 1:
        import signal

        def _term(signum: int, frame: Any) -> None:
            d.shutdown()
            os._exit(0)

        signal.signal(signal.SIGTERM, _term)
    d.serve()


if __name__ == "__main__":
    main()
