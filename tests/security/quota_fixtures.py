"""What the quota probes share: a small real ``space serve`` and tenants of it."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import Server, own_server, read_events, wait_operation

#: A small pool keeps a fill of it to seconds; its reserve is the default (1 GiB).
POOL_GB = "4"


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with own_server(tmp_path_factory.mktemp("quota"), "--pool-size-gb", POOL_GB) as srv:
        yield srv


class Tenant:
    """A tenant of its own with an admin key (made by the operator)."""

    def __init__(self, server: Server, name: str) -> None:
        self.name = name
        with server.client() as op:
            r = op.post("/v1/apikeys", json={"tenant": name, "role": "admin"})
            assert r.status_code == 201, r.text
        self.api = server.client(r.json()["key"], timeout=300)

    def close(self) -> None:
        for sb in self.api.get("/v1/sandboxes").json().get("sandboxes", []):
            self.api.delete(f"/v1/sandboxes/{sb['id']}")
        self.api.close()


@pytest.fixture
def tenants(small_server: Server) -> Iterator[Any]:
    made: list[Tenant] = []

    def make(prefix: str) -> Tenant:
        t = Tenant(small_server, f"{prefix}-{secrets.token_hex(3)}")
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def sandbox(c: httpx.Client, **body: Any) -> str:
    body.setdefault("template", "base")
    r = c.post("/v1/sandboxes", json=body)
    assert r.status_code in (201, 202), r.text
    if r.status_code == 202:
        op = wait_operation(c, r.json()["operation"]["id"], timeout=300)
        assert op["status"] == "succeeded", op
    return str(r.json()["sandbox"]["id"])


def start(c: httpx.Client, sid: str, script: str, **body: Any) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/commands", json={"shell": script, **body})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def finish(c: httpx.Client, sid: str, cid: str) -> tuple[int | None, str, str, dict[str, Any] | None]:
    """A command's (exit code or None, stdout, stderr, the error event's data if it ended in one)."""
    events = read_events(c, sid, cid)
    out = b"".join(base64.b64decode(e["data"]["data"]) for e in events if e["event"] == "stdout")
    err = b"".join(base64.b64decode(e["data"]["data"]) for e in events if e["event"] == "stderr")
    last = events[-1] if events else {"event": "none", "data": None}
    code = int(last["data"]["exit_code"]) if last["event"] == "exit" else None
    return code, out.decode(errors="replace"), err.decode(errors="replace"), (
        last["data"] if last["event"] == "error" else None)


def sh(c: httpx.Client, sid: str, script: str, **body: Any) -> tuple[int | None, str, str, dict[str, Any] | None]:
    return finish(c, sid, start(c, sid, script, **body))


def ok(c: httpx.Client, sid: str, script: str, **body: Any) -> str:
    code, out, err, error = sh(c, sid, script, **body)
    assert code == 0 and error is None, (code, out[-2000:], err[-2000:], error)
    return out


def op_of(c: httpx.Client, r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 202, r.text
    return wait_operation(c, r.json()["operation"]["id"], timeout=300)


def used(path: Path) -> int:
    import os

    st = os.statvfs(path)
    return (st.f_blocks - st.f_bavail) * st.f_frsize
