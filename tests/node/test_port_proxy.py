"""The node's port proxy against a real HTTP server on loopback; the sandbox manager is replaced at
its seam (a sandbox whose address is 127.0.0.1). The real path (runsc, netns, nftables) is
tests/e2e/test_ports.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from space.errors import InvalidPath, InvalidRequest, NotFound
from space.node.network.namespaces import SandboxNet
from space.node.network.port_proxy import UPSTREAM_HOST, UPSTREAMS, ports_router, upstream_host
from space.web import install_error_handlers
from tests.waiting import await_for

SID = "sbx-test"


class FakeManager:
    """What the port proxy asks of a SandboxManager."""

    def __init__(self, network: bool = True) -> None:
        self.network = network
        self.locks: dict[str, asyncio.Lock] = {}

    async def guest(self, sandbox_id: str) -> None:
        if sandbox_id != SID:
            raise NotFound(f"sandbox {sandbox_id} is not on this node")

    def net(self, sandbox_id: str) -> SandboxNet | None:
        return SandboxNet(1, "ns", "if", "127.0.0.1", "127.0.0.1") if self.network else None

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self.locks.setdefault(sandbox_id, asyncio.Lock())


class Upstream:
    """A threaded HTTP/1.1 server; records how each connection ended (a reset, or a FIN)."""

    def __init__(self) -> None:
        self.endings: list[str] = []
        self.release = threading.Event()  # /slow writes its second line once set
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle(self) -> None:
                try:
                    self.close_connection = False
                    while not self.close_connection:
                        self.handle_one_request()
                    outer.endings.append("fin")
                except (ConnectionResetError, BrokenPipeError):
                    outer.endings.append("reset")

            def _reply(self, status: int, body: bytes, *extra: tuple[str, str]) -> None:
                self.send_response(status)
                for k, v in extra:
                    self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/slow":
                    self.send_response(200)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for line in (b"first\n", b"last\n"):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                        outer.release.wait(30)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                body = json.dumps({"path": self.path, "headers": self.headers.items()}).encode()
                self._reply(200, body, ("content-type", "application/json"), ("set-cookie", "a=1"),
                            ("set-cookie", "b=2"), ("x-custom", "yes"))

            def do_POST(self) -> None:
                if self.headers.get("transfer-encoding") == "chunked":
                    body = b""
                    while size := int(self.rfile.readline(), 16):
                        body += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                else:
                    body = self.rfile.read(int(self.headers["content-length"]))
                self._reply(201, body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> Upstream:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with Upstream() as u:
        yield u


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(ports_router(FakeManager()), prefix="/v1")  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node",
                                 headers={"authorization": "Bearer node-token"}) as c:
        yield c
    assert UPSTREAMS.count(SID) == 0


async def test_get_passes_path_query_and_headers_and_ends_with_a_reset(
        client: httpx.AsyncClient, upstream: Upstream) -> None:
    r = await client.get(f"/v1/sandboxes/{SID}/ports/{upstream.port}/a%2Fb/c", params=[("x", "1"), ("x", "2")],
                         headers={"x-mine": "1", "connection": "keep-alive, x-hop", "x-hop": "no"})
    assert r.status_code == 200 and r.headers["x-space-upstream-status"] == "200"
    seen = r.json()
    assert seen["path"] == "/a%2Fb/c?x=1&x=2"
    headers = {k.lower(): v for k, v in seen["headers"]}
    assert headers["host"] == f"localhost:{upstream.port}"
    assert headers["x-mine"] == "1"
    assert "authorization" not in headers  # the node token stays with the node
    assert "x-hop" not in headers and "keep-alive" not in headers.get("connection", "")
    assert r.headers.get_list("set-cookie") == ["a=1", "b=2"] and r.headers["x-custom"] == "yes"
    # The connection was closed by a reset (no FIN: the sandbox is never left in TIME_WAIT).
    await await_for(lambda: _true(upstream.endings), 10, "the server's connection to end")
    assert upstream.endings == ["reset"]


async def _true(x: Any) -> Any:
    return x


@pytest.mark.parametrize("chunked", [False, True])
async def test_post_bodies_stream_through(client: httpx.AsyncClient, upstream: Upstream, chunked: bool) -> None:
    payload = b"x" * 300_000

    async def gen() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 65536):
            yield payload[i:i + 65536]

    r = await client.post(f"/v1/sandboxes/{SID}/ports/{upstream.port}/echo", content=gen() if chunked else payload)
    assert r.headers["x-space-upstream-status"] == "201"
    assert r.content == payload


async def test_errors(client: httpx.AsyncClient) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
        r = await client.get(f"/v1/sandboxes/{SID}/ports/{closed}/")
    assert r.status_code == 502 and r.json()["error"]["code"] == "port_not_open"
    assert "port is not open" in r.json()["error"]["message"]
    assert (await client.get(f"/v1/sandboxes/nope/ports/{closed}/")).status_code == 404
    assert (await client.get(f"/v1/sandboxes/{SID}/ports/0/")).status_code == 422
    assert (await client.get(f"/v1/sandboxes/{SID}/ports/65536/")).status_code == 422


async def test_a_sandbox_without_network_has_no_open_port() -> None:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(ports_router(FakeManager(network=False)), prefix="/v1")  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as c:
        r = await c.get(f"/v1/sandboxes/{SID}/ports/8000/")
    assert r.status_code == 502 and "port is not open (port 8000)" in r.json()["error"]["message"]


async def test_reset_aborts_open_connections(upstream: Upstream) -> None:
    """What a snapshot does: every connection into the sandbox is reset and forgotten."""
    up = UPSTREAMS.add(SID)
    await up.connect("127.0.0.1", upstream.port, 5)
    await up.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
    got = b""
    while b"first" not in got:
        got += await up.read(65536, timeout=10)
    assert UPSTREAMS.count(SID) == 1
    assert await UPSTREAMS.reset(SID) == 1
    assert UPSTREAMS.count(SID) == 0
    upstream.release.set()  # the server writes on: the reset is what it meets
    await await_for(lambda: _true(upstream.endings), 10, "the server's connection to end")
    assert upstream.endings == ["reset"]


def test_dot_segments_cannot_leave_the_ports_route() -> None:
    from space.api.ports import _node_target

    assert _node_target("s1", 80, "/a%2Fb/c", "x=1") == "/v1/sandboxes/s1/ports/80/a%2Fb/c?x=1"
    assert _node_target("s1", 80, "a#b", "") == "/v1/sandboxes/s1/ports/80/a%23b"
    for bad in ("../../other/files", "a/./b", "a/.."):
        with pytest.raises(InvalidPath):
            _node_target("s1", 80, bad, "")


def test_the_host_a_server_sees() -> None:
    """``localhost:<port>`` unless the control plane names one (a sandbox's ``port_host``), whose
    ``${PORT}`` is the port; anything that is not one host[:port] is refused, never passed on."""
    assert upstream_host([(b"accept", b"*/*")], 8000) == "localhost:8000"
    named = [(b"X-Space-Upstream-Host", b"custom-host.example.com:${PORT}")]
    assert upstream_host(named, 8000) == "custom-host.example.com:8000"
    assert upstream_host([(UPSTREAM_HOST.encode(), b"[::1]:${PORT}")], 3000) == "[::1]:3000"
    for bad in ([(UPSTREAM_HOST.encode(), b"a b")], [(UPSTREAM_HOST.encode(), b"a\r\nx: 1")],
                [(UPSTREAM_HOST.encode(), b"a/b")], [(UPSTREAM_HOST.encode(), b"")],
                [(UPSTREAM_HOST.encode(), b"a" * 256)],
                [(UPSTREAM_HOST.encode(), b"a"), (UPSTREAM_HOST.encode(), b"b")]):
        with pytest.raises(InvalidRequest, match=UPSTREAM_HOST):
            upstream_host(bad, 80)


async def test_the_host_the_control_plane_names_reaches_the_server(
        client: httpx.AsyncClient, upstream: Upstream) -> None:
    r = await client.get(f"/v1/sandboxes/{SID}/ports/{upstream.port}/",
                         headers={UPSTREAM_HOST: "app.example.com:${PORT}"})
    assert r.status_code == 200, r.text
    headers = {k.lower(): v for k, v in r.json()["headers"]}
    assert headers["host"] == f"app.example.com:{upstream.port}"
    assert UPSTREAM_HOST not in headers
    refused = await client.get(f"/v1/sandboxes/{SID}/ports/{upstream.port}/", headers={UPSTREAM_HOST: "a b"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_request"
