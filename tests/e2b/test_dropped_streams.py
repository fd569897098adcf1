"""A streamed answer whose sandbox died (space.e2b.connect.DroppableStream) ends with the
connection reset by SPACE's HTTP server (space.httpserver's reset extension), on a real uvicorn
with SPACE's protocol over loopback: the client reads a reset, not a clean end of a chunked body
(which E2B's SDKs take for an envd answer, "likely a timeout", instead of asking ``/health``), and
the server logs no failure for it. A stream that ends normally is untouched."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from space.e2b.connect import DropConnection, DroppableStream
from space.httpserver import BoundedHttp
from tests.waiting import wait_for


async def _dies(request: Request) -> Response:
    async def body() -> AsyncIterator[bytes]:
        yield b"first frame"
        raise DropConnection("the sandbox is gone")

    return DroppableStream(body(), media_type="application/connect+json")


async def _ends(request: Request) -> Response:
    async def body() -> AsyncIterator[bytes]:
        yield b"first frame"
        yield b"last frame"

    return DroppableStream(body(), media_type="application/connect+json")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = Starlette(routes=[Route("/dies", _dies, methods=["POST"]), Route("/ends", _ends, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=BoundedHttp, lifespan="off",
                                           log_level="info"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=10, what="the server")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_dropped_stream_is_a_reset(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    got = b""
    with httpx.Client(timeout=10) as c, c.stream("POST", f"{url}/dies") as r:
        assert r.status_code == 200
        with pytest.raises(httpx.ReadError) as info:
            for chunk in r.iter_bytes():
                got += chunk
    assert got == b"first frame"
    assert "reset" in str(info.value).lower(), info.value  # not "incomplete chunked read"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_a_stream_that_ends_is_untouched(url: str) -> None:
    r = httpx.post(f"{url}/ends", timeout=10)
    assert (r.status_code, r.content) == (200, b"first framelast frame")
