"""A sandbox whose kernel dies (here: the host OOM killer, over its memory limit) fails cleanly:
the running command's stream ends with an error naming the cause instead of hanging, the sandbox
becomes ``failed`` with that reason, later calls get 409, and delete still cleans it up."""

from __future__ import annotations

import httpx
import pytest

from space import Client
from space.errors import InvalidState, RuntimeFailure
from tests.e2e.harness import Server, create_sandbox, wait_for, wait_operation

pytestmark = pytest.mark.runtime


def test_out_of_memory_fails_the_sandbox_with_its_reason(api: httpx.Client, server: Server) -> None:
    sid = create_sandbox(api, memory_mb=256)
    with Client(server.url, server.admin_key, timeout=60) as client:
        sb = client.sandboxes.ref(sid)
        # Mid-stream the death arrives as the stream's error event (RuntimeFailure); a call that
        # reaches the node after it gets the 409 naming the failed state. Either way: the reason.
        with pytest.raises((RuntimeFailure, InvalidState)) as died:
            sb.exec(["python3", "-c", "x = bytearray(700 * 1024 * 1024); print('survived')"])
        assert "ran out of memory" in died.value.message
        with pytest.raises(InvalidState) as after:
            sb.exec("true")
        assert after.value.state == "failed"
    got = wait_for(lambda: (s := api.get(f"/v1/sandboxes/{sid}").json())["state"] == "failed" and s, 30,
                   "the sandbox to be failed")
    assert "memory" in got["error"]["message"] and got["allowed_actions"] == ["delete"]
    d = api.delete(f"/v1/sandboxes/{sid}").json()
    assert wait_operation(api, d["operation"]["id"])["status"] == "succeeded"
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "terminated"


def test_a_stream_attached_when_the_sandbox_dies_ends_with_an_error_event(api: httpx.Client) -> None:
    sid = create_sandbox(api, memory_mb=256)
    prog = "import sys, time; print('up', flush=True); sys.stdin.read(); x = bytearray(700 * 1024 * 1024)"
    cid = api.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": ["python3", "-c", prog], "stdin": True}).json()["id"]
    with api.stream("GET", f"/v1/sandboxes/{sid}/commands/{cid}/events") as r:
        lines = r.iter_lines()
        # Attached and seeing output; only then let the program allocate.
        assert next(line for line in lines if line.startswith("event: ")) == "event: stdout"
        api.post(f"/v1/sandboxes/{sid}/commands/{cid}/stdin", content=b"", params={"eof": "true"})
        rest = list(lines)
    events = [line[len("event: "):] for line in rest if line.startswith("event: ")]
    assert events[-1] == "error", rest
    data = [line for line in rest if line.startswith("data: ")][-1]
    assert "ran out of memory" in data and "runtime_error" in data
    api.delete(f"/v1/sandboxes/{sid}")
