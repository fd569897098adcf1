"""What a request may send, decided before anything reads it: the size of its body and the time
the body may take to arrive.

Every route belongs to a body class (:func:`space_body_class`): JSON bodies are small
(:data:`MAX_JSON_BODY`, all of it within :data:`SMALL_BODY_DEADLINE`), a streamed body (a file
upload, stdin, a template blob, a request to a sandbox's port) is bounded by its own limit and
passes through chunk by chunk, never buffered here. :class:`RequestLimits` enforces the class:

- a declared ``Content-Length`` over the limit is answered 413 at once, from the header alone:
  nothing is read, nothing authenticated, no route runs;
- a body without a declared length (chunked) is counted as the route reads it, and its reader fails
  the moment it passes the limit (413);
- a body that stops arriving (:data:`BODY_IDLE_TIMEOUT` without a byte) or a small one that takes
  longer than :data:`SMALL_BODY_DEADLINE` is answered 408;
- what is left of a body the route did not read is discarded for a bounded time after the answer
  (:mod:`space.httpserver`), then the connection is closed.

The request line and headers are bounded by the server's protocol (:mod:`space.web`), which runs
before any of this.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.errors import PayloadTooLarge, RequestTimeout, SpaceError

#: The largest JSON body of any route (the largest field, a command's ``shell``, is 1 MiB).
MAX_JSON_BODY = 2 << 20
#: A body that sends nothing for this long is given up on (408).
BODY_IDLE_TIMEOUT = 30.0
#: A JSON body arrives whole within this long from the first read (408).
SMALL_BODY_DEADLINE = 30.0


@dataclasses.dataclass(frozen=True)
class BodyClass:
    #: For messages and logs: what kind of body this is.
    name: str
    #: The most bytes the body may have.
    limit: int
    #: Seconds without a byte before it is given up on (None: a live stream the client paces).
    idle_timeout: float | None = BODY_IDLE_TIMEOUT
    #: Seconds the whole body may take (None: as long as it keeps coming).
    deadline: float | None = None


JSON_BODY = BodyClass("JSON body", MAX_JSON_BODY, deadline=SMALL_BODY_DEADLINE)


class BodyTooLarge(PayloadTooLarge, HTTPException):
    """Raised by the body's reader. An ``HTTPException`` too, so that FastAPI's body parsing
    re-raises it as it is (any other error there becomes a 400); SPACE's handlers answer it as the
    :class:`SpaceError` it is."""

    def __init__(self, message: str, **details: Any) -> None:
        PayloadTooLarge.__init__(self, message, **details)
        HTTPException.__init__(self, self.status, message)


class BodyTimedOut(RequestTimeout, HTTPException):
    """Raised by the body's reader when the body stops arriving (see :class:`BodyTooLarge`)."""

    def __init__(self, message: str, **details: Any) -> None:
        RequestTimeout.__init__(self, message, **details)
        HTTPException.__init__(self, self.status, message)


def too_large(cls: BodyClass) -> BodyTooLarge:
    return BodyTooLarge(f"a {cls.name} is limited to {cls.limit} bytes", limit=cls.limit)


def body_framing(scope: Scope) -> tuple[bool, int | None]:
    """Whether the request has a body, and its declared ``Content-Length`` (None when chunked; the
    protocol already refused a malformed one)."""
    chunked, length = False, None
    for k, v in scope.get("headers") or ():
        if k == b"content-length":
            length = int(v) if v.isdigit() else None
        elif k == b"transfer-encoding":
            chunked = True
    return chunked or bool(length), length


def has_body(scope: Scope) -> bool:
    return body_framing(scope)[0]


class _Body:
    """One request's body as it is read: how much came, whether it is whole, and what went wrong."""

    def __init__(self, cls: BodyClass, pending: bool) -> None:
        self.cls = cls
        self.received = 0
        self.complete = not pending
        self.failure: BodyTooLarge | BodyTimedOut | None = None
        self.response_started = False
        self.started_at: float | None = None

    def timeout(self) -> float | None:
        if self.response_started:
            return None  # full duplex: the route is answering, the client's pace is its business
        now = time.monotonic()
        if self.started_at is None:
            self.started_at = now
        limits = [t for t in (self.cls.idle_timeout,) if t is not None]
        if self.cls.deadline is not None:
            limits.append(self.started_at + self.cls.deadline - now)
        return max(0.0, min(limits)) if limits else None


