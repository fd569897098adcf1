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
  With ``max_bytes`` it answers one page (``more: true`` when events are left for the next one).
- ``list`` entries add ``out_bytes``, ``unacked`` and ``buffered_bytes``.
- Exited commands' buffers share EXITED_BUFFERS; the oldest are trimmed (a replay then shows a gap).

This module is the channel: it reads frames, dispatches requests and owns the main loop. The rest
lives beside it: guest_base.py (errors, log, frame writer, argument checks), guest_procs.py (the
process table: replay buffers, reaping, stdin, acks), guest_pump.py (output and flow control),
guest_exec.py (exec and the other command requests), guest_files.py (``fs.*``), guest_watch.py
(``watch.*``, directory watchers), guest_users.py (users, identity, spawn argv). Inside the sandbox
they are top-level modules found through the sys.path entry added below (or by boot.py); on the host
they are ``space.guest.*``. They never import this module at run time: it may be running as
``__main__``, and a second copy of it would mean a second daemon state.
"""

from __future__ import annotations

import time

_T0 = time.monotonic()

import os  # noqa: E402 -- the boot timestamp above must come first
import sys  # noqa: E402
import threading  # noqa: E402

if __package__:
    from . import guest_ca, guest_caps, protocol
    from .guest_base import GuestError, log, norm_path, os_error
    from .guest_exec import OPS as EXEC_OPS
    from .guest_files import OPS as FS_OPS
    from .guest_files import Upload
    from .guest_procs import ProcessTable
    from .guest_watch import OPS as WATCH_OPS
else:  # run as a script inside the sandbox: protocol.py and the guest_* modules sit beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import guest_ca  # type: ignore[no-redef, import-not-found]
    import guest_caps  # type: ignore[no-redef, import-not-found]
    import protocol  # type: ignore[no-redef, import-not-found]
    from guest_base import GuestError, log, norm_path, os_error  # type: ignore[no-redef, import-not-found]
    from guest_exec import OPS as EXEC_OPS  # type: ignore[no-redef, import-not-found]
    from guest_files import OPS as FS_OPS  # type: ignore[no-redef, import-not-found]
    from guest_files import Upload  # type: ignore[no-redef]
    from guest_procs import ProcessTable  # type: ignore[no-redef, import-not-found]
    from guest_watch import OPS as WATCH_OPS  # type: ignore[no-redef, import-not-found]

#: Read as true by type checkers only: importing typing (and collections.abc) costs 10-20 ms of boot
#: under gVisor, more than everything else the daemon imports but json and threading.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .guest_base import Header

__all__ = ["Daemon", "GuestError", "main", "norm_path"]

VERSION = protocol.PROTOCOL_VERSION


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


# ---------------------------------------------------------------------------------------- daemon


class Daemon(ProcessTable):
    """The process table plus the channel: reads requests, answers them, feeds uploads."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads: dict[Any, Upload] = {}
        self.pool = Pool()
        self.boot_ms = 0.0

    # -- startup ------------------------------------------------------------------------------

    def announce(self) -> None:
        self.boot_ms = round((time.monotonic() - _T0) * 1000, 3)
        self.writer.send({"t": "ev", "kind": "ready", "version": VERSION, "boot_ms": self.boot_ms,
                          "pid": os.getpid()})
        # Warm the modules the first exec needs, off the critical path.
        threading.Thread(target=_warm_imports, name="warm", daemon=True).start()

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
            op = h.get("op")
            rid = h.get("id")
            if op not in _PASSIVE:
                self.last_activity = time.time()
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
            self.writer.reply(rid, result)
        except GuestError as exc:
            self.writer.fail(rid, exc.code, exc.message)
        except OSError as exc:
            err = os_error(exc)
            self.writer.fail(rid, err.code, err.message)
        except (KeyError, TypeError, ValueError) as exc:
            self.writer.fail(rid, "invalid_request", f"bad arguments for {op}: {exc!r}")
        except Exception as exc:
            log(f"{op} failed: {exc!r}")
            self.writer.fail(rid, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            if op == "fs.write":
                with self.lock:
                    up = self.uploads.pop(rid, None)
                if up is not None:
                    up.drain()  # frees the reader if it is blocked on this upload's full queue

    def on_hello(self) -> None:
        """A new host connected: whatever the old one did not ack is gone; its uploads are dead."""
        with self.lock:
            for cmd in self.commands.values():
                cmd.acked = cmd.sent
            for up in self.uploads.values():
                up.aborted = True
        if self.pump is not None:
            self.pump.wake()


# ---------------------------------------------------------------------------------------- ops


#: Standard library modules the daemon imports only when a command needs them, warmed at boot. A
#: template built from a container image is checked to have them all (the image_check script in
#: space/node/helper/build_scripts.py), as well as every module here.
LATE_IMPORTS = ("fcntl", "pwd", "select", "signal", "subprocess", "termios")


def _warm_imports() -> None:
    try:
        for name in LATE_IMPORTS:
            __import__(name)
    except ImportError:
        pass
    guest_caps.load()  # ctypes, for the first command's thread to shed CAP_SYS_RESOURCE


def _offer_sudo(d: Daemon) -> None:
    """Listen for ``sudo`` (guest_sudo.py), off the boot's critical path: its imports cost time."""
    try:
        if __package__:
            from . import guest_sudo
        else:
            import guest_sudo  # type: ignore[no-redef, import-not-found]
        guest_sudo.SudoService(d).start()
    except Exception as exc:  # a sandbox without sudo still serves everything else
        log(f"sudo: not offered: {type(exc).__name__}: {exc}")


def op_hello(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    return {"version": VERSION, "boot_ms": d.boot_ms, "uptime": time.monotonic() - _T0,
            "last_activity": d.last_activity, "running": d.running(), "pid": os.getpid()}


def op_activity(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    return {"last_activity": d.last_activity, "running": d.running()}


_OPS: dict[str, Callable[[Daemon, Any, Header, bytes], Header]] = {
    "hello": op_hello, "activity": op_activity, **EXEC_OPS, **FS_OPS,
    **WATCH_OPS,
}
#: Requests that are the platform looking, not someone using the sandbox: they do not reset idleness.
_PASSIVE = frozenset({"hello", "activity", "list", "watch.poll", "watch.list"})
#: Answered on the reader thread: no waiting on anything but the channel itself.
_INLINE = frozenset({"hello", "activity", "list", "signal", "resize", "forget", "watch.poll", "watch.remove",
                     "watch.list"})


def _ignore(signum: int, frame: Any) -> None:
    pass


def reset_inherited_signals() -> None:
    """Give commands default signals, whatever this daemon inherited. A signal ignored by our parent
    stays ignored across exec (``nohup``, ``cmd &`` in a non-interactive shell, CI runners), and so
    does a blocked one: every command would then shrug off SIGINT (or never see a blocked SIGTERM).
    Unblock everything, and ignore what we inherited as ignored with a handler that does nothing:
    a handler, unlike SIG_IGN, is reset to the default in every child at exec. (SIGPIPE and SIGXFSZ
    are Python's own, and subprocess restores them.) ``_signal``, not ``signal``: no enum at boot."""
    import _signal  # type: ignore[import-not-found]  # no stubs; the same functions as signal

    _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
    for sig in _signal.valid_signals():
        if sig in (_signal.SIGKILL, _signal.SIGSTOP, _signal.SIGPIPE, _signal.SIGXFSZ):
            continue
        try:
            if _signal.getsignal(sig) == _signal.SIG_IGN:
                _signal.signal(sig, _ignore)
        except (OSError, ValueError):  # not catchable here (e.g. the runtime's reserved ones)
            pass


def main() -> None:
    reset_inherited_signals()  # before any thread: threads inherit the mask of their creator
    d = Daemon()
    if os.getpid() == 1:
        # Before announcing: the first command already trusts the egress gateway's CA.
        try:
            outcome = guest_ca.install()
        except OSError as exc:
            outcome = f"failed: {exc}"
        if outcome not in ("none", "present", "added", "created"):
            log(f"egress CA not added to the system bundle ({outcome})")
    d.announce()
    if os.getpid() == 1:
        threading.Thread(target=_offer_sudo, args=(d,), name="sudo-start", daemon=True).start()
    if os.getpid() != 1:
        import signal

        def _term(signum: int, frame: Any) -> None:
            d.shutdown()
            os._exit(0)

        signal.signal(signal.SIGTERM, _term)
    d.serve()


if __name__ == "__main__":
    main()
