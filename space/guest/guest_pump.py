"""The output pump: one thread reading every command's output, lingering to fill frames, and
pausing a command whose unacked output fills its window (ack-based flow control)."""

from __future__ import annotations

import os
import threading
import time

if __package__:
    from . import protocol
    from .guest_base import close_fd, poke
else:  # top-level inside the sandbox: daemon.py put this directory on sys.path
    import protocol  # type: ignore[no-redef, import-not-found]
    from guest_base import close_fd, poke  # type: ignore[no-redef, import-not-found]

TYPE_CHECKING = False  # type checkers read it as true; importing typing costs boot time (see daemon.py)
if TYPE_CHECKING:
    from .guest_procs import Command, ProcessTable

WINDOW = 4 << 20
#: Seconds without ack progress after which a stalled command runs on unthrottled (host gone).
STALL_TIMEOUT = float(os.environ.get("SPACE_GUEST_STALL_TIMEOUT", "30"))
#: A stream that produced output within BUSY seconds waits up to LINGER seconds to fill a frame:
#: per-frame costs dominate bulk throughput, while a lone keystroke echo still goes out at once.
BUSY = 0.005
LINGER = 0.002


class Pump(threading.Thread):
    """Reads every command's output through one epoll, stopping a command when its window is full."""

    def __init__(self, daemon: ProcessTable) -> None:
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
        poke(self.wake_w)

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
                    close_fd(fd)
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
