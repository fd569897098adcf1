"""E2B's wire protocol as older SDKs and other clients send it: the 1.x/2.x control paths, error
bodies, the edge's answers, Connect framing — and SPACE's own API beside it on the same port."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.harness import Server, runtime_available

pytestmark = [pytest.mark.runtime, pytest.mark.skipif(runtime_available() is not None,
                                                      reason=str(runtime_available()))]


@pytest.fixture
def e2b_api(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"x-api-key": server.admin_key}, timeout=120) as c:
        yield c


@pytest.fixture
def envd(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _envelopes(raw: bytes) -> list[tuple[int, dict[str, object]]]:
    out = []
    while raw:
        flags, size = struct.unpack(">BI", raw[:5])
        out.append((flags, json.loads(raw[5:5 + size])))
        raw = raw[5 + size:]
    return out


def test_older_sdk_paths_and_status_codes(e2b_api: httpx.Client) -> None:
    r = e2b_api.post("/sandboxes", json={"templateID": "base", "timeout": 120, "secure": True, "metadata": {}})
    assert r.status_code == 201, r.text
    body = r.json()
    sid = body["sandboxID"]
    try:
        assert {"templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken"} <= body.keys()
        assert body["envdVersion"] == "0.6.4"
        assert sid in [s["sandboxID"] for s in e2b_api.get("/sandboxes").json()]
        assert e2b_api.post(f"/sandboxes/{sid}/connect", json={"timeout": 120}).status_code == 200
        assert e2b_api.post(f"/sandboxes/{sid}/resume", json={"timeout": 60}).status_code == 409
        assert e2b_api.post(f"/sandboxes/{sid}/pause").status_code == 204
        again = e2b_api.post(f"/sandboxes/{sid}/pause")
        assert again.status_code == 409 and again.json()["code"] == 409
        listed = e2b_api.get("/v2/sandboxes", params={"state": "paused"})
        assert sid in [s["sandboxID"] for s in listed.json()]
        assert sid not in [s["sandboxID"] for s in e2b_api.get("/sandboxes").json()]  # running only
        assert e2b_api.post(f"/sandboxes/{sid}/resume", json={"timeout": 60}).status_code == 201
        detail = e2b_api.get(f"/sandboxes/{sid}").json()
        assert detail["state"] == "running"
        assert {"startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB", "envdVersion"} <= detail.keys()
    finally:
        assert e2b_api.delete(f"/sandboxes/{sid}").status_code == 204
    gone = e2b_api.delete(f"/sandboxes/{sid}")
    assert gone.status_code == 404
    assert set(gone.json()) >= {"code", "message"} and gone.json()["code"] == 404
    assert e2b_api.post(f"/v2/sandboxes/{sid}/connect", json={}).status_code == 404


def test_control_error_bodies(server: Server, e2b_api: httpx.Client) -> None:
    anon = httpx.post(f"{server.url}/v2/sandboxes", json={"templateID": "base"})
    assert anon.status_code == 401 and anon.json()["code"] == 401 and anon.json()["message"]
    bad = e2b_api.post("/v2/sandboxes", json={"timeout": 5})
    assert bad.status_code == 400 and "templateID" in bad.json()["message"]
    unknown = e2b_api.post("/v2/sandboxes", json={"templateID": "no-such-template"})
    assert unknown.status_code == 404 and unknown.json()["code"] == 404
    # A refusal is not retried by the SDK.
    assert unknown.headers.get("should-retry") == "false"
    # SPACE's own API still answers on the same port, in its own error shape.
    own = httpx.get(f"{server.url}/v1/sandboxes")
    assert own.status_code == 401 and "error" in own.json()


def test_envd_edge_answers(e2b_api: httpx.Client, envd: httpx.Client) -> None:
    missing = envd.get("/health", headers={"e2b-sandbox-id": "snosuchsandbox000000"})
    assert missing.status_code == 502
    assert missing.json() == {"sandboxId": "snosuchsandbox000000", "message": "The sandbox was not found",
                              "code": 502}
    body = e2b_api.post("/v2/sandboxes", json={"templateID": "base", "metadata": {}, "envVars": {}}).json()
    sid, token = body["sandboxID"], body["envdAccessToken"]
    try:
        h = {"e2b-sandbox-id": sid, "e2b-sandbox-port": "49983", "connect-protocol-version": "1"}
        assert envd.get("/health", headers=h).status_code == 204
        nope = envd.post("/process.Process/List", json={}, headers={**h, "x-access-token": "wrong"})
        assert nope.status_code == 401 and nope.json()["code"] == "unauthenticated"
        h["x-access-token"] = token
        missing_rpc = envd.post("/process.Process/Frobnicate", json={}, headers=h)
        assert missing_rpc.status_code == 501 and missing_rpc.json()["code"] == "unimplemented"
        bad_pid = envd.post("/process.Process/SendSignal", headers=h,
                            json={"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"})
        assert bad_pid.status_code == 404 and bad_pid.json()["code"] == "not_found"
        # A server stream, framed by hand: start, data, end, then the end-of-stream envelope.
        msg = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hello"]}, "stdin": False})
        req = struct.pack(">BI", 0, len(msg)) + msg.encode()
        r = envd.post("/process.Process/Start", content=req,
                      headers={**h, "content-type": "application/connect+json"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/connect+json"
        frames = _envelopes(r.content)
        events = [f[1]["event"] for f in frames[:-1]]
        assert "start" in events[0]
        out = "".join(__import__("base64").b64decode(e["data"]["stdout"]).decode() for e in events if "data" in e)
        assert out == "hello\n"
        assert events[-1] == {"end": {"exitCode": 0, "exited": True, "status": "exit status 0"}}
        assert frames[-1] == (2, {})
        # Paused: the edge says "not found", as E2B's does (no auto-resume asked for).
        assert e2b_api.post(f"/sandboxes/{sid}/pause").status_code == 204
        paused = envd.post("/process.Process/List", json={}, headers=h)
        assert paused.status_code == 502 and "was not found" in paused.json()["message"]
    finally:
        e2b_api.delete(f"/sandboxes/{sid}")
