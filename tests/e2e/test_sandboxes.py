"""End to end through the public API against a real ``space serve`` with gVisor sandboxes.

Aspects: the create/get/list/delete contract and operations, idempotency keys, the sandbox's own
kernel, CPU and memory limits on the host cgroup, commands (exit codes, stdout/stderr, SSE ids and
resume, stdin, signals, PTY, env/cwd/user), tenancy, and the error contract.
"""

from __future__ import annotations

import base64
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import Server, create_sandbox, read_events, run, wait_operation

pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def sandbox(api: httpx.Client) -> Iterator[str]:
    sid = create_sandbox(api, cpu=1, memory_mb=384, env={"SANDBOX_WIDE": "yes"})
    yield sid
    api.delete(f"/v1/sandboxes/{sid}")


def test_create_contract_and_running_state(api: httpx.Client) -> None:
    r = api.post("/v1/sandboxes", json={"template": "base"})
    assert r.status_code == 202
    body = r.json()
    assert body["sandbox"]["state"] == "creating"
    assert body["operation"]["status"] in ("pending", "running", "succeeded")
    op = wait_operation(api, body["operation"]["id"])
    assert op["status"] == "succeeded" and op["error"] is None
    sid = body["sandbox"]["id"]
    got = api.get(f"/v1/sandboxes/{sid}").json()
    assert got["state"] == "running" and got["template"] == "base"
    assert sid in [s["id"] for s in api.get("/v1/sandboxes").json()["sandboxes"]]
    d = api.delete(f"/v1/sandboxes/{sid}")
    assert d.status_code == 202
    assert wait_operation(api, d.json()["operation"]["id"])["status"] == "succeeded"
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "terminated"
    assert sid not in [s["id"] for s in api.get("/v1/sandboxes").json()["sandboxes"]]


def test_idempotency_key_returns_the_same_operation(api: httpx.Client) -> None:
    h = {"Idempotency-Key": "create-once-" + os.urandom(4).hex()}
    a = api.post("/v1/sandboxes", json={"template": "base"}, headers=h).json()
    b = api.post("/v1/sandboxes", json={"template": "base"}, headers=h).json()
    assert a["operation"]["id"] == b["operation"]["id"]
    assert a["sandbox"]["id"] == b["sandbox"]["id"]
    wait_operation(api, a["operation"]["id"])
    api.delete(f"/v1/sandboxes/{a['sandbox']['id']}")


def test_own_kernel(api: httpx.Client, sandbox: str) -> None:
    code, out, _ = run(api, sandbox, {"cmd": ["uname", "-r"]})
    assert code == 0
    assert out.strip() and out.strip().decode() != platform.release()


def test_limits_applied_on_host_cgroup(api: httpx.Client, sandbox: str, server: Server) -> None:
    sb = api.get(f"/v1/sandboxes/{sandbox}").json()
    instance = next(Path("/sys/fs/cgroup/memory/space").glob(f"{sandbox}-*"))
    assert int((instance / "memory.limit_in_bytes").read_text()) == 384 * 1024 * 1024
    cpu = Path("/sys/fs/cgroup/cpu/space") / instance.name
    assert int((cpu / "cpu.cfs_quota_us").read_text()) == int(sb["cpu"] * 100_000)


def test_exec_exit_code_and_streams(api: httpx.Client, sandbox: str) -> None:
    code, out, err = run(api, sandbox, {"shell": "echo out; echo err >&2; exit 7"})
    assert (code, out, err) == (7, b"out\n", b"err\n")
    code, out, _ = run(api, sandbox, {"cmd": ["python3", "-c", "print(6*7)"]})
    assert (code, out) == (0, b"42\n")


def test_exec_env_cwd_user(api: httpx.Client, sandbox: str) -> None:
    code, out, _ = run(api, sandbox, {"shell": "echo $SANDBOX_WIDE $ONE; pwd; id -un",
                                      "env": {"ONE": "1"}, "cwd": "/tmp"})
    assert code == 0
    assert out.decode().split() == ["yes", "1", "/tmp", "user"]
    code, out, _ = run(api, sandbox, {"cmd": ["id", "-u"], "user": "root"})
    assert out.strip() == b"0"


