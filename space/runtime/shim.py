"""Per-sandbox shim: holds the host ends of the guest daemon's stdin/stdout pipes.

    python3 -m space.runtime.shim --socket PATH --to-guest-fd N --from-guest-fd M [--pidfile PATH]

The node agent may restart at any time; the pipes must not die with it. This process keeps them and
offers them on a unix socket (mode 0600) to one client at a time: a new connection replaces the old
one. It forwards whole frames only (:mod:`space.guest.protocol` length prefixes), so switching clients
never splits a frame: a client's partial last frame is discarded, and guest frames that arrive while
nobody is connected are dropped (the guest keeps a replay buffer; a new client says ``hello``).

One thread, one selector, no blocking I/O: reading the guest never waits for a write to the guest
(the guest may answer a request while we still have frames for it; blocking here could deadlock).
Reads from the guest stop while the client's outgoing buffer is full, and reads from the client stop
while the guest's is, so a slow side backs up into its peer instead of into this process's memory.
The guest is not trusted (root inside the sandbox can write anything to the channel), and nothing it
writes grows this process: a partial frame is at most ``protocol.MAX_FRAME`` bytes (a longer length
is garbage, skipped to the next plausible frame), frames for the client at most CLIENT_BUFFER plus
one read, and the log of skipped garbage GARBAGE_LINES lines.
Exits, removing its socket and pidfile, when the guest's stdout ends. Standard library only, and
little of it: one runs per sandbox.

With ``--lease-file``, the shim is also the sandbox's last line of fencing (:class:`LeaseWatch`):
the node agent publishes when its lease with the control plane ends, and a shim that sees that
moment pass (plus :data:`GRACE`, the agent's own chance to fence first) freezes its instance
through the cgroup freezer and leaves a mark for the agent. The agent names the freezer file and
what to write into it (``--freeze-file``, ``--freeze-value``: v1's ``freezer.state`` and ``FROZEN``,
v2's ``cgroup.freeze`` and ``1``); the shim knows nothing of cgroup versions. So a node agent that is stopped, hung
or dead, while its sandboxes live on, cannot leave a copy running that the control plane restores
elsewhere.
"""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import signal
import socket
import stat
import sys
import time
from typing import Any

from space.guest import protocol

CLIENT_BUFFER = 8 << 20
#: Frames for the guest waiting for room in its stdin pipe; past this, stop reading the client.
GUEST_BUFFER = 1 << 20
READ_SIZE = 256 * 1024
PIPE_SIZE = 1 << 20


def _log(msg: str) -> None:
    try:  # noqa: SIM105 -- stderr may be gone; logging must never kill the shim
        os.write(2, f"space-shim[{os.getpid()}]: {msg}\n".encode(errors="replace"))
    except OSError:
        pass


#: Garbage the shim reports line by line; past that only the total, on exit. The guest decides how
#: much garbage there is, and it must not fill the node's disk through the shim's log.
GARBAGE_LINES = 100
_garbage = {"reports": 0, "bytes": 0}


def _garbage_dropped(n: int, why: object) -> None:
    _garbage["reports"] += 1
    _garbage["bytes"] += n
    if _garbage["reports"] <= GARBAGE_LINES:
        last = " (further drops are only counted)" if _garbage["reports"] == GARBAGE_LINES else ""
        _log(f"dropping {n} bytes that are not a frame ({why}){last}")


def _grow_pipe(fd: int) -> None:
    """Roomier pipes: the guest writes (and reads) more per wakeup, which is what costs under gVisor."""
    try:
        import fcntl

        fcntl.fcntl(fd, 1031, PIPE_SIZE)  # F_SETPIPE_SZ
    except OSError as exc:
        _log(f"cannot grow pipe {fd}: {exc}")


def complete_frames(buf: bytearray) -> int:
    """Length of the longest prefix of ``buf`` made of whole frames; skips garbage in place."""
    pos = 0
    while len(buf) - pos >= 8:
        try:
            rest, _ = protocol.decode_lengths(bytes(buf[pos : pos + 8]))
        except protocol.ProtocolError as exc:
            skip = protocol.resync(buf, pos + 1)
            _garbage_dropped(skip - pos, exc)
            del buf[pos:skip]
            continue
        if len(buf) - pos < 8 + rest:
            break
        pos += 8 + rest
    return pos


#: Seconds past the lease's end before the shim freezes: the agent, when it runs, fences first.
GRACE = 2.5
#: Seconds between the shim's looks at the lease.
CHECK_EVERY = 0.5
#: The lease file holds one number; anything longer is not ours.
LEASE_FILE_MAX = 64


