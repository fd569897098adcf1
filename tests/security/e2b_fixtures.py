"""Helpers of the E2B facade's adversarial tests (tests/security/test_e2b_*.py): keys of each role,
raw envd and port requests as an attacker sends them, and what a sandbox looked like before one.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import httpx

from tests.e2e.harness import Server

ENVD_PORT = "49983"
#: A server for a sandbox's port 8000 that answers every GET and POST with 200.
PORT_SERVER = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        n = int(self.headers.get("content-length") or 0)
        self.rfile.read(n)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    do_GET = do_POST = _answer
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


def new_key(server: Server, tenant: str, role: str) -> str:
    with server.client() as admin:
        r = admin.post("/v1/apikeys", json={"tenant": tenant, "role": role, "name": f"e2b-sec-{role}"})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


@dataclasses.dataclass(frozen=True)
class Keys:
    """SPACE API keys of the admin key's tenant (``default``) and one of another tenant."""

    admin: str
    member: str
    readonly: str
    other_tenant: str


def keys(server: Server) -> Keys:
    return Keys(admin=server.admin_key, member=new_key(server, "default", "member"),
                readonly=new_key(server, "default", "readonly"),
                other_tenant=new_key(server, "e2b-sec-other", "admin"))


def envelope(msg: dict[str, Any]) -> bytes:
    """One Connect envelope (a server-streaming call's request body)."""
    raw = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(raw)) + raw


def envd_headers(sandbox_id: str, **extra: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": ENVD_PORT, **extra}


def rpc(server: Server, sandbox_id: str, method: str, msg: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    """A unary envd RPC (``filesystem.Filesystem/Stat``, ``process.Process/List``, ...)."""
    return httpx.post(f"{server.url}/{method}", json=msg, timeout=120,
                      headers={**envd_headers(sandbox_id), "Connect-Protocol-Version": "1", **headers})


def start_process(server: Server, sandbox_id: str, headers: dict[str, str]) -> httpx.Response:
    """``process.Process/Start`` of ``touch /tmp/pwned``: the exec an attacker is after."""
    body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "touch /tmp/pwned"]}})
    return httpx.post(f"{server.url}/process.Process/Start", content=body, timeout=120,
                      headers={**envd_headers(sandbox_id), "Content-Type": "application/connect+json",
                               "Connect-Protocol-Version": "1", **headers})


def port_request(server: Server, sandbox_id: str, headers: dict[str, str], method: str = "GET") -> httpx.Response:
    return httpx.request(method, f"{server.url}/", timeout=120,
                         headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8000", **headers})


@dataclasses.dataclass(frozen=True)
class Seen:
    """A sandbox as SPACE records it, to compare before and after a request."""

    state: str
    last_active_at: str | None
    on_expire: str
    events: int
    audit_next: int


def seen(server: Server, sandbox_id: str) -> Seen:
    with server.client() as admin:
        sb = admin.get(f"/v1/sandboxes/{sandbox_id}").json()
        events = admin.get(f"/v1/sandboxes/{sandbox_id}/events").json()["events"]
        audit = admin.get("/v1/audit", params={"limit": 1000, "after": 0, "target": sandbox_id}).json()
    return Seen(state=sb["state"], last_active_at=sb["last_active_at"], on_expire=sb["on_expire"],
                events=len(events), audit_next=int(audit["next"]))


def effects_since(server: Server, sandbox_id: str, before: Seen) -> list[dict[str, Any]]:
    """The audit records of calls about the sandbox since ``before`` that succeeded."""
    with server.client() as admin:
        rows = admin.get("/v1/audit", params={"limit": 1000, "after": before.audit_next,
                                              "target": sandbox_id}).json()["records"]
    return [r for r in rows if r["result"] == "ok"]