def test_a_command_started_for_its_event_stream_is_run_in_one_request(api: httpx.Client, sandbox: str) -> None:
    """POST .../commands with ``Accept: text/event-stream`` answers with the command's events,
    led by a ``started`` event holding what the JSON answer holds; the same events stay readable
    (and resumable) through GET .../events."""
    import json

    events: list[dict[str, object]] = []
    with api.stream("POST", f"/v1/sandboxes/{sandbox}/commands", json={"shell": "echo one; echo two >&2; exit 3"},
                    headers={"Accept": "text/event-stream"}) as r:
        assert r.status_code == 201 and r.headers["content-type"].startswith("text/event-stream")
        ev: dict[str, object] = {}
        for line in r.iter_lines():
            if line.startswith(":"):
                continue
            if not line:
                if ev:
                    events.append({**ev, "data": json.loads(str(ev["data"]))})
                ev = {}
                continue
            key, _, value = line.partition(":")
            ev[key] = value[1:] if value.startswith(" ") else value
    started = events[0]
    assert started["event"] == "started" and "id" not in started, started
    info = started["data"]
    assert isinstance(info, dict) and info["attach_token"] and info["sandbox_id"] == sandbox
    rest = events[1:]
    out = b"".join(base64.b64decode(e["data"]["data"]) for e in rest if e["event"] == "stdout")  # type: ignore[index]
    err = b"".join(base64.b64decode(e["data"]["data"]) for e in rest if e["event"] == "stderr")  # type: ignore[index]
    assert (out, err) == (b"one\n", b"two\n")
    assert rest[-1]["event"] == "exit" and rest[-1]["data"]["exit_code"] == 3  # type: ignore[index]
    again = read_events(api, sandbox, str(info["id"]))
    assert [e["id"] for e in again] == [e["id"] for e in rest]
    # Without asking for events (or accepting anything) the answer is the command as JSON.
    plain = api.post(f"/v1/sandboxes/{sandbox}/commands", json={"cmd": ["true"]}, headers={"Accept": "*/*"})
    assert plain.status_code == 201 and plain.json()["id"]


def _read_frames(data: bytes) -> list[tuple[dict[str, object], bytes]]:
    """``u32 header_len | u32 payload_len | header | payload`` frames, parsed here on their own (not
    with the shared decoder: a bug the encoder and decoder share would pass unseen)."""
    import json
    import struct

    frames, at = [], 0
    while at < len(data):
        hlen, plen = struct.unpack(">II", data[at : at + 8])
        header = data[at + 8 : at + 8 + hlen]
        if hlen:
            frames.append((json.loads(header), data[at + 8 + hlen : at + 8 + hlen + plen]))
        at += 8 + hlen + plen
    assert at == len(data)
    return frames


def test_frames_carry_the_same_events_as_sse_with_output_unencoded(api: httpx.Client, sandbox: str) -> None:
    """``Accept: application/x-space-events``: the same events, output as raw bytes (every byte
    value, more than one chunk of it), in one request and through GET .../events with resume."""
    script = "import sys; sys.stdout.buffer.write(bytes(range(256)) * 1024); sys.stderr.write('e'); sys.exit(4)"
    with api.stream("POST", f"/v1/sandboxes/{sandbox}/commands", json={"cmd": ["python3", "-c", script]},
                    headers={"Accept": "application/x-space-events"}) as r:
        assert r.status_code == 201 and r.headers["content-type"] == "application/x-space-events"
        frames = _read_frames(r.read())
    started, rest = frames[0], frames[1:]
    assert started[0]["event"] == "started" and started[0]["attach_token"] and started[1] == b""
    out = b"".join(p for h, p in rest if h["event"] == "stdout")
    assert out == bytes(range(256)) * 1024 and b"".join(p for h, p in rest if h["event"] == "stderr") == b"e"
    assert rest[-1][0] == {"event": "exit", "seq": rest[-1][0]["seq"], "exit_code": 4, "signal": None,
                           "timed_out": False}
    cid = str(started[0]["id"])
    # The SSE form of the same command holds the same events, in the same order, with the same seqs.
    sse = read_events(api, sandbox, cid)
    assert [(e["event"], int(e["id"])) for e in sse] == [(h["event"], h["seq"]) for h, _ in rest]
    assert [base64.b64decode(e["data"]["data"]) for e in sse if e["event"] == "stdout"] == [
        p for h, p in rest if h["event"] == "stdout"]
    # Resumed after the first event, as frames.
    again = api.get(f"/v1/sandboxes/{sandbox}/commands/{cid}/events",
                    headers={"Accept": "application/x-space-events", "Last-Event-ID": str(rest[0][0]["seq"])})
    assert again.headers["content-type"] == "application/x-space-events"
    assert [h for h, _ in _read_frames(again.content)] == [h for h, _ in rest[1:]]


