"""Per-sandbox shim: holds the host ends of the guest daemon's stdin/stdout pipes.

    python3 -m space.runtime.shim --socket PATH --to-guest-fd N --from-guest-fd M [--pidfile PATH]

The node agent may restart at any time; the pipes must not die with it. This process keeps them and
offers them on a unix socket (mode 0600) to one client at a time: a new connection replaces the old
one. It forwards whole frames only (:mod:`space.guest.protocol` length prefixes), so switching clients
never splits a frame: a client's partial last frame is discarded, and guest frames that arrive while
nobody is connected are dropped (the guest keeps a replay buffer; a new client says ``hello``).

One thread, one selector. Writes to the guest block (it reads promptly); reads from the guest stop
while the client's outgoing buffer is full, so a slow client backs up into the guest instead of
into this process's memory. Exits, removing its socket and pidfile, when the guest's stdout ends.
Standard library only, and little of it: one runs per sandbox.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
from typing import Any

from space.guest import protocol

CLIENT_BUFFER = 8 << 20
READ_SIZE = 256 * 1024


def _log(msg: str) -> None:
    try:  # noqa: SIM105 -- stderr may be gone; logging must never kill the shim
        os.write(2, f"space-shim[{os.getpid()}]: {msg}\n".encode(errors="replace"))
    except OSError:
        pass


def complete_frames(buf: bytearray) -> int:
    """Length of the longest prefix of ``buf`` made of whole frames; skips garbage in place."""
    pos = 0
    while len(buf) - pos >= 8:
        try:
            rest, _ = protocol.decode_lengths(bytes(buf[pos : pos + 8]))
        except protocol.ProtocolError as exc:
            skip = protocol.resync(buf, pos + 1)
            _log(f"dropping {skip - pos} bytes that are not a frame ({exc})")
            del buf[pos:skip]
            continue
        if len(buf) - pos < 8 + rest:
            break
        pos += 8 + rest
    return pos


class Shim:
    def __init__(self, socket_path: str, to_guest: int, from_guest: int) -> None:
        self.path = socket_path
        self.to_guest = to_guest
        self.from_guest = from_guest
        os.set_blocking(to_guest, True)
        os.set_blocking(from_guest, False)
        self.sel = selectors.DefaultSelector()
        self.listener = self._listen(socket_path)
        self.client: socket.socket | None = None
        self.cin = bytearray()  # client -> guest, partial frame
        self.cout = bytearray()  # guest -> client, whole frames
        self.gin = bytearray()  # guest -> us, partial frame
        self.reading_guest = True
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(from_guest, selectors.EVENT_READ, "guest")

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

    def run(self) -> None:
        while True:
            for key, mask in self.sel.select():
                what = key.data
                if what == "accept":
                    self._accept()
                elif what == "guest":
                    if not self._from_guest():
                        return
                elif what == "client" and self.client is not None:
                    if mask & selectors.EVENT_READ:
                        self._from_client()
                    if self.client is not None and mask & selectors.EVENT_WRITE:
                        self._flush()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if self.client is not None:
            self._drop_client("replaced by a new connection")
        conn.setblocking(False)
        self.client = conn
        self.sel.register(conn, selectors.EVENT_READ, "client")

    def _drop_client(self, why: str) -> None:
        assert self.client is not None
        self.sel.unregister(self.client)
        self.client.close()
        self.client = None
        self.cin.clear()
        self.cout.clear()
        _log(f"client closed: {why}")
        self._pace_guest()

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
                self._flush()
        self._pace_guest()
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
            self._write_guest(bytes(self.cin[:n]))
            del self.cin[:n]

    def _write_guest(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self.to_guest, view[: protocol.MAX_WRITE])
            except InterruptedError:
                continue
            except OSError as exc:
                # The guest's stdin is gone; its stdout ending will stop us.
                _log(f"guest write failed: {exc}")
                return
            view = view[written:]

    def _flush(self) -> None:
        assert self.client is not None
        while self.cout:
            try:
                n = self.client.send(self.cout[:READ_SIZE * 4])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._drop_client(str(exc))
                return
            del self.cout[:n]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.cout else 0)
        self.sel.modify(self.client, events, "client")
        self._pace_guest()

    def _pace_guest(self) -> None:
        """Read the guest only while the client's buffer has room (no client: read and drop)."""
        want = len(self.cout) < CLIENT_BUFFER
        if want != self.reading_guest:
            self.reading_guest = want
            if want:
                self.sel.register(self.from_guest, selectors.EVENT_READ, "guest")
            else:
                self.sel.unregister(self.from_guest)

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
    return vars(p.parse_args(argv))


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    pidfile: str | None = args["pidfile"]
    shim = Shim(args["socket"], args["to_guest_fd"], args["from_guest_fd"])
    try:
        if pidfile:
            with open(pidfile + ".tmp", "w") as f:
                f.write(f"{os.getpid()}\n")
            os.replace(pidfile + ".tmp", pidfile)
        shim.run()
        shim.flush_out()
        _log("guest stdout ended; exiting")
    finally:
        shim.close()
        if pidfile:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pidfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
