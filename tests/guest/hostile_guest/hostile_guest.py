"""A hostile guest daemon: PID 1 of a real sandbox, speaking the protocol's framing maliciously.

    python3 -I -S /opt/hostile/hostile_guest.py

Standard library only, like the real daemon; protocol.py comes from /opt/space/guest. It answers
``hello`` as the real daemon does (so the node connects), then does what each request asks of it,
maliciously. Requests (``op``):

- ``forge``: events for command ids nobody started, answers and chunks for request ids nobody made,
  in batches as fast as the channel takes them.
- ``exec``: answers like the daemon, then floods that command's output (events of ``size`` bytes,
  ignoring every ack); a ``replay`` of it is answered with endless chunks (and never ends).
- ``fs.list``: endless part chunks before the answer.
- ``garbage``: lengths beyond the protocol, bytes that are not frames, frames cut short, each burst
  followed by one valid event (so the shim keeps resyncing).
Each flood runs until ``stop`` (``frames``: sends that many, then waits for ``stop``).
- ``partial``: begins a frame and never finishes it, trickling its bytes until ``stop``.
- ``stop``: ends whatever flood is running.
Floods answer their request first (``ok``; ``fs.list`` and ``replay`` only after) and run in the
background; ``hello`` says whether one still runs (``flooding``), after all of its frames so far.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time

sys.path.insert(0, "/opt/space/guest")
import protocol  # type: ignore[import-not-found]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_lock = threading.RLock()
_stop = threading.Event()
_active = [0]  # floods running (``hello`` says ``flooding``: its answer comes after their frames)


def in_background(target: Any, *args: Any) -> None:
    def run() -> None:
        try:
            target(*args)
        finally:
            with _lock:
                _active[0] -= 1

    with _lock:
        _active[0] += 1
    threading.Thread(target=run, daemon=True).start()


def write(data: bytes) -> None:
    """At most 64 KiB per write (gVisor stalls larger pipe writes), whole buffers under one lock."""
    view = memoryview(data)
    with _lock:
        while view:
            n = os.write(1, view[: protocol.MAX_WRITE])
            view = view[n:]


def send(header: dict[str, Any], payload: bytes = b"") -> None:
    write(protocol.encode(header, payload))


def flood(frames: Any) -> None:
    buf = bytearray()
    for header, payload in frames:
        if _stop.is_set():
            break
        buf += protocol.encode(header, payload)
        if len(buf) >= 60_000:
            write(bytes(buf))
            buf.clear()
    if buf:
        write(bytes(buf))
    _stop.wait()  # a capped flood still counts as running until ``stop``


def reply(h: dict[str, Any], **result: Any) -> None:
    send({"t": "res", "id": h.get("id"), "ok": True, **result})


def upto(n: int | None) -> Any:
    return itertools.count() if n is None else range(n)


def forge(n: int | None) -> None:
    def frames() -> Any:
        for i in upto(n):
            k = i % 3
            if k == 0:
                yield {"t": "ev", "kind": "out", "cmd": f"forged-{i}", "seq": 1, "fd": 1, "off": 0}, b"x"
            elif k == 1:
                yield {"t": "res", "id": 10**12 + i, "ok": True, "junk": "y" * 64}, b""
            else:
                yield {"t": "chunk", "id": 10**12 + i, "part": "entries", "entries": [{}] * 32}, b""
    flood(frames())


def flood_output(cid: str, n: int | None, size: int) -> None:
    payload = b"o" * size
    flood(({"t": "ev", "kind": "out", "cmd": cid, "seq": i + 1, "fd": 1, "off": i * size}, payload)
          for i in upto(n))


def endless_list(rid: Any, n: int | None) -> None:
    entry = {"name": "e" * 200, "path": "/" + "p" * 200, "type": "file", "size": 1}
    flood(({"t": "chunk", "id": rid, "part": "entries", "entries": [entry] * 100}, b"") for _ in upto(n))
    send({"t": "res", "id": rid, "ok": True, "entries": []})


def garbage(n: int | None) -> None:
    good = protocol.encode({"t": "ev", "kind": "activity"})
    bursts = [
        b"\xff\xff\xff\xf0" + b"\x00" * 60,                      # a length beyond MAX_FRAME
        b"{" * 4096,                                             # bytes that are not a frame
        protocol.encode({"t": "ev", "kind": "activity"})[:-3],   # a frame cut short
    ]
    for i in upto(n):
        if _stop.is_set():
            break
        write(bursts[i % len(bursts)] + good)
    _stop.wait()


def partial() -> None:
    total = protocol.MAX_FRAME - 4
    write(protocol._LEN.pack(total, 16))
    sent = 8
    while not _stop.is_set() and sent < total:
        write(b"{")
        sent += 1
        _stop.wait(0.01)  # a slow drip (the attack's pace), ended at once by stop


def handle(h: dict[str, Any], t0: float) -> None:
    op = h.get("op")
    n = int(h["frames"]) if isinstance(h.get("frames"), int) else None  # None: until ``stop``
    if op == "hello":
        with _lock:
            flooding = _active[0] > 0
            write(protocol.encode({"t": "res", "id": h.get("id"), "ok": True, "version": protocol.PROTOCOL_VERSION,
                                   "boot_ms": 1.0, "uptime": time.monotonic() - t0, "last_activity": time.time(),
                                   "running": 0, "pid": os.getpid(), "flooding": flooding}))
    elif op == "stop":
        _stop.set()
        reply(h)
    elif op == "exec":
        reply(h, pid=4242, started_at=time.time())
        _stop.clear()
        in_background(flood_output, h["cmd"], n, int(h.get("size") or 1))
    elif op == "replay":
        _stop.clear()
        rid = h.get("id")
        size = 1
        in_background(flood, (({"t": "chunk", "id": rid, "ev": {
            "t": "ev", "kind": "out", "cmd": h.get("cmd"), "seq": i + 1, "fd": 1, "off": i * size}},
            b"r" * size) for i in upto(n)))
    elif op in ("forge", "garbage", "partial", "fs.list"):
        _stop.clear()
        if op != "fs.list":
            reply(h)
        target = {"forge": forge, "garbage": garbage, "partial": partial, "fs.list": endless_list}[op]
        args: tuple[Any, ...] = {"forge": (n,), "garbage": (n,), "partial": (), "fs.list": (h.get("id"), n)}[op]
        in_background(target, *args)
    else:
        send({"t": "res", "id": h.get("id"), "ok": False,
              "error": {"code": "invalid_request", "message": f"unknown op {op!r}"}})


def main() -> None:
    t0 = time.monotonic()
    send({"t": "ev", "kind": "ready", "version": protocol.PROTOCOL_VERSION, "boot_ms": 1.0, "pid": os.getpid()})
    while True:
        try:
            frame = protocol.read_frame(lambda n: os.read(0, n))
        except protocol.ProtocolError:
            continue
        if frame is None:
            threading.Event().wait()  # the channel is gone for good, and PID 1 never exits
        if frame[0].get("t") == "req":
            handle(frame[0], t0)


if __name__ == "__main__":
    main()
