"""A small Server-Sent Events decoder (the subset SPACE sends: ``id``, ``event``, ``data``).

Fed line by line (``httpx`` splits the stream into lines); an event is dispatched at the blank
line that ends it, so a connection dropped in the middle of an event never yields half of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from space import errors


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
