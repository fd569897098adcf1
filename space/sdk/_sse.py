"""Decoders of event streams: Server-Sent Events (the subset SPACE sends: ``id``, ``event``,
``data``) and the binary frames of :mod:`space.event_frames`.

An event is dispatched only once it is whole (SSE: at the blank line that ends it), so a connection
dropped in the middle of an event never yields half of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from space import errors, event_frames

#: What the SDK asks event streams for: frames where the endpoint has them (command events), else SSE.
ACCEPT_EVENTS = f"{event_frames.MEDIA_TYPE}, {event_frames.SSE_MEDIA_TYPE}"
#: The longest SSE line held while waiting for its end (the server's are under 100 KiB).
MAX_LINE = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    event: str
    data: str
    id: str | None = None

    def json(self) -> dict[str, Any]:
        try:
            body = json.loads(self.data) if self.data else {}
        except ValueError as exc:
            raise errors.Internal(f"malformed event data from the server: {self.data[:200]!r}") from exc
        if not isinstance(body, dict):
            raise errors.Internal(f"malformed event data from the server: {self.data[:200]!r}")
        return body

    @property
    def seq(self) -> int | None:
        """The event's sequence number: its ``id`` field, else ``seq`` in its data."""
        if self.id is not None and self.id.isdigit():
            return int(self.id)
        seq = self.json().get("seq")
        return seq if isinstance(seq, int) else None


class SSEDecoder:
    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None
        self._partial = b""

    def feed_bytes(self, chunk: bytes) -> list[ServerSentEvent]:
        """Take the stream's bytes as they arrive; return the events they complete. Lines end in
        ``\n`` or ``\r\n`` (what SPACE sends; a lone ``\r`` is not a line break here)."""
        data = self._partial + chunk if self._partial else chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE:
            raise errors.Internal(f"an event stream line longer than {MAX_LINE} bytes")
        out = []
        for raw in lines:
            sse = self.feed(raw.removesuffix(b"\r").decode("utf-8", "replace"))
            if sse is not None:
                out.append(sse)
        return out

    def feed(self, line: str) -> ServerSentEvent | None:
        """Take one line (without its line ending); return an event when one is complete."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):  # a comment, e.g. a keep-alive
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._data and not self._event:
            return None
        sse = ServerSentEvent(event=self._event or "message", data="\n".join(self._data), id=self._id)
        self._event, self._data, self._id = "", [], None
        return sse


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event of a stream, whichever its wire form: its name, sequence number and data (the
    bulk of ``stdout``/``stderr`` in ``data["data"]``: bytes from frames, base64 text from SSE)."""

    event: str
    seq: int | None
    data: dict[str, Any]


class EventDecoder:
    """A stream's chunks in, whole events out: frames or SSE, by the answer's content type."""

    def __init__(self, content_type: str | None) -> None:
        media = (content_type or "").split(";")[0].strip()
        self._frames = event_frames.FrameDecoder() if media == event_frames.MEDIA_TYPE else None
        self._sse = SSEDecoder()

    def feed(self, chunk: bytes) -> list[StreamEvent]:
        if self._frames is None:
            out = []
            for sse in self._sse.feed_bytes(chunk):
                data = sse.json()  # once: ``sse.seq`` of an event without an id would parse it again
                seq = int(sse.id) if sse.id is not None and sse.id.isdigit() else _seq(data)
                out.append(StreamEvent(sse.event, seq, data))
            return out
        try:
            frames = self._frames.feed(chunk)
        except event_frames.FrameError as exc:
            raise errors.Internal(f"malformed event stream from the server: {exc}") from None
        return [StreamEvent(name, _seq(data), data) for name, data in frames]


def _seq(data: dict[str, Any]) -> int | None:
    seq = data.get("seq")
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None
