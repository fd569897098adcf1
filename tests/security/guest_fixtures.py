"""Fixtures of the guest-channel probes (test_guest_probes.py): two tenants on one server, the
victim tenant's sandbox answering exec in the background, and the node agent's memory.

The attacker is tenant A (a fresh sandbox per probe, deleted after it); the bystander is tenant B,
whose sandbox on the same node must keep answering exec, each within a generous deadline, while A
floods; the node agent's resident memory must stay within a bound over what it held before.
"""

from __future__ import annotations

import base64
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.node.main import channel_dir_for
from tests.e2e.harness import Server, create_sandbox, node_agent_pid, read_events, wait_for

MiB = 1 << 20
#: How much the node agent may grow over its baseline during a probe. A guest's queues hold at most
#: guest_client.BUDGET (128 MiB) but none of these floods has a reason to fill them: what grows is
#: the interpreter's arenas and the stalled readers' bounded queues.
MEMORY_BOUND = 96 * MiB
#: Each exec of the bystander must finish within this (HTTP timeout of its client): generous, on a
#: machine shared with other test runs; it is a liveness bound, not a speed measure.
EXEC_DEADLINE = 60.0


#: What the control plane answers when its pooled connection to the node was closed by the node's
#: keep-alive timer just as it sent a request (httpx's keepalive_expiry and uvicorn's keep-alive
#: timeout are both 5 s: a race of the control plane's node client, not of the guest channel). The
#: request never reached the node, so these probes send it again (and count how often).
KEEPALIVE_RACE = "Server disconnected without sending a response"


class Tenant:
    def __init__(self, server: Server, name: str) -> None:
        with server.client() as operator:
            r = operator.post("/v1/apikeys", json={"tenant": name, "role": "member"})
            assert r.status_code in (200, 201), r.text
        self.name = name
        self.api = server.client(r.json()["key"], timeout=EXEC_DEADLINE)
        self.races = 0

    def send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        for _ in range(3):
            r = self.api.request(method, path, **kw)
            if r.status_code != 503 or KEEPALIVE_RACE not in r.text:
                return r
            self.races += 1
        return r

    def sandbox(self, **body: Any) -> str:
        return create_sandbox(self.api, **body)

    def delete(self, sid: str) -> None:
        self.api.delete(f"/v1/sandboxes/{sid}")

    def start(self, sid: str, body: dict[str, Any]) -> str:
        r = self.send("POST", f"/v1/sandboxes/{sid}/commands", json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def command(self, sid: str, cid: str) -> dict[str, Any]:
        r = self.send("GET", f"/v1/sandboxes/{sid}/commands/{cid}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def commands(self, sid: str) -> list[dict[str, Any]]:
        r = self.send("GET", f"/v1/sandboxes/{sid}/commands")
        assert r.status_code == 200, r.text
        return list(r.json()["commands"])

    def events(self, sid: str, cid: str) -> list[dict[str, Any]]:
        for _ in range(2):
            try:
                return read_events(self.api, sid, cid)
            except AssertionError as exc:
                if KEEPALIVE_RACE not in str(exc):
                    raise
                self.races += 1
        return read_events(self.api, sid, cid)

    def run(self, sid: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """Start a command and read its stream to the end: (exit code, stdout)."""
        cid = self.start(sid, body)
        events = self.events(sid, cid)
        assert events[-1]["event"] == "exit", events[-3:]
        out = b"".join(base64.b64decode(e["data"]["data"]) for e in events if e["event"] == "stdout")
        return int(events[-1]["data"]["exit_code"]), out


@pytest.fixture(scope="module")
def tenants(server: Server) -> Iterator[tuple[Tenant, Tenant]]:
    tag = secrets.token_hex(3)
    a, b = Tenant(server, f"probe-attacker-{tag}"), Tenant(server, f"probe-bystander-{tag}")
    try:
        yield a, b
    finally:
        a.api.close()
        b.api.close()


@pytest.fixture(scope="module")
def bystander(tenants: tuple[Tenant, Tenant]) -> Iterator[str]:
    """Tenant B's sandbox (the one that must keep working)."""
    _, b = tenants
    sid = b.sandbox(cpu=0.5, memory_mb=256)
    try:
        yield sid
    finally:
        b.delete(sid)


@pytest.fixture
def attacker(tenants: tuple[Tenant, Tenant]) -> Iterator[str]:
    """A fresh sandbox of tenant A for one probe."""
    a, _ = tenants
    sid = a.sandbox(cpu=1, memory_mb=512)
    try:
        yield sid
    finally:
        a.delete(sid)


@pytest.fixture(scope="module")
def node_api(server: Server) -> Iterator[httpx.Client]:
    """The node agent's own API (its socket and token): what the data plane and E2B's watchers call."""
    token = (server.data_dir / "node.token").read_text().strip()
    transport = httpx.HTTPTransport(uds=str(channel_dir_for(server.data_dir) / "node.sock"))
    with httpx.Client(transport=transport, base_url="http://node", timeout=EXEC_DEADLINE,
                      headers={"authorization": f"Bearer {token}"}) as c:
        yield c


class NodeMemory:
    """The node agent's resident memory: its value when made, and the most seen since."""

    def __init__(self, server: Server) -> None:
        self.pid = node_agent_pid(server)
        self.base = self.rss()
        self.most = self.base

    def rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def rebase(self) -> None:
        self.base = self.most = self.rss()

    def sample(self) -> int:
        self.most = max(self.most, self.rss())
        return self.most

    @property
    def growth(self) -> int:
        return self.most - self.base

    def check(self) -> None:
        self.sample()
        assert self.growth < MEMORY_BOUND, (
            f"the node agent grew by {self.growth / MiB:.0f} MiB (from {self.base / MiB:.0f} MiB)")


class Bystander:
    """Tenant B running ``echo`` in its sandbox over and over in a thread (each within
    EXEC_DEADLINE), sampling the node agent's memory between execs."""

    def __init__(self, tenant: Tenant, sid: str, memory: NodeMemory) -> None:
        self.tenant, self.sid, self.memory = tenant, sid, memory
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bystander", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                code, out = self.tenant.run(self.sid, {"cmd": ["echo", f"alive {self.done}"]})
                if (code, out) != (0, f"alive {self.done}\n".encode()):
                    self.failures.append(f"exec {self.done}: {code} {out!r}")
            except (httpx.HTTPError, AssertionError) as exc:
                self.failures.append(f"exec {self.done}: {exc!r}")
            self.done += 1
            self.memory.sample()
            self._stop.wait(0.2)  # a pause between execs (a steady bystander), ended at once by stop

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(EXEC_DEADLINE * 2)

    def served(self, n: int, timeout: float = 600) -> None:
        """Until ``n`` more execs have finished (the flood goes on meanwhile)."""
        target = self.done + n
        wait_for(lambda: self.done >= target or self.failures, timeout, f"{n} execs of the bystander")
        assert not self.failures, self.failures