def boottime() -> float:
    """The clock the agent publishes the lease end on: shared by every process, never set back."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def read_lease_end(path: str) -> float | None:
    """The lease end the agent published, or None (no lease, or a file that is not a plain number).
    Never follows a symlink and never blocks (a FIFO planted there must not stop the shim)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, LEASE_FILE_MAX + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > LEASE_FILE_MAX:
        return None
    try:
        end = float(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    return end if math.isfinite(end) else None


#: What the shim may write into a freeze file: cgroup v1's ``freezer.state`` and v2's ``cgroup.freeze``
#: take these to freeze.
FREEZE_VALUES = ("FROZEN", "1")


class LeaseWatch:
    """Freeze the instance once the node's published lease has run out: once per lease end, so a
    sandbox the agent thaws (it is told the node still owns it) is not frozen again for the same
    lapse, and one being stopped is not refrozen under ``runsc``'s feet."""

    def __init__(self, lease_file: str, freeze_file: str, mark_file: str, *, grace: float = GRACE,
                 freeze_value: str = "FROZEN") -> None:
        if freeze_value not in FREEZE_VALUES:
            raise ValueError(f"not a freezing value: {freeze_value!r}")
        self.lease_file, self.freeze_file, self.mark_file, self.grace = lease_file, freeze_file, mark_file, grace
        self.freeze_value = freeze_value
        self.froze_for: float | None = None
        self.next_check = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + CHECK_EVERY
        self.check()

    def check(self) -> bool:
        """Whether it froze the instance now."""
        end = read_lease_end(self.lease_file)
        if end is None or end == self.froze_for or boottime() < end + self.grace:
            return False
        try:
            self._freeze()
        except OSError as exc:  # no cgroup (the instance is gone): nothing runs to freeze
            _log(f"lease over but cannot freeze: {exc}")
            return False
        self.froze_for = end
        try:
            tmp = self.mark_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{end!r}\n")
            os.replace(tmp, self.mark_file)
        except OSError as exc:
            _log(f"froze, but cannot leave the fence mark: {exc}")
        _log(f"the node's lease ended {boottime() - end:.1f}s ago: instance frozen")
        return True

    def _freeze(self) -> None:
        # An existing file only, never through a symlink: a cgroup file that is not there means no
        # cgroup (the instance is gone), and creating a plain file in its place would freeze nothing.
        fd = os.open(self.freeze_file, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, self.freeze_value.encode())
        finally:
            os.close(fd)


class Shim:
    def __init__(self, socket_path: str, to_guest: int, from_guest: int,
                 watch: LeaseWatch | None = None) -> None:
        self.watch = watch
        self.path = socket_path
        self.to_guest = to_guest
        self.from_guest = from_guest
        os.set_blocking(to_guest, False)
        os.set_blocking(from_guest, False)
        for fd in (to_guest, from_guest):
            _grow_pipe(fd)
        self.sel = selectors.DefaultSelector()
        self.listener = self._listen(socket_path)
        self.client: socket.socket | None = None
        self.cin = bytearray()  # client -> us, up to a partial frame
        self.gout = bytearray()  # -> guest, whole frames (a client's partial frame never gets here)
        self.gin = bytearray()  # guest -> us, up to a partial frame
        self.cout = bytearray()  # -> client, whole frames
        self.guest_broken = False
        self._interest: dict[Any, int] = {}
        self._want(self.listener, selectors.EVENT_READ)
        self._update()

    @staticmethod
    def _listen(path: str) -> socket.socket:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: no window where others could connect
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(4)
        sock.setblocking(False)
        return sock

    def _want(self, obj: Any, events: int) -> None:
        have = self._interest.get(obj, 0)
        if events == have:
            return
        if not events:
            self.sel.unregister(obj)
            del self._interest[obj]
        elif not have:
            self.sel.register(obj, events)
            self._interest[obj] = events
        else:
            self.sel.modify(obj, events)
            self._interest[obj] = events

    def _update(self) -> None:
        """Interest follows the buffers: backpressure instead of growing memory, both ways."""
        r, w = selectors.EVENT_READ, selectors.EVENT_WRITE
        self._want(self.from_guest, r if len(self.cout) < CLIENT_BUFFER else 0)
        self._want(self.to_guest, w if self.gout and not self.guest_broken else 0)
        if self.client is not None:
            self._want(self.client, (r if len(self.gout) < GUEST_BUFFER else 0) | (w if self.cout else 0))

    def run(self) -> None:
        timeout = CHECK_EVERY if self.watch is not None else None
        while True:
            if self.watch is not None:
                self.watch.tick()
            for key, mask in self.sel.select(timeout):
                obj = key.fileobj
                if obj is self.listener:
                    self._accept()
                elif obj == self.from_guest:
                    if not self._from_guest():
                        return
                elif obj == self.to_guest:
                    self._to_guest()
                elif obj is self.client:
                    if mask & selectors.EVENT_READ:
                        self._from_client()
                    if self.client is not None and mask & selectors.EVENT_WRITE:
                        self._to_client()
            self._update()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if self.client is not None:
            self._drop_client("replaced by a new connection")
        conn.setblocking(False)
        self.client = conn

    def _drop_client(self, why: str) -> None:
        assert self.client is not None
        self._want(self.client, 0)
        self.client.close()
        self.client = None
        self.cin.clear()
        self.cout.clear()
        _log(f"client closed: {why}")

    def _from_guest(self) -> bool:
        try:
            data = os.read(self.from_guest, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            _log(f"guest read failed: {exc}")
            data = b""
        if not data:
            return False
        self.gin += data
        n = complete_frames(self.gin)
        if n:
            if self.client is not None:
                self.cout += self.gin[:n]
            del self.gin[:n]
            if self.client is not None:
                self._to_client()
        return True

    def _from_client(self) -> None:
        assert self.client is not None
        try:
            data = self.client.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop_client(str(exc))
            return
        if not data:
            self._drop_client("disconnected")
            return
        self.cin += data
        n = complete_frames(self.cin)
        if n:
            self.gout += self.cin[:n]
            del self.cin[:n]
            self._to_guest()

    def _to_guest(self) -> None:
        while self.gout and not self.guest_broken:
            try:
                n = os.write(self.to_guest, self.gout[: protocol.MAX_WRITE])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # The guest's stdin is gone; its stdout ending will stop us.
                _log(f"guest write failed: {exc}")
                self.guest_broken = True
                self.gout.clear()
                return
            del self.gout[:n]

    def _to_client(self) -> None:
        assert self.client is not None
        while self.cout:
            try:
                n = self.client.send(self.cout[: READ_SIZE * 4])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._drop_client(str(exc))
                return
            del self.cout[:n]

    def flush_out(self, timeout: float = 2.0) -> None:
        """Best effort: hand the client the guest's last frames (its final exit events)."""
        if self.client is None or not self.cout:
            return
        try:
            self.client.settimeout(timeout)
            self.client.sendall(self.cout)
        except OSError:
            pass
        self.cout.clear()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _parse(argv: list[str]) -> dict[str, Any]:
    import argparse

    p = argparse.ArgumentParser(prog="space.runtime.shim")
    p.add_argument("--socket", required=True)
    p.add_argument("--to-guest-fd", type=int, required=True)
    p.add_argument("--from-guest-fd", type=int, required=True)
    p.add_argument("--pidfile")
    p.add_argument("--lease-file", help="where the node agent publishes its lease's end (CLOCK_BOOTTIME)")
    p.add_argument("--freeze-file", help="the instance's cgroup freezer file (v1 freezer.state, v2 cgroup.freeze)")
    p.add_argument("--freeze-value", default="FROZEN", choices=FREEZE_VALUES,
                   help="what freezes it, written into --freeze-file (v1 FROZEN, the default; v2 1)")
    p.add_argument("--fence-mark", help="written when this shim froze the instance")
    args = vars(p.parse_args(argv))
    given = [args[k] is not None for k in ("lease_file", "freeze_file", "fence_mark")]
    if any(given) and not all(given):
        p.error("--lease-file, --freeze-file and --fence-mark go together")
    return args


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    pidfile: str | None = args["pidfile"]
    watch = (LeaseWatch(args["lease_file"], args["freeze_file"], args["fence_mark"],
                        freeze_value=args["freeze_value"])
             if args["lease_file"] is not None else None)
    shim = Shim(args["socket"], args["to_guest_fd"], args["from_guest_fd"], watch)
    try:
        if pidfile:
            with open(pidfile + ".tmp", "w") as f:
                f.write(f"{os.getpid()}\n")
            os.replace(pidfile + ".tmp", pidfile)
        shim.run()
        shim.flush_out()
        if _garbage["reports"] > GARBAGE_LINES:
            _log(f"dropped {_garbage['bytes']} bytes that were not frames in {_garbage['reports']} places")
        _log("guest stdout ended; exiting")
    finally:
        shim.close()
        if pidfile:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pidfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