def test_events_have_ids_and_resume_with_last_event_id(api: httpx.Client, sandbox: str) -> None:
    r = api.post(f"/v1/sandboxes/{sandbox}/commands", json={"shell": "for i in 1 2 3 4 5; do echo $i; done"})
    cid = r.json()["id"]
    full = read_events(api, sandbox, cid)
    ids = [int(e["id"]) for e in full]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert full[-1]["event"] == "exit"
    # A client that saw the first event reconnects and gets exactly the rest.
    rest = read_events(api, sandbox, cid, headers={"Last-Event-ID": str(ids[0])})
    assert [e["id"] for e in rest] == [e["id"] for e in full[1:]]
    # The attach token authorizes the stream without an API key.
    token = r.json()["attach_token"]
    with httpx.Client(base_url=str(api.base_url)) as anon:
        again = read_events(anon, sandbox, cid, params={"token": token})
        assert [e["id"] for e in again] == [e["id"] for e in full]
        bad = anon.get(f"/v1/sandboxes/{sandbox}/commands/{cid}/events", params={"token": "nope"})
        assert bad.status_code == 401


def test_stdin_and_signal(api: httpx.Client, sandbox: str) -> None:
    r = api.post(f"/v1/sandboxes/{sandbox}/commands", json={"cmd": ["cat"], "stdin": True})
    cid = r.json()["id"]
    assert api.post(f"/v1/sandboxes/{sandbox}/commands/{cid}/stdin", content=b"hello\n",
                    params={"eof": "true"}).status_code == 204
    events = read_events(api, sandbox, cid)
    out = b"".join(base64.b64decode(e["data"]["data"]) for e in events if e["event"] == "stdout")
    assert out == b"hello\n" and events[-1]["data"]["exit_code"] == 0

    r = api.post(f"/v1/sandboxes/{sandbox}/commands", json={"cmd": ["sleep", "300"]})
    cid = r.json()["id"]
    assert api.post(f"/v1/sandboxes/{sandbox}/commands/{cid}/signal",
                    json={"signal": "SIGTERM"}).status_code == 204
    last = read_events(api, sandbox, cid)[-1]
    assert last["event"] == "exit" and last["data"]["signal"] == 15
    listed = api.get(f"/v1/sandboxes/{sandbox}/commands").json()["commands"]
    assert any(c["id"] == cid and c["state"] == "exited" for c in listed)


def test_pty(api: httpx.Client, sandbox: str) -> None:
    code, out, _ = run(api, sandbox, {"shell": "test -t 1 && stty size", "pty": {"rows": 33, "cols": 101}})
    assert code == 0 and out.strip() == b"33 101"


def test_errors_are_json_with_codes(api: httpx.Client, server: Server, sandbox: str) -> None:
    def err(r: httpx.Response, status: int, code: str) -> dict[str, object]:
        assert r.status_code == status, r.text
        body = r.json()["error"]
        assert body["code"] == code and body["message"]
        return dict(body)

    err(api.post("/v1/sandboxes", json={"template": "no-such-template"}), 404, "not_found")
    err(api.get("/v1/sandboxes/snosuchsandbox000000"), 404, "not_found")
    err(api.post("/v1/sandboxes", json={"template": "base", "cpu": "lots"}), 422, "validation_failed")
    err(api.post("/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"}),
        422, "validation_failed")
    err(api.post(f"/v1/sandboxes/{sandbox}/commands", json={}), 400, "invalid_request")
    err(api.get(f"/v1/sandboxes/{sandbox}/commands/cnosuchcommand00/events"), 404, "not_found")
    err(api.get(f"/v1/sandboxes/{sandbox}/commands/cnosuchcommand00"), 404, "not_found")
    with httpx.Client(base_url=server.url) as anon:
        err(anon.get("/v1/sandboxes"), 401, "unauthorized")
        err(anon.get("/v1/sandboxes", headers={"authorization": "Bearer sk_wrong"}), 401, "unauthorized")


