"""WebSockets to a server inside a real sandbox, through ``/v1/sandboxes/{id}/ports/{port}/...``: the
control plane's relay, the node's (over its unix socket), nftables and gVisor's netstack, all real.

The server in the sandbox is written against the RFC with the standard library only, so that what it
reports (the request it got, the close code it got) is the wire's, not a library's reading of it.

- the handshake: the path and query reach the server as the client wrote them (``%2F`` kept), the
  server sees ``Host: localhost:PORT`` and never the caller's API key, the subprotocol it chose and
  its own headers (``Set-Cookie``) come back;
- messages both ways: text (UTF-8), binary (1 MiB), a message the server fragments, a ping the server
  sends (answered by the hop it reaches);
- close codes travel end to end, from the client and from the server;
- refusals: the server's own HTTP answer (403 with its body and headers), a closed port (502
  ``port_not_open``), no key (401), a read-only key (403);
- a message over the bound closes with 1009, nothing buffered;
- a fork with a WebSocket open resets it (gVisor cannot checkpoint an established connection) and
  succeeds; the fork's server takes WebSockets of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.e2e.harness import Server, create_sandbox, wait_for, wait_operation

pytestmark = pytest.mark.runtime

PORT = 8002

#: A WebSocket server on 8002: its first message is the request it got; then it echoes, except for
#: the commands below. Unmasked server frames, no extensions (none is offered to it).
SERVER = r"""
import base64, hashlib, json, socket, struct, threading

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

def send(conn, op, data, fin=True):
    head = bytes([(0x80 if fin else 0) | op])
    n = len(data)
    if n < 126:
        head += bytes([n])
    elif n < 65536:
        head += bytes([126]) + struct.pack("!H", n)
    else:
        head += bytes([127]) + struct.pack("!Q", n)
    conn.sendall(head + data)

def recv(f):
    b0, b1 = f.read(2)
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack("!H", f.read(2))[0]
    elif n == 127:
        n = struct.unpack("!Q", f.read(8))[0]
    mask = f.read(4) if b1 & 0x80 else b"\0\0\0\0"
    data = bytes(c ^ mask[i % 4] for i, c in enumerate(f.read(n)))
    return b0 & 0x0F, data

