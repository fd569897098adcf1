"""Framing of the host<->guest channel (the guest daemon's stdin/stdout).

A frame is ``u32 total_len | u32 header_len | header (JSON, utf-8) | payload (bytes)``, big-endian,
where ``total_len`` counts everything after itself. Headers are small JSON objects; bulk bytes
(process output, file contents, stdin) travel as the raw payload, never inside JSON.

Kinds of header, by their ``t`` field:

- ``req``   host -> guest: ``{"t": "req", "id": N, "op": "...", ...args}`` (+ optional payload)
- ``res``   guest -> host: ``{"t": "res", "id": N, "ok": true, ...}`` or
            ``{"t": "res", "id": N, "ok": false, "error": {"code", "message"}}`` -- ends request N
- ``chunk`` guest -> host: ``{"t": "chunk", "id": N, ...}`` + payload -- a part of request N's answer
            (file reads, replays); always followed later by the ``res`` of N
- ``data``  host -> guest: ``{"t": "data", "id": N, "eof": bool}`` + payload -- upload stream of N
- ``ev``    guest -> host: ``{"t": "ev", "kind": "out"|"exit"|"ready"|"activity", ...}`` (+ payload)
- ``ack``   host -> guest: ``{"t": "ack", "cmd": CID, "bytes": TOTAL}`` -- output consumed so far

Conventions on top of the framing (helpers below):

- ``out`` events carry ``off``: the byte offset of their payload in the command's output stream, so
  the host acks absolute positions (``ack.bytes = off + len(payload)``) and stale acks are harmless.
- A list too large for one header (``fs.list`` entries, ``list`` commands) travels as chunks
  ``{"t": "chunk", "id": N, "part": KEY, KEY: [...]}`` before the ``res``; the receiver prepends
  them, in order, to ``res[KEY]`` (see :func:`batch_items`).
- A receiver that meets bytes that are not a frame skips to the next plausible one (:func:`resync`).

No single ``write()`` to the guest's stdout may exceed 64 KiB (gVisor stalls larger pipe writes), so
:func:`encode` keeps payloads at most :data:`MAX_PAYLOAD` and writers chunk at :data:`MAX_WRITE`.
"""

from __future__ import annotations

import json
import struct

TYPE_CHECKING = False  # type checkers read it as true; the guest boots faster without typing
if TYPE_CHECKING:
    from typing import Any

MAX_WRITE = 64 * 1024
#: Largest payload in one frame; leaves room for the header inside one 64 KiB write.
MAX_PAYLOAD = MAX_WRITE - 4096
MAX_HEADER = 64 * 1024
MAX_FRAME = MAX_HEADER + MAX_PAYLOAD + 8
PROTOCOL_VERSION = 1

_LEN = struct.Struct(">II")


class ProtocolError(Exception):
    """The byte stream is not a valid frame sequence."""


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    if len(h) > MAX_HEADER:
        raise ProtocolError(f"header too large ({len(h)} bytes)")
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"payload too large ({len(payload)} bytes)")
    return _LEN.pack(4 + len(h) + len(payload), len(h)) + h + payload


def decode_lengths(prefix: bytes) -> tuple[int, int]:
    """Given the first 8 bytes of a frame, return (bytes still to read, header length)."""
    total, hlen = _LEN.unpack(prefix)
    if total < 4 or hlen > total - 4 or total > MAX_FRAME:
        raise ProtocolError(f"bad frame lengths total={total} header={hlen}")
    return total - 4, hlen


def decode_body(body: bytes, hlen: int) -> tuple[dict[str, Any], bytes]:
    try:
        header = json.loads(body[:hlen])
    except (ValueError, RecursionError) as exc:  # RecursionError: valid JSON nested too deep
        raise ProtocolError(f"bad frame header: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not an object")
    return header, body[hlen:]


class FrameReader:
    """Incremental decoder: feed bytes, get complete frames (used by asyncio protocols)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytes]]:
        self._buf += data
        out: list[tuple[dict[str, Any], bytes]] = []
        while len(self._buf) >= 8:
            rest, hlen = decode_lengths(bytes(self._buf[:8]))
            if len(self._buf) < 8 + rest:
                break
            body = bytes(self._buf[8 : 8 + rest])
            del self._buf[: 8 + rest]
            out.append(decode_body(body, hlen))
        return out


def read_frame(read: Any) -> tuple[dict[str, Any], bytes] | None:
    """Read one frame with a blocking ``read(n)`` callable; None at a clean end of stream."""
    prefix = _read_exact(read, 8)
    if prefix is None:
        return None
    rest, hlen = decode_lengths(prefix)
    body = _read_exact(read, rest)
    if body is None:
        raise ProtocolError("stream ended inside a frame")
    return decode_body(body, hlen)


def _read_exact(read: Any, n: int) -> bytes | None:
    parts: list[bytes] = []
    got = 0
    while got < n:
        b = read(n - got)
        if not b:
            if got == 0:
                return None
            raise ProtocolError("stream ended inside a frame")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


#: JSON budget of one list batch inside a header (leaves room for the header's other fields).
PART_BUDGET = MAX_HEADER - 4096


def batch_items(items: list[Any], budget: int = PART_BUDGET) -> list[list[Any]]:
    """Split ``items`` into consecutive batches whose JSON fits ``budget`` bytes (at least one batch)."""
    batches: list[list[Any]] = [[]]
    used = 2
    for item in items:
        size = len(json.dumps(item, separators=(",", ":"))) + 1
        if batches[-1] and used + size > budget:
            batches.append([])
            used = 2
        batches[-1].append(item)
        used += size
    return batches


#: Where a frame could begin: both lengths below 2**17 (MAX_FRAME and MAX_HEADER are), so their
#: first bytes are 0 and 0 or 1, then a header opening with ``{``. Compiled on first use: the
#: guest meets garbage rarely and must not pay for ``re`` at boot.
_CANDIDATE: Any = None


def resync(buf: bytes | bytearray, start: int = 1) -> int:
    """Index at or after ``start`` where a frame plausibly begins (lengths valid, header opens with
    ``{``); if none is visible yet, the index of the tail that could still begin one.

    The scan is a regular expression over the bytes, checked in Python only at candidates: garbage
    costs the reader (the shim, for whatever a guest writes) no interpreted step per byte."""
    global _CANDIDATE
    if _CANDIDATE is None:
        import re

        _CANDIDATE = re.compile(rb"\x00[\x00\x01]..\x00[\x00\x01]..\{", re.DOTALL)
    i = start
    while True:
        m = _CANDIDATE.search(buf, i)
        if m is None:
            return max(start, len(buf) - 8)
        i = int(m.start())
        try:
            decode_lengths(bytes(buf[i : i + 8]))
        except ProtocolError:
            i += 1
            continue
        return i
