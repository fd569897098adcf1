"""Servers inside a sandbox, reached through E2B's port routing: ``E2b-Sandbox-Port`` on the one
URL (what SDKs ≥ 2.7 and e2b-code-interpreter use) and ``<port>-<id>.<domain>`` host names."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

from tests.conftest import E2B_TEST_DOMAIN
from tests.e2e import e2b_env
from tests.e2e.harness import Server, runtime_available
from tests.waiting import wait_for

pytestmark = [pytest.mark.runtime, pytest.mark.skipif(runtime_available() is not None,
                                                      reason=str(runtime_available()))]

e2b = pytest.importorskip("e2b")

SERVER = """
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        n = int(self.headers.get("content-length") or 0)
        body = json.dumps({"path": self.path, "method": self.command, "body": self.rfile.read(n).decode(),
                           "headers": {k.lower(): v for k, v in self.headers.items()},
                           "names": list(self.headers.keys())}).encode()
        self.send_response(201 if self.command == "POST" else 200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _answer
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


def _serve(sbx: e2b.Sandbox, server: Server) -> None:
    sbx.files.write("/home/user/srv.py", SERVER)
    sbx.commands.run("python3 /home/user/srv.py", background=True, timeout=0)

    def up() -> bool:
        r = httpx.get(f"{server.url}/", headers={"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "8000"})
        return r.status_code == 200

    wait_for(up, timeout=30, what="the server in the sandbox")


def test_port_traffic_reaches_the_sandbox_server(made: e2b_env.Sandboxes, server: Server) -> None:
    sbx = e2b.Sandbox.create()
    made.add(sbx.sandbox_id)
    _serve(sbx, server)
    h = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "8000", "x-access-token": "secret-ish",
         # Only the control plane names the Host the server sees (a sandbox's port_host): not a client.
         "x-space-upstream-host": "claimed.example"}
    r = httpx.post(f"{server.url}/echo/a%20b?x=1", headers=h, content=b"payload")
    assert r.status_code == 201
    got = r.json()
    assert got["path"] == "/echo/a%20b?x=1" and got["method"] == "POST" and got["body"] == "payload"
    assert got["headers"]["host"] == "localhost:8000" and "x-space-upstream-host" not in got["headers"]
    # The facade's routing headers and tokens are its own: the server never sees them.
    assert not {"e2b-sandbox-id", "e2b-sandbox-port", "x-access-token"} & got["headers"].keys()
    # The host form, as Sandbox.get_host() builds it from the domain create answered (--e2b-domain).
    host = sbx.get_host(8000)
    assert host == f"8000-{sbx.sandbox_id}.{E2B_TEST_DOMAIN}"
    assert e2b.Sandbox.connect(sbx.sandbox_id).get_host(8000) == host  # connect answers it too
    r = httpx.get(f"{server.url}/by-host", headers={"host": host})
    assert r.status_code == 200 and r.json()["path"] == "/by-host"
    # Nothing on that port: E2B's 502 wording, which the SDK maps to "unreachable".
    closed = httpx.get(f"{server.url}/", headers={"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "8001"})
    assert closed.status_code == 502 and "port is not open" in closed.json()["message"]


def test_mask_request_host_is_the_host_the_server_sees(made: e2b_env.Sandboxes, server: Server) -> None:
    sbx = e2b.Sandbox.create(network={"mask_request_host": "custom-host.example.com:${PORT}"})
    made.add(sbx.sandbox_id)
    _serve(sbx, server)
    h = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "8000", "x-space-upstream-host": "claimed.example",
         "x-request-id": "r1"}
    got = httpx.get(f"{server.url}/", headers=h).json()
    seen = got["headers"]
    assert seen["host"] == "custom-host.example.com:8000" and "x-space-upstream-host" not in seen
    # Header names as servers write them: a server that reads "Host:" as written finds it (E2B's
    # own test of mask_request_host greps its request for "Host:").
    assert "Host" in got["names"] and "X-Request-Id" in got["names"], got["names"]
    # SPACE's own port route and its view of the sandbox: the same setting.
    key = {"authorization": f"Bearer {server.admin_key}"}
    own = httpx.get(f"{server.url}/v1/sandboxes/{sbx.sandbox_id}/ports/8000/x", headers=key)
    assert own.json()["headers"]["host"] == "custom-host.example.com:8000"
    view = httpx.get(f"{server.url}/v1/sandboxes/{sbx.sandbox_id}", headers=key).json()
    assert view["port_host"] == "custom-host.example.com:${PORT}"
    # A Host that could split the request, or is no host, is refused before anything is made.
    for bad in ("two words", "evil\r\nx-injected: 1", "a/b", ""):
        r = httpx.post(f"{server.url}/v2/sandboxes", headers={"x-api-key": server.admin_key},
                       json={"templateID": "base", "network": {"maskRequestHost": bad}})
        assert r.status_code == 400, (bad, r.text)
        r = httpx.post(f"{server.url}/v1/sandboxes", headers=key, json={"port_host": bad})
        assert r.status_code == 422 and "port_host" in r.json()["error"]["message"], r.text


def test_port_traffic_waits_out_an_auto_pause(made: e2b_env.Sandboxes, server: Server) -> None:
    """A sandbox whose timeout pauses it (auto-resume): requests to its port that arrive while the
    pause is under way wait for it and wake the sandbox, as before and after it; none answers 502
    "not found" (the second the pause took, before)."""
    sbx = e2b.Sandbox.create(timeout=4, lifecycle={"on_timeout": "pause", "auto_resume": True})
    made.add(sbx.sandbox_id)
    _serve(sbx, server)
    h = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "8000"}
    key = {"authorization": f"Bearer {server.admin_key}"}
    statuses: list[int] = []

    def woken_after_a_pause() -> bool:
        statuses.append(httpx.get(f"{server.url}/", headers=h, timeout=120).status_code)
        events = httpx.get(f"{server.url}/v1/sandboxes/{sbx.sandbox_id}/events", headers=key).json()["events"]
        kinds = [e["kind"] for e in events]
        return "paused" in kinds and "resumed" in kinds[kinds.index("paused"):]

    wait_for(woken_after_a_pause, timeout=90, what="the timeout's pause, then a request that woke it")
    statuses += [httpx.get(f"{server.url}/", headers=h, timeout=120).status_code for _ in range(3)]
    assert set(statuses) == {200}, statuses


def test_private_ports_need_the_traffic_token(made: e2b_env.Sandboxes, server: Server) -> None:
    sbx = e2b.Sandbox.create(network={"allow_public_traffic": False})
    made.add(sbx.sandbox_id)
    _serve_private = sbx.traffic_access_token
    assert _serve_private
    sbx.files.write("/home/user/srv.py", SERVER)
    sbx.commands.run("python3 /home/user/srv.py", background=True, timeout=0)
    h = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "8000"}

    def up() -> bool:
        r = httpx.get(f"{server.url}/", headers={**h, "e2b-traffic-access-token": sbx.traffic_access_token})
        return r.status_code == 200

    wait_for(up, timeout=30, what="the server in the sandbox")
    # E2B's answer without the token (its own SDK tests check for 403), and with a wrong one.
    assert httpx.get(f"{server.url}/", headers=h).status_code == 403
    assert httpx.get(f"{server.url}/", headers={**h, "e2b-traffic-access-token": "wrong"}).status_code == 403


def test_websockets_through_port_routing(made: e2b_env.Sandboxes, server: Server) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from tests.e2e.test_port_websockets import PORT
    from tests.e2e.test_port_websockets import SERVER as WS_SERVER

    sbx = e2b.Sandbox.create(network={"allow_public_traffic": False})
    made.add(sbx.sandbox_id)
    sbx.files.write("/home/user/ws.py", WS_SERVER)
    sbx.commands.run("python3 /home/user/ws.py", background=True, timeout=0)
    routing = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": str(PORT)}
    token = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
    url = f"ws://127.0.0.1:{server.port}/chat?room=1"

    def greeting(headers: dict[str, str], host: str | None = None) -> dict[str, Any] | None:
        # ``host``: the URL's host name, as behind wildcard DNS (connected to the server all the same).
        at = url if host is None else url.replace("127.0.0.1", host)
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        try:
            with connect(at, sock=sock, additional_headers=headers, proxy=None, open_timeout=30) as ws:
                first = json.loads(ws.recv(timeout=30))
                ws.send("echo me")
                assert ws.recv(timeout=30) == "echo me"
                return first  # type: ignore[no-any-return]
        except (InvalidStatus, OSError):
            return None
        finally:
            sock.close()

    seen = wait_for(lambda: greeting({**routing, **token}), timeout=30, what="the WebSocket server in the sandbox")
    assert seen["target"] == "/chat?room=1"
    # The facade's routing headers and tokens are its own: the server never sees them.
    assert not {"e2b-sandbox-id", "e2b-sandbox-port", "e2b-traffic-access-token"} & seen["headers"].keys()
    with pytest.raises(InvalidStatus) as refused:
        connect(url, additional_headers=routing, proxy=None, open_timeout=30)
    assert refused.value.response.status_code == 403
    # The host form, as behind wildcard DNS.
    by_host = greeting(token, host=f"{PORT}-{sbx.sandbox_id}.{E2B_TEST_DOMAIN}")
    assert by_host is not None and by_host["target"] == "/chat?room=1"
