"""The Connect protocol as E2B's SDK speaks it: JSON codec only, unary and enveloped streams.

Unary calls are a JSON body in, a JSON body out (``application/json``), errors a non-200 with
``{"code": "<snake_case>", "message"}``. Streams (``application/connect+json``) are envelopes: one
flag byte, a 4-byte big-endian length and the JSON message; flag ``0x02`` marks the end-of-stream
message, ``{}`` or ``{"error": {...}}``. See ``E2B_COMPAT.md`` C.1.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterator
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from space.errors import SpaceError
from space.httpserver import RESET_EXTENSION

UNARY_TYPE: Final = "application/json"
STREAM_TYPE: Final = "application/connect+json"
FLAG_COMPRESSED: Final = 0x01
FLAG_END: Final = 0x02
#: A request message larger than this is refused (SendInput carries stdin, at most a few MiB).
MAX_MESSAGE: Final = 32 << 20

_HEAD = struct.Struct(">BI")

#: Connect code → HTTP status of a unary error.
STATUS: Final[dict[str, int]] = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429,
    "failed_precondition": 412, "aborted": 409, "out_of_range": 400, "unimplemented": 501,
    "internal": 500, "unavailable": 503, "data_loss": 500, "unauthenticated": 401,
}

#: SPACE error code → Connect code (guest and node errors both arrive as SpaceErrors).
_FROM_SPACE: Final[dict[str, str]] = {
    "invalid_request": "invalid_argument", "invalid_path": "invalid_argument",
    "validation_failed": "invalid_argument", "unauthorized": "unauthenticated",
    "forbidden": "permission_denied", "not_found": "not_found", "conflict": "already_exists",
    "invalid_state": "failed_precondition", "too_large": "resource_exhausted",
    "quota_exceeded": "resource_exhausted", "insufficient_storage": "resource_exhausted",
    "timeout": "deadline_exceeded", "unavailable": "unavailable", "runtime_error": "unavailable",
}


class ConnectError(Exception):
    """An RPC error with its Connect code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def of(cls, exc: SpaceError) -> ConnectError:
        return cls(_FROM_SPACE.get(exc.code, "internal"), exc.message)

    def wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}

    def response(self) -> Response:
        return Response(json.dumps(self.wire()), status_code=STATUS.get(self.code, 500),
                        media_type=UNARY_TYPE)


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _HEAD.pack(flags, len(data)) + data


class DropConnection(Exception):
    """Raised by a streaming body when the sandbox behind it is gone: the server closes the
    connection with the stream unfinished, as a dead envd's connection ends. An error frame would
    be the SDK's "likely a timeout"; a dropped connection makes it ask ``/health``, which says
    whether the sandbox is gone ("killed or reached its end of life")."""


def _is_drop(exc: BaseException) -> bool:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # a task group's wrapping
        exc = exc.exceptions[0]
    return isinstance(exc, DropConnection)


class DroppableStream(StreamingResponse):
    """A streamed answer whose body may raise :class:`DropConnection`: the connection is then reset
    (the server's :data:`~space.httpserver.RESET_EXTENSION`) and nothing more is said or logged.
    Under a server without the extension the exception goes on, and that server closes the
    connection its own way."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BaseException as exc:
            reset = scope.get("extensions", {}).get(RESET_EXTENSION)
            if not _is_drop(exc) or reset is None:
                raise
            reset()
            # Let the server see the connection lost before this returns (else it would log an
            # answer left unfinished).
            await asyncio.sleep(0)


def end_of_stream(error: ConnectError | None = None) -> bytes:
    return envelope({"error": error.wire()} if error is not None else {}, FLAG_END)


class EnvelopeReader:
    """Incremental decoder of a request body's envelopes."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, dict[str, Any]]]:
        self._buf += data
        out: list[tuple[int, dict[str, Any]]] = []
        while len(self._buf) >= _HEAD.size:
            flags, size = _HEAD.unpack_from(self._buf)
            if size > MAX_MESSAGE:
                raise ConnectError("resource_exhausted", f"message of {size} bytes exceeds {MAX_MESSAGE}")
            if len(self._buf) < _HEAD.size + size:
                break
            raw = bytes(self._buf[_HEAD.size:_HEAD.size + size])
            del self._buf[:_HEAD.size + size]
            if flags & FLAG_COMPRESSED:
                raise ConnectError("internal", "compressed messages are not supported (identity only)")
            out.append((flags, _decode(raw)))
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"request is not valid JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ConnectError("invalid_argument", "request message must be a JSON object")
    return msg


async def unary_request(request: Request) -> dict[str, Any]:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MESSAGE:
            raise ConnectError("resource_exhausted", f"request exceeds {MAX_MESSAGE} bytes")
    return _decode(bytes(body))


async def stream_requests(request: Request) -> AsyncIterator[dict[str, Any]]:
    """The messages of an enveloped request body, as they arrive (client streams)."""
    reader = EnvelopeReader()
    async for chunk in request.stream():
        for flags, msg in reader.feed(chunk):
            if flags & FLAG_END:
                return
            yield msg
    if reader.pending:
        raise ConnectError("invalid_argument", "request body ends inside an envelope")


async def first_stream_request(request: Request) -> dict[str, Any]:
    """The single message of a server-streaming call."""
    async for msg in stream_requests(request):
        return msg
    raise ConnectError("invalid_argument", "the request stream carried no message")


def timeout_seconds(request: Request) -> float | None:
    """``Connect-Timeout-Ms`` in seconds (None when absent or 0: no deadline)."""
    raw = request.headers.get("connect-timeout-ms")
    if raw is None or not raw.strip().isdigit():
        return None
    ms = int(raw.strip())
    return ms / 1000 if ms > 0 else None


# -- proto3 JSON ------------------------------------------------------------------------------


def field(msg: dict[str, Any], camel: str, snake: str | None = None, default: Any = None) -> Any:
    """A field by its JSON name or its proto name (the decoder must accept both)."""
    if camel in msg:
        return msg[camel]
    if snake is not None and snake in msg:
        return msg[snake]
    return default


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{what} must be base64 bytes")
    try:
        urlsafe = "-" in value or "_" in value
        return base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_" if urlsafe else None)
    except ValueError:
        raise ConnectError("invalid_argument", f"{what} is not valid base64") from None


def uint(value: Any, what: str) -> int:
    """A proto integer: a JSON number or a decimal string."""
    if isinstance(value, bool):
        raise ConnectError("invalid_argument", f"{what} must be an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConnectError("invalid_argument", f"{what} must be an integer")