class RequestLimits:
    """ASGI middleware: the body class of each request (``classify``), enforced as described in
    this module's docstring."""

    def __init__(self, app: ASGIApp, *, classify: Callable[[Scope], BodyClass]) -> None:
        self.app = app
        self.classify = classify

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        pending, declared = body_framing(scope)
        if not pending:  # nothing to bound (most GETs, streams included)
            await self.app(scope, receive, send)
            return
        cls = self.classify(scope)
        if declared is not None and declared > cls.limit:
            await _send_error(send, too_large(cls))
            return
        body = _Body(cls, pending)

        async def bounded_receive() -> Message:
            if body.failure is not None:
                raise body.failure
            if body.complete:
                return await receive()  # the body is whole: only a disconnect is left to wait for
            wait = body.timeout()
            try:
                async with asyncio.timeout(wait):
                    message = await receive()
            except TimeoutError:
                body.failure = BodyTimedOut(f"the request's body stopped arriving ({body.received} bytes came)",
                                            received=body.received)
                raise body.failure from None
            if message["type"] == "http.request":
                body.received += len(message.get("body", b""))
                if body.received > cls.limit:
                    body.failure = too_large(cls)
                    raise body.failure
                if not message.get("more_body", False):
                    body.complete = True
            else:
                body.complete = True  # the client is gone
            return message

        replaced = False

        async def guarded_send(message: Message) -> None:
            nonlocal replaced
            if replaced:
                return
            if message["type"] == "http.response.start":
                if body.failure is not None:
                    # Whatever the route made of the failure, the client gets the failure.
                    replaced = True
                    await _send_error(send, body.failure)
                    return
                body.response_started = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, guarded_send)
        except Exception:
            # Once the body failed, whatever the route raised is its consequence (an upload's
            # aborted upstream request, a parse error): the client gets the body's failure.
            if body.failure is None:
                raise
        if body.failure is not None and not body.response_started and not replaced:
            await _send_error(send, body.failure)


async def _send_error(send: Send, exc: SpaceError) -> None:
    """Answer ``exc``. A timed-out body closes the connection (the client stalled mid-body); after
    a 413 the server's protocol discards the rest of the body for a while (space.httpserver), so
    that a client still writing it gets to read the answer."""
    body = json.dumps(exc.to_wire()).encode()
    headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())]
    if isinstance(exc, RequestTimeout):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---- the classes of SPACE's routes ---------------------------------------------------------------

_ID = r"[^/]+"


def space_body_class(max_upload: int) -> Callable[[Scope], BodyClass]:
    """The body class of a request to SPACE's own API (``/v1``)."""
    from space.api.commands import MAX_STDIN
    from space.node.templates.spec import MAX_BLOB_BYTES

    upload = BodyClass("file upload", max_upload)
    streamed: list[tuple[str | None, re.Pattern[str], BodyClass]] = [
        ("PUT", re.compile(rf"^/v1/sandboxes/{_ID}/files$"), upload),
        ("POST", re.compile(rf"^/v1/sandboxes/{_ID}/commands/{_ID}/stdin$"), BodyClass("stdin write", MAX_STDIN)),
        ("PUT", re.compile(rf"^/v1/templates/blobs/{_ID}$"), BodyClass("template file", MAX_BLOB_BYTES)),
        # A request to a server in the sandbox: passed through as it streams.
        (None, re.compile(rf"^/v1/sandboxes/{_ID}/ports/{_ID}(/.*)?$"), BodyClass("port request", max_upload)),
    ]

    def classify(scope: Scope) -> BodyClass:
        path: str = scope.get("path", "")
        if not path.startswith(("/v1/sandboxes/", "/v1/templates/blobs/")):
            return JSON_BODY
        method: str = scope.get("method", "")
        for want, pattern, cls in streamed:
            if (want is None or want == method) and pattern.match(path):
                return cls
        return JSON_BODY

    return classify


def e2b_body_classes(max_upload: int) -> dict[str, Callable[[Scope], BodyClass]]:
    """The body classes of E2B's planes: its control API takes JSON; envd's RPCs bound each message
    themselves (a file upload, ``StreamInput``: a live stdin the client paces); the port plane
    passes bodies through."""
    stream = BodyClass("sandbox request", max_upload)
    live = BodyClass("input stream", max_upload, idle_timeout=None)

    def envd(scope: Scope) -> BodyClass:
        return live if scope.get("path") == "/process.Process/StreamInput" else stream

    def const(cls: BodyClass) -> Callable[[Scope], BodyClass]:
        return lambda _scope: cls

    from space.node.templates.spec import MAX_BLOB_BYTES

    files = BodyClass("template files", MAX_BLOB_BYTES)

    def control(scope: Scope) -> BodyClass:
        # A COPY's files, to the URL the facade signed (space.e2b.template_files).
        if scope.get("method") == "PUT" and str(scope.get("path", "")).startswith("/templates/files/"):
            return files
        return JSON_BODY

    return {"control": control, "envd": envd, "ports": const(stream)}

