# Generated from space/sdk/_async/_http.py by scripts/unasync.py: do not edit.
"""The one place the client talks HTTP: auth, timeouts, error translation and event streams."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import time
import httpx

from space import errors
from space.sdk._errors import from_response, translate
from space.sdk._models import JSON
from space.sdk._sse import ACCEPT_EVENTS, EventDecoder, StreamEvent

#: Pauses before successive re-connections of an event stream that keeps failing without progress;
#: after the last one the stream's error is raised. A stream that made progress retries at once.
RECONNECT_DELAYS: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0)
#: ``moved`` events in a row (no event between them) after which a stream counts as failing.
MAX_MOVES_IN_A_ROW = 3
#: An event stream silent for this long is re-opened where it left off, so a connection that died
#: without a FIN is noticed; an idle re-open does not count as a failure.
STREAM_IDLE_TIMEOUT = 120.0

USER_AGENT = "space-sdk/0.1"


def decoded(resp: httpx.Response) -> Iterator[StreamEvent]:
    """The whole events of an event stream answer (SSE or frames, by its content type)."""
    decoder = EventDecoder(resp.headers.get("content-type"))
    for chunk in resp.iter_bytes():
        for ev in decoder.feed(chunk):
            yield ev


class SyncHTTP:
    def __init__(
        self,
        url: str | None,
        api_key: str | None,
        *,
        timeout: float,
        transport: httpx.BaseTransport | None,
    ) -> None:
        url = url or os.environ.get("SPACE_URL")
        api_key = api_key or os.environ.get("SPACE_API_KEY")
        if not url:
            raise errors.InvalidRequest("no server URL: pass url= or set SPACE_URL")
        if not api_key:
            raise errors.InvalidRequest("no API key: pass api_key= or set SPACE_API_KEY")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._client = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {api_key}", "User-Agent": USER_AGENT},
            timeout=timeout,
            transport=transport,
        )

    def close(self) -> None:
        self._client.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int] | None = None,
        json: Any = None,
        content: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> httpx.Response:
        with translate(self.url):
            resp = self._client.request(
                method,
                path,
                params=params,
                json=json,
                content=content,
                headers=headers,
                timeout=timeout or httpx.Timeout(self.timeout),
            )
        if resp.is_error:
            raise from_response(resp)
        return resp

    def json(self, method: str, path: str, **kwargs: Any) -> JSON:
        resp = self.request(method, path, **kwargs)
        try:
            body = resp.json()
        except ValueError as exc:
            raise errors.Internal(f"{method} {path}: the server answered with invalid JSON") from exc
        if not isinstance(body, dict):
            raise errors.Internal(f"{method} {path}: expected a JSON object, got {type(body).__name__}")
        return body

    @contextmanager
    def stream(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
        json: Any = None,
    ) -> Iterator[httpx.Response]:
        """A response whose body is read by the caller; failures while reading are translated too."""
        with translate(self.url):
            with self._client.stream(
                method, path, params=params, headers=headers, timeout=timeout or httpx.Timeout(self.timeout),
                json=json,
            ) as resp:
                if resp.is_error:
                    resp.read()
                    raise from_response(resp)
                yield resp

    def events(
        self,
        path: str,
        *,
        final: str,
        after: int = 0,
        params: Mapping[str, str | int] | None = None,
    ) -> Iterator[tuple[str, int | None, JSON]]:
        """Yield ``(event, seq, data)`` from an SSE endpoint until the ``final`` event.

        A dropped or prematurely ended stream (or one that says its sandbox ``moved`` to another
        node) is re-opened with ``Last-Event-ID`` set to the last sequence number seen, and anything
        at or below it is skipped, so the caller sees every event exactly once. Only retryable
        errors (unavailable, timeout) are retried, a bounded number of times in a row without
        progress.
        """
        last = after
        failures = moves_in_a_row = 0
        timeout = httpx.Timeout(self.timeout, read=STREAM_IDLE_TIMEOUT)
        while True:
            headers = {"Accept": ACCEPT_EVENTS}
            if last > 0:
                headers["Last-Event-ID"] = str(last)
            connected = progressed = moved = False
            lost: errors.SpaceError
            try:
                with self.stream("GET", path, params=params, headers=headers, timeout=timeout) as resp:
                    connected = True
                    for ev in decoded(resp):
                        seq = ev.seq
                        if seq is not None:
                            if seq <= last:
                                continue
                            last = seq
                        if ev.event == "error":
                            # The server ended the stream for good (e.g. the sandbox died).
                            raise errors.from_wire(500, {"error": ev.data})
                        if ev.event == "moved":
                            # The sandbox moved to another node: the same request reaches it there.
                            moved = True
                            break
                        progressed = True
                        yield ev.event, seq, ev.data
                        if ev.event == final:
                            return
                lost = errors.Unavailable(f"the event stream {path} ended before its {final} event")
            except errors.SpaceError as exc:
                if not exc.retryable:
                    raise
                lost = exc
            if progressed:
                moves_in_a_row = 0
            if moved and moves_in_a_row < MAX_MOVES_IN_A_ROW:
                moves_in_a_row += 1  # reconnect at once (bounded: a stream that only says "moved")
                continue
            if progressed or (connected and isinstance(lost, errors.Timeout)):
                failures = 0
                continue
            failures += 1
            if failures > len(RECONNECT_DELAYS):
                raise lost
            time.sleep(RECONNECT_DELAYS[failures - 1])
