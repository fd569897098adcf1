"""uvicorn's HTTP/1.1 protocol with a bounded request head.

uvicorn bounds neither the time a client takes to send a request's line and headers nor (with
httptools, its default parser) their size: a connection that sends nothing, or drips a header a byte
at a time (slowloris), is held forever, and a 10 MB header is taken in whole. :class:`BoundedHttp`
closes a connection whose head is not complete within :data:`HEAD_TIMEOUT` (from the connection, or
from the first byte of a request that follows on a kept-alive one; an idle kept-alive connection is
uvicorn's ``timeout_keep_alive``) and answers 431 to a head larger than :data:`MAX_HEAD`. The
request's body is the application's to bound (:mod:`space.api.limits`).

An answer sent before the request's body was read (a 413 from its length, a 401) leaves the rest of
the body to come: uvicorn reads and discards it, without end. Closing at once would lose the answer
(the client, still writing, gets a reset instead of the 413); so the rest is discarded for at most
:data:`LINGER_TIMEOUT` (nginx's lingering close), then the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: Seconds a client has to send a request's line and headers.
HEAD_TIMEOUT = 15.0
#: The most bytes of request line and headers (h11's default bound).
MAX_HEAD = 64 * 1024
#: Seconds the rest of a body is read (and discarded) after its request was answered.
LINGER_TIMEOUT = 10.0
#: The ASGI scope extension (a callable) that ends the request's connection with a TCP reset: what
#: a client reads as the peer gone mid-response (the E2B facade's streams of a sandbox that died).
RESET_EXTENSION: Final = "space.reset_connection"



def _answer(status: str, code: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


_TIMEOUT_ANSWER = _answer("408 Request Timeout", "request_timeout",
                          f"the request line and headers took longer than {HEAD_TIMEOUT:g}s")
_TOO_LARGE_ANSWER = _answer("431 Request Header Fields Too Large", "too_large",
                            f"the request line and headers are limited to {MAX_HEAD} bytes")


class BoundedHttp(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` with a head deadline and a head size limit (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._in_head = True
        self._body_done = False
        self._linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._stop_lingering()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            # Counted after the parser has seen it: a chunk that ends the head is not counted.
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                self._refuse(_TOO_LARGE_ANSWER)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        extensions: dict[str, Any] = dict(self.scope.get("extensions") or {})
        extensions[RESET_EXTENSION] = self._reset
        self.scope["extensions"] = extensions
        self._in_head = True
        self._head_bytes = 0
        self._body_done = False
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._body_done = True
        self._stop_lingering()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._body_done and not self.transport.is_closing():
            self._linger_timer = self.loop.call_later(LINGER_TIMEOUT, self._linger_over)

    def _linger_over(self) -> None:
        self._linger_timer = None
        if not self._body_done and not self.transport.is_closing():
            self.transport.close()

    def _stop_lingering(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head:
            self._refuse(_TIMEOUT_ANSWER)

    def _reset(self) -> None:
        """Close the connection with a reset (SO_LINGER 0), not an orderly close: a client reads an
        orderly close mid-body as a protocol error, a reset as the connection lost."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _refuse(self, answer: bytes) -> None:
        self._cancel_head_timer()
        if not self.transport.is_closing():
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(answer)
            self.transport.close()