def test_exec_on_a_sandbox_that_is_not_running_is_409(api: httpx.Client) -> None:
    sid = create_sandbox(api)
    d = api.delete(f"/v1/sandboxes/{sid}").json()
    wait_operation(api, d["operation"]["id"])
    r = api.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": ["true"]})
    assert r.status_code == 409
    body = r.json()["error"]
    assert body["code"] == "invalid_state" and body["state"] == "terminated"
    assert "terminated" in body["message"] and body["allowed"] == []


def test_tenants_cannot_see_each_other(api: httpx.Client, server: Server, sandbox: str) -> None:
    key = api.post("/v1/apikeys", json={"tenant": "acme", "role": "member"}).json()["key"]
    with server.client(key) as acme:
        assert acme.get(f"/v1/sandboxes/{sandbox}").status_code == 404
        assert acme.post(f"/v1/sandboxes/{sandbox}/commands", json={"cmd": ["true"]}).status_code == 404
        assert acme.get(f"/v1/sandboxes/{sandbox}/files", params={"path": "/etc/hostname"}).status_code == 404
        assert acme.delete(f"/v1/sandboxes/{sandbox}").status_code == 404
        assert sandbox not in [s["id"] for s in acme.get("/v1/sandboxes").json()["sandboxes"]]
        assert acme.post("/v1/apikeys", json={"tenant": "x"}).status_code == 403
        own = create_sandbox(acme)
        assert api.get(f"/v1/sandboxes/{own}").status_code == 404
        acme.delete(f"/v1/sandboxes/{own}")


def test_metrics_and_health(server: Server) -> None:
    assert httpx.get(f"{server.url}/healthz").json()["status"] == "ok"
    text = httpx.get(f"{server.url}/metrics").text
    assert "space_http_requests_total" in text
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert "/v1/sandboxes" in spec["paths"]


def test_command_timeout_is_enforced_in_the_sandbox(api: httpx.Client, sandbox: str) -> None:
    r = api.post(f"/v1/sandboxes/{sandbox}/commands", json={"cmd": ["sleep", "600"], "timeout": 0.5})
    last = read_events(api, sandbox, r.json()["id"])[-1]
    assert last["event"] == "exit" and last["data"]["signal"] == 9


def test_reattach_to_a_running_command(api: httpx.Client, sandbox: str) -> None:
    """A client that drops mid-stream and comes back sees every byte once, in order."""
    r = api.post(f"/v1/sandboxes/{sandbox}/commands",
                 json={"shell": "for i in $(seq 1 40); do echo line$i; sleep 0.02; done"})
    cid = r.json()["id"]
    first = read_events(api, sandbox, cid, limit=3)  # then "drop"
    rest = read_events(api, sandbox, cid, headers={"Last-Event-ID": first[-1]["id"]})
    out = b"".join(base64.b64decode(e["data"]["data"]) for e in first + rest if e["event"] == "stdout")
    assert out == b"".join(b"line%d\n" % i for i in range(1, 41))
    assert rest[-1]["event"] == "exit" and rest[-1]["data"]["exit_code"] == 0


def test_revoked_key_stops_working_at_once(api: httpx.Client, server: Server) -> None:
    made = api.post("/v1/apikeys", json={"tenant": "revoke-me", "role": "readonly"}).json()
    with server.client(made["key"]) as c:
        assert c.get("/v1/sandboxes").status_code == 200
        assert c.post("/v1/sandboxes", json={"template": "base"}).status_code == 403  # read-only role
        assert api.delete(f"/v1/apikeys/{made['id']}").status_code == 204
        r = c.get("/v1/sandboxes")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    listed = api.get("/v1/apikeys").json()["apikeys"]
    assert all("key" not in k for k in listed) and made["id"] not in [k["id"] for k in listed]


def test_quiet_streams_get_keepalives(api: httpx.Client, sandbox: str) -> None:
    """The test server sends a keepalive after 1 s of silence (production: 15 s)."""
    cid = api.post(f"/v1/sandboxes/{sandbox}/commands", json={"shell": "sleep 2.5; echo done"}).json()["id"]
    with api.stream("GET", f"/v1/sandboxes/{sandbox}/commands/{cid}/events") as r:
        lines = list(r.iter_lines())
    assert ": keepalive" in lines
    events = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    assert events == ["stdout", "exit"]