def serve(conn):
    f = conn.makefile("rb")
    method, target, _ = f.readline().decode().split(" ", 2)
    headers = {}
    while (line := f.readline().decode().strip()):
        k, v = line.split(":", 1)
        headers.setdefault(k.strip().lower(), []).append(v.strip())
    if target.startswith("/refuse"):
        body = b"no entry"
        conn.sendall(b"HTTP/1.1 403 Forbidden\r\ncontent-type: text/plain\r\nx-why: a test\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        conn.close()
        return
    accept = base64.b64encode(hashlib.sha1((headers["sec-websocket-key"][0] + GUID).encode()).digest()).decode()
    offered = [p.strip() for v in headers.get("sec-websocket-protocol", []) for p in v.split(",")]
    chosen = "sec-websocket-protocol: chat.v2\r\n" if "chat.v2" in offered else ""
    conn.sendall(("HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                  f"sec-websocket-accept: {accept}\r\n{chosen}set-cookie: seen=1\r\n\r\n").encode())
    send(conn, 1, json.dumps({"method": method, "target": target, "headers": headers}).encode())
    pinged = None
    while True:
        op, data = recv(f)
        if op == 8:
            code = struct.unpack("!H", data[:2])[0] if len(data) >= 2 else 1005
            with open("/tmp/ws-close", "w") as out:
                out.write(json.dumps({"code": code, "reason": data[2:].decode()}))
            send(conn, 8, data)
            conn.close()
            return
        if op == 10:
            send(conn, 1, b"ponged" if data == pinged else b"wrong pong")
        elif data == b"frag":
            send(conn, 1, b"a", fin=False); send(conn, 0, b"b", fin=False); send(conn, 0, b"c")
        elif data == b"ping-me":
            pinged = b"are you there"
            send(conn, 9, pinged)
        elif data == b"close-4000":
            send(conn, 8, struct.pack("!H", 4000) + b"bye")
        elif data == b"huge":
            conn.sendall(bytes([0x82, 127]) + struct.pack("!Q", 17 * 2**20) + b"x" * 65536)
        else:
            send(conn, op, data)

srv = socket.create_server(("0.0.0.0", 8002))
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def ws_url(server: Server, sid: str, path: str = "") -> str:
    return f"ws://127.0.0.1:{server.port}/v1/sandboxes/{sid}/ports/{PORT}/{path}"


def open_ws(server: Server, sid: str, path: str = "", key: str | None = None, **kw: Any) -> ClientConnection:
    headers = {"authorization": f"Bearer {key or server.admin_key}", "cookie": "a=b"}
    return connect(ws_url(server, sid, path), additional_headers=headers, proxy=None, open_timeout=60,
                   max_size=None, **kw)


def hello(ws: ClientConnection) -> dict[str, Any]:
    first = json.loads(ws.recv(timeout=30))
    assert isinstance(first, dict)
    return first


def ws_serving(server: Server, sid: str) -> bool:
    try:
        with open_ws(server, sid, "up") as ws:
            return hello(ws)["target"] == "/up"
    except (InvalidStatus, OSError, ConnectionClosed):
        return False


@pytest.fixture(scope="module")
def sandbox(server: Server, api: httpx.Client) -> Iterator[str]:
    sid = create_sandbox(api)
    try:
        r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/ws.py"}, content=SERVER.encode())
        assert r.status_code in (200, 201), r.text
        r = api.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": ["python3", "/tmp/ws.py"]})
        assert r.status_code == 201, r.text
        wait_for(lambda: ws_serving(server, sid), 60, "the WebSocket server to listen on 8002")
        yield sid
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_handshake_and_messages_both_ways(server: Server, sandbox: str) -> None:
    with open_ws(server, sandbox, "echo%2Fpath/x?q=1&r=a%20b", subprotocols=["chat.v1", "chat.v2"]) as ws:
        seen = hello(ws)
        assert seen["method"] == "GET" and seen["target"] == "/echo%2Fpath/x?q=1&r=a%20b"
        assert seen["headers"]["host"] == [f"localhost:{PORT}"]
        assert "authorization" not in seen["headers"]  # the caller's API key stays with the control plane
        assert seen["headers"]["cookie"] == ["a=b"]
        assert ws.subprotocol == "chat.v2"
        assert ws.response is not None and ws.response.headers.get("set-cookie") == "seen=1"

        ws.send("héllo, wörld")
        assert ws.recv(timeout=30) == "héllo, wörld"
        blob = bytes(range(256)) * 4096  # 1 MiB
        ws.send(blob)
        assert ws.recv(timeout=30) == blob
        ws.send("frag")
        assert ws.recv(timeout=30) == "abc"  # three fragments from the server, one message here
        ws.send("ping-me")
        assert ws.recv(timeout=30) == "ponged"  # the node's hop answered the server's ping


def test_close_codes_travel_end_to_end(server: Server, api: httpx.Client, sandbox: str) -> None:
    with open_ws(server, sandbox, "closing") as ws:
        hello(ws)
        ws.close(code=4001, reason="done here")

    def server_saw() -> dict[str, Any] | None:
        r = api.get(f"/v1/sandboxes/{sandbox}/files", params={"path": "/tmp/ws-close"})
        return r.json() if r.status_code == 200 and r.content else None  # type: ignore[no-any-return]

    assert wait_for(server_saw, 30, "the server to get the client's close") == {"code": 4001, "reason": "done here"}

    with open_ws(server, sandbox, "closing") as ws:
        hello(ws)
        ws.send("close-4000")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4000, "bye")


def test_refusals_keep_their_status(server: Server, api: httpx.Client, sandbox: str) -> None:
    with pytest.raises(InvalidStatus) as refused:
        open_ws(server, sandbox, "refuse")
    answer = refused.value.response
    assert answer.status_code == 403 and answer.body == b"no entry"
    assert answer.headers.get("x-why") == "a test" and "x-space-upstream-status" not in answer.headers

    with pytest.raises(InvalidStatus) as closed_port:
        connect(f"ws://127.0.0.1:{server.port}/v1/sandboxes/{sandbox}/ports/8009/",
                additional_headers={"authorization": f"Bearer {server.admin_key}"}, proxy=None, open_timeout=60)
    assert closed_port.value.response.status_code == 502
    assert json.loads(closed_port.value.response.body)["error"]["code"] == "port_not_open"

    with pytest.raises(InvalidStatus) as no_key:
        connect(ws_url(server, sandbox), proxy=None, open_timeout=60)
    assert no_key.value.response.status_code == 401

    r = api.post("/v1/apikeys", json={"tenant": "default", "role": "readonly", "name": "ws-reader"})
    assert r.status_code == 201, r.text
    with pytest.raises(InvalidStatus) as read_only:
        open_ws(server, sandbox, key=r.json()["key"])
    assert read_only.value.response.status_code == 403  # a WebSocket writes as much as it reads


def test_a_message_over_the_bound_closes_with_1009(server: Server, sandbox: str) -> None:
    with open_ws(server, sandbox, "big") as ws:
        hello(ws)
        ws.send("huge")  # the server announces a 17 MiB frame: refused at its header
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


def test_fork_with_a_websocket_open(server: Server, api: httpx.Client, sandbox: str) -> None:
    with open_ws(server, sandbox, "held") as ws:
        hello(ws)
        r = api.post(f"/v1/sandboxes/{sandbox}/fork", json={"count": 1})
        assert r.status_code == 202, r.text
        op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
        assert op["status"] == "succeeded", op
        # The snapshot reset the node's connection into the sandbox: this WebSocket ended with it.
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
    fork = op["result"]["sandbox_ids"][0]
    try:
        with open_ws(server, fork, "in-the-fork") as ws:
            assert hello(ws)["target"] == "/in-the-fork"
            ws.send(b"\x00\x01")
            assert ws.recv(timeout=30) == b"\x00\x01"
    finally:
        api.delete(f"/v1/sandboxes/{fork}")
    assert ws_serving(server, sandbox)
