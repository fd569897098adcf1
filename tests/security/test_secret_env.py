"""Finding 8: secrets leak sideways through the environment.

``space serve`` is started with the deployment's master key, object-store credentials and a canary
variable in its environment. Every process of that server is then read from
``/proc/<pid>/environ``: the API, the node supervisor, the node agent, the root helper, the egress
gateway, the shims and runsc's sentries and gofers. None may hold a secret value (the gateway parses
hostile traffic; runsc runs the sandbox), and each may hold only the names
:mod:`space.childenv` allows its role.
"""

from __future__ import annotations

import base64
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from space import childenv
from space.node.main import channel_dir_for
from tests.e2e.harness import Server, create_sandbox, own_server, run, wait_for

pytestmark = pytest.mark.runtime

#: A variable no allowlist names: if it shows up anywhere, something copied its parent's environment.
CANARY = "SPACE_TEST_CANARY_ENV"

SECRETS = {
    "SPACE_MASTER_KEY": base64.b64encode(secrets.token_bytes(32)).decode(),
    "AWS_ACCESS_KEY_ID": "AKIACANARY" + secrets.token_hex(6).upper(),
    "AWS_SECRET_ACCESS_KEY": "aws-secret-canary-" + secrets.token_hex(16),
    CANARY: "canary-" + secrets.token_hex(16),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with own_server(tmp_path_factory.mktemp("secret-env"), env=dict(SECRETS)) as srv:
        yield srv


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    out = {}
    for item in raw.split(b"\0"):
        if item:
            name, _, value = item.decode(errors="replace").partition("=")
            out[name] = value
    return out


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _parents() -> dict[int, int]:
    out = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            out[int(p.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _role(pid: int, api_pid: int) -> str:
    if pid == api_pid:
        return "api"
    cmd = _cmdline(pid)
    argv0 = Path(cmd.split(b"\0", 1)[0].decode(errors="replace")).name
    for needle, role in ((b"space.nodesup", "nodesup"), (b"space.cli.main\0node\0run", "node"),
                         (b"space.node.helper", "helper"), (b"space.gateway", "gateway"),
                         (b"space.runtime.shim", "shim")):
        if needle in cmd:
            return role
    if argv0.startswith("runsc"):
        return "runsc"
    return f"unknown: {cmd[:200]!r}"


def _processes(srv: Server) -> dict[int, str]:
    """pid -> role of every process of ``srv``: its descendants, and the ones that left the tree
    (runsc's sentries and gofers, reparented when ``runsc run --detach`` exits) found by the paths
    only this server's processes name."""
    assert srv.proc is not None
    parents = _parents()
    mine = {srv.proc.pid}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                grew = True
    marks = (str(srv.data_dir).encode(), str(channel_dir_for(srv.data_dir)).encode())
    for pid in parents:
        try:
            cmd = _cmdline(pid)
        except OSError:
            continue
        if any(m in cmd for m in marks):
            mine.add(pid)
    out = {}
    for pid in mine:
        try:
            out[pid] = _role(pid, srv.proc.pid)
        except OSError:  # exited meanwhile (a short-lived tool)
            continue
    return out


def test_no_process_of_the_server_holds_a_secret_or_a_name_its_role_does_not_allow(server: Server) -> None:
    with server.client() as c:
        # The master key reached the API (a secret can be sealed) although no child holds it ...
        r = c.put("/v1/secrets/probe", json={"value": "tok-" + secrets.token_hex(8), "hosts": ["api.example.com"]})
        assert r.status_code in (200, 201), r.text
        assert not (server.data_dir / "master.key").exists(), "the server made its own key: the env's was lost"
        # ... and a sandbox runs, so that its shim and runsc's sentry and gofer exist.
        sid = create_sandbox(c)
        code, out, _ = run(c, sid, {"cmd": ["sh", "-c", f"echo ${{{CANARY}:-absent}}"]})
        assert (code, out) == (0, b"absent\n")

    def all_there() -> dict[int, str] | None:
        found = _processes(server)
        return found if {"gateway", "runsc", "shim"} <= set(found.values()) else None

    procs = wait_for(all_there, 60, "the server's gateway, shim and runsc processes") or {}
    roles = sorted(set(procs.values()))
    assert {"api", "nodesup", "node", "helper", "gateway", "shim", "runsc"} <= set(roles), roles
    assert not [r for r in roles if r.startswith("unknown")], roles

    leaks: list[str] = []
    extra: list[str] = []
    for pid, role in sorted(procs.items()):
        try:
            env = _environ(pid)
        except OSError:
            continue
        for name, value in env.items():
            for secret_name, secret in SECRETS.items():
                if secret in value:
                    leaks.append(f"{role} (pid {pid}) holds {secret_name} as {name}")
        allowed = childenv.names(role)
        extra += [f"{role} (pid {pid}): {n}" for n in sorted(set(env) - allowed)]
    assert not leaks, "secrets in environments:\n" + "\n".join(leaks)
    assert not extra, "names no allowlist gives the process:\n" + "\n".join(extra)


@pytest.mark.probe("read the deployment's master key, AWS_* and a canary from the sandbox's own /proc/1/environ "
                   "and env")
def test_a_sandbox_cannot_read_the_secrets_from_its_own_environment(server: Server) -> None:
    """The guest's PID 1 and every command get only what the sandbox was given."""
    with server.client() as c:
        sid = create_sandbox(c)
        code, out, _ = run(c, sid, {"cmd": ["sh", "-c", "cat /proc/1/environ; echo; env"]})
    assert code == 0
    for name, value in SECRETS.items():
        assert value.encode() not in out, name


def test_health_is_served_after_the_scrub(server: Server) -> None:
    # The API replaced its own environment after reading what it needs: it still serves.
    assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
    assert os.environ.get(CANARY) is None  # the test process itself was never given the canary
