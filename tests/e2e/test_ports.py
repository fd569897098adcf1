"""Servers inside a real sandbox reached through ``/v1/sandboxes/{id}/ports/{port}/...``: the control
plane, the node's port proxy, nftables and gVisor's netstack, all real.

- a static file from ``python3 -m http.server``; a closed port is 502 ``port_not_open``;
- request bodies (sized and chunked) reach the server, and its answer streams back incrementally;
- a path cannot climb out of the ports route;
- fork and suspend succeed after proxied requests and with a proxied stream open (the snapshot
  resets the node's connections into the sandbox, which the open stream sees as a cut-short body);
  the fork's and the restored sandbox's servers answer through the proxy.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.harness import Server, create_sandbox, run, wait_for, wait_operation

pytestmark = pytest.mark.runtime

#: In the sandbox on 8001: ``POST /echo`` answers the body it got (sized or chunked);
#: ``GET /lines?marker=F`` streams (chunked) "line 1", then holds "line 2" back until file F exists.
SERVER = r"""
import os, sys, time, urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        marker = urllib.parse.parse_qs(url.query)["marker"][0]
        self.send_response(200)
        self.send_header("content-type", "application/x-ndjson")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self.chunk(b'{"line": 1}\n')
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.chunk(b'{"line": 2}\n' if os.path.exists(marker) else b'{"gave_up": true}\n')
        self.wfile.write(b"0\r\n\r\n")

    def do_POST(self):
        if self.headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self.rfile.readline(), 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.send_header("x-framing", self.headers.get("transfer-encoding") or "length")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("0.0.0.0", 8001), H).serve_forever()
"""


def put(api: httpx.Client, sid: str, path: str, data: bytes) -> None:
    r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": path}, content=data)
    assert r.status_code in (200, 201), r.text


def start(api: httpx.Client, sid: str, cmd: list[str]) -> None:
    r = api.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd})
    assert r.status_code == 201, r.text


def act(api: httpx.Client, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    r = api.post(path, json=body)
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "succeeded", op
    return op


def port_url(sid: str, port: int, path: str = "") -> str:
    return f"/v1/sandboxes/{sid}/ports/{port}/{path}"


def serving(api: httpx.Client, sid: str) -> bool:
    return api.get(port_url(sid, 8000, "hello.txt")).status_code == 200


@pytest.fixture(scope="module")
def sandbox(api: httpx.Client) -> Iterator[str]:
    sid = create_sandbox(api)
    try:
        put(api, sid, "/tmp/www/hello.txt", b"hello from the sandbox\n")
        put(api, sid, "/tmp/server.py", SERVER.encode())
        start(api, sid, ["python3", "-m", "http.server", "8000", "--bind", "0.0.0.0", "--directory", "/tmp/www"])
        start(api, sid, ["python3", "/tmp/server.py"])
        wait_for(lambda: serving(api, sid), 60, "http.server to listen on 8000")
        wait_for(lambda: api.post(port_url(sid, 8001, "echo"), content=b"up").status_code == 200, 60,
                 "the echo server to listen on 8001")
        yield sid
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_get_a_file_and_a_closed_port(api: httpx.Client, sandbox: str) -> None:
    r = api.get(port_url(sandbox, 8000, "hello.txt"))
    assert r.status_code == 200 and r.text == "hello from the sandbox\n"
    assert r.headers["content-type"].startswith("text/plain")
    assert r.headers["content-length"] == str(len(r.content))
    assert "x-space-upstream-status" not in r.headers
    # The server's own statuses come through as they are (not as the platform's errors).
    r = api.get(port_url(sandbox, 8000, "missing.txt"))
    assert r.status_code == 404 and "error" not in r.headers.get("content-type", "")

    r = api.get(port_url(sandbox, 8009))
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "port_not_open" and "port is not open" in err["message"]
    assert api.get(f"/v1/sandboxes/{sandbox}/ports/0/").status_code == 422


def test_request_bodies_reach_the_server(api: httpx.Client, sandbox: str) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(payload), 100_000):
            yield payload[i:i + 100_000]

    sized = api.post(port_url(sandbox, 8001, "echo"), content=payload)
    assert sized.status_code == 200 and sized.headers["x-framing"] == "length" and sized.content == payload
    streamed = api.post(port_url(sandbox, 8001, "echo"), content=chunks())
    assert streamed.status_code == 200 and streamed.headers["x-framing"] == "chunked"
    assert streamed.content == payload


def test_the_answer_streams_incrementally(api: httpx.Client, sandbox: str) -> None:
    with api.stream("GET", port_url(sandbox, 8001, "lines"), params={"marker": "/tmp/go-stream"}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        lines = r.iter_lines()
        # The server writes line 2 only once /tmp/go-stream exists, which is made only now: line 1
        # came through on its own, chunk by chunk, nothing held back on the way.
        assert json.loads(next(lines)) == {"line": 1}
        put(api, sandbox, "/tmp/go-stream", b"")
        assert json.loads(next(lines)) == {"line": 2}
        assert list(lines) == []


def test_a_path_cannot_climb_out_of_the_ports_route(server: Server, sandbox: str) -> None:
    # http.client sends the path as it is (httpx would resolve the dot segments client-side).
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", f"/v1/sandboxes/{sandbox}/ports/8000/../../{sandbox}/files?path=/etc/hostname",
                     headers={"authorization": f"Bearer {server.admin_key}"})
        resp = conn.getresponse()
        assert resp.status == 400 and json.loads(resp.read())["error"]["code"] == "invalid_path"
    finally:
        conn.close()


def test_fork_and_suspend_after_proxied_requests(api: httpx.Client, sandbox: str) -> None:
    assert serving(api, sandbox)
    with api.stream("GET", port_url(sandbox, 8001, "lines"), params={"marker": "/tmp/go-fork"}) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines)) == {"line": 1}
        # A proxied connection is open into the sandbox: the fork's full snapshot resets it first
        # (gVisor cannot checkpoint an established connection) and succeeds.
        op = act(api, f"/v1/sandboxes/{sandbox}/fork", {"count": 1})
        with pytest.raises(httpx.HTTPError):  # cut short: no clean end of the chunked body
            list(lines)
    fork = op["result"]["sandbox_ids"][0]
    try:
        # The fork's servers came along in its memory and answer through its own address.
        assert serving(api, fork)
        echo = api.post(port_url(fork, 8001, "echo"), content=b"from the fork")
        assert echo.content == b"from the fork"
    finally:
        api.delete(f"/v1/sandboxes/{fork}")

    assert serving(api, sandbox)
    act(api, f"/v1/sandboxes/{sandbox}/suspend")
    assert api.get(f"/v1/sandboxes/{sandbox}").json()["state"] == "suspended"
    # A proxied request wakes it like any data-plane call; its servers were restored with it.
    r = api.get(port_url(sandbox, 8000, "hello.txt"))
    assert r.status_code == 200 and r.text == "hello from the sandbox\n"
    code, _, _ = run(api, sandbox, {"cmd": ["true"]})
    assert code == 0
