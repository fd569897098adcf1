"""The node's command event stream, below HTTP: the wire forms of guest events and the batching of
events already waiting into one write.

Aspects: SSE and frames carry the same event (output base64 in one, raw in the other, every byte
value); a batch takes what waits up to its bound, stops at an error or the end and hands it back
(not lost); a lone event is sent as it is.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct

from space.errors import Unavailable
from space.node.api.app import BATCH_BYTES, _batch, _StreamItem
from space.web import FRAME_WIRE, SSE_WIRE, guest_event, sse


def test_sse_and_frames_carry_the_same_guest_event() -> None:
    payload = bytes(range(256)) * 4
    header = {"t": "ev", "kind": "out", "cmd": "c", "seq": 9, "fd": 2, "off": 0}
    assert guest_event(header, payload, SSE_WIRE) == sse(
        "stderr", {"seq": 9, "data": base64.b64encode(payload).decode()}, 9)
    frame = guest_event(header, payload, FRAME_WIRE)
    hlen, plen = struct.unpack(">II", frame[:8])
    assert json.loads(frame[8 : 8 + hlen]) == {"event": "stderr", "seq": 9}
    assert plen == len(payload) and frame[8 + hlen :] == payload
    exit_header = {"t": "ev", "kind": "exit", "seq": 10, "exit_code": 3, "signal": None}
    frame = guest_event(exit_header, b"", FRAME_WIRE)
    hlen, plen = struct.unpack(">II", frame[:8])
    assert plen == 0 and json.loads(frame[8:]) == {"event": "exit", "seq": 10, "exit_code": 3, "signal": None,
                                                    "timed_out": False}


async def test_a_batch_takes_what_waits_up_to_its_bound_and_hands_back_the_end() -> None:
    queue: asyncio.Queue[_StreamItem] = asyncio.Queue()
    assert _batch(b"one", queue) == (b"one", [])
    for part in (b"two", b"three"):
        queue.put_nowait(part)
    err = Unavailable("gone")
    queue.put_nowait(err)
    queue.put_nowait(b"after the error")
    assert _batch(b"one", queue) == (b"onetwothree", [err])
    assert queue.get_nowait() == b"after the error"  # what follows the error stays queued
    big = b"x" * (BATCH_BYTES // 2)
    for _ in range(4):
        queue.put_nowait(big)
    data, after = _batch(big, queue)
    assert len(data) == BATCH_BYTES and after == [] and queue.qsize() == 3  # bounded
    queue = asyncio.Queue()
    queue.put_nowait(None)
    assert _batch(b"last", queue) == (b"last", [None])
