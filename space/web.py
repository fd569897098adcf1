"""HTTP plumbing shared by the public API and the node API: JSON errors and event stream framing."""

from __future__ import annotations

import binascii
import contextlib
import dataclasses
import json
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from space import event_frames
from space.errors import Internal, SpaceError, ValidationFailed, from_wire

log = structlog.get_logger("space.web")


class GracefulServer(uvicorn.Server):
    """uvicorn, minus re-raising SIGTERM/SIGINT once it has shut down: that killed the process
    before its owner's cleanup ran (for ``space serve`` the last audit records, the database and
    the node agent; for the node agent the deferred sandbox removals and its helper)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def error_response(exc: SpaceError) -> JSONResponse:
    return JSONResponse(exc.to_wire(), status_code=exc.status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as ``{"error": {"code", "message"}}`` with the status of its class."""

    @app.exception_handler(SpaceError)
    async def _space(_: Request, exc: SpaceError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", ""))} for e in exc.errors()
        ]
        first = problems[0] if problems else {"loc": [], "msg": "invalid"}
        msg = f"{'.'.join(first['loc'])}: {first['msg']}"
        return error_response(ValidationFailed(msg, problems=problems))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = from_wire(exc.status_code, {"error": {"code": "", "message": str(exc.detail)}})
        return JSONResponse(err.to_wire(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request.unhandled", error=repr(exc))
        return error_response(Internal("internal error; see the server log"))


def sse(event: str, data: dict[str, Any], event_id: int | str | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


#: ``sse(name, {"seq": seq, "data": base64}, seq)``, byte for byte.
_SSE_OUTPUT = b'id: %d\nevent: %s\ndata: {"seq":%d,"data":"%s"}\n\n'


def _sse_output(event: str, seq: int, payload: bytes) -> bytes:
    # The bulk of every output stream: formatted as bytes, since base64 needs no JSON escaping
    # (json.dumps of the encoded chunk cost a fifth of the node agent's time per byte streamed).
    return _SSE_OUTPUT % (seq, event.encode(), seq, binascii.b2a_base64(payload, newline=False))


def _frame_event(event: str, data: dict[str, Any], event_id: int | str | None = None) -> bytes:
    return event_frames.encode(event, data)  # a frame's data carries its ``seq``: no separate id


@dataclasses.dataclass(frozen=True, slots=True)
class EventWire:
    """How a command's event stream is written: SSE, or the frames of :mod:`space.event_frames`."""

    media_type: str
    #: ``(event, data, id)``: an event without bulk bytes.
    event: Callable[[str, dict[str, Any], int | str | None], bytes]
    #: ``(event, seq, payload)``: a ``stdout``/``stderr`` event.
    output: Callable[[str, int, bytes], bytes]
    keepalive: bytes


SSE_WIRE = EventWire(event_frames.SSE_MEDIA_TYPE, sse, _sse_output, b": keepalive\n\n")
FRAME_WIRE = EventWire(event_frames.MEDIA_TYPE, _frame_event, event_frames.output, event_frames.KEEPALIVE)


def asked_wire(accept: str | None) -> EventWire | None:
    """The event stream a request's ``Accept`` header names (frames first), if it names one."""
    if event_frames.wants_frames(accept):
        return FRAME_WIRE
    return SSE_WIRE if event_frames.lists(accept, event_frames.SSE_MEDIA_TYPE) else None


def event_wire(accept: str | None) -> EventWire:
    """The wire of an event stream endpoint: what ``Accept`` names, else SSE."""
    return asked_wire(accept) or SSE_WIRE


_FD_NAMES = {1: "stdout", 2: "stderr"}


def guest_event(header: dict[str, Any], payload: bytes, wire: EventWire = SSE_WIRE) -> bytes:
    """Translate one guest event (out/gap/exit) into the public wire form."""
    kind = header.get("kind")
    seq = int(header.get("seq", 0))
    if kind == "out":
        return wire.output(_FD_NAMES.get(int(header.get("fd", 1)), "stdout"), seq, payload)
    if kind == "exit":
        return wire.event("exit", {"seq": seq, "exit_code": header.get("exit_code"), "signal": header.get("signal"),
                                   "timed_out": bool(header.get("timed_out"))}, seq)
    if kind == "gap":
        return wire.event("gap", {"seq": seq, "lost_bytes": header.get("lost_bytes", 0)}, seq)
    return wire.event(str(kind), {"seq": seq}, seq)


class EventStream(StreamingResponse):
    """A ``text/event-stream`` answer (as ``response_class``: the OpenAPI document says so)."""

    media_type = "text/event-stream"


class OctetStream(StreamingResponse):
    """A byte stream (``application/octet-stream``), e.g. a file's contents."""

    media_type = "application/octet-stream"
