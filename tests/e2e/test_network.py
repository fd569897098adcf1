"""The security boundary end to end: real sandboxes in their own network namespaces, the real egress
gateway, and a lab network on this machine standing in for the internet, a private host and the
cloud metadata service (tests/e2e/netlab.py). Nothing here can send a packet off the machine: the
gateway resolves only the lab's names, and the lab's addresses are routed into its namespace.

- an allowed host is reachable (HTTP and HTTPS, without any proxy setting in the sandbox);
- a denied host, the metadata and private stand-ins fail fast with the gateway's message and are
  never reached; DNS for a denied name fails;
- the host's own ports and another sandbox are unreachable;
- a secret is injected into the allowed host's requests and is nowhere in the sandbox: not in env,
  /proc/*/environ, any file, nor the memory image of a full snapshot; an echoing upstream gets it
  redacted;
- a policy change applies to the running sandbox's next connection; a fork keeps the policy;
- the audit log shows each decision.
"""

from __future__ import annotations

import secrets as pysecrets
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import Server, create_sandbox, own_server, run, wait_for, wait_operation
from tests.e2e.netlab import HOSTS, NetLab, netlab

pytestmark = pytest.mark.runtime

API, EVIL, DB, META = HOSTS["api.test"], HOSTS["evil.test"], HOSTS["db.internal"], HOSTS["metadata.test"]
ALLOW_API = {"allow": ["api.test", f"{API}/32"]}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetLab]:
    with netlab(tmp_path_factory.mktemp("netlab")) as lab:
        yield lab


@pytest.fixture(scope="module")
def srv(lab: NetLab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"SPACE_GATEWAY_HOSTS_FILE": str(lab.hosts_file), "SPACE_GATEWAY_UPSTREAM_CA": str(lab.upstream_ca)}
    # The lab is a private range: the operator opens it (the deployment's egress ceiling).
    with own_server(tmp_path_factory.mktemp("netsrv"), "--egress-private", "10.250.0.0/16", env=env) as s:
        yield s


@pytest.fixture(scope="module")
def api(srv: Server) -> Iterator[httpx.Client]:
    with srv.client(timeout=120) as c:
        yield c


def create(api: httpx.Client, **body: Any) -> str:
    return create_sandbox(api, **body)


def sh(api: httpx.Client, sid: str, script: str, timeout: float = 60) -> str:
    _code, out, _err = run(api, sid, {"cmd": ["sh", "-c", script], "timeout": timeout})
    return out.decode(errors="replace")


def curl(api: httpx.Client, sid: str, url: str, *extra: str) -> tuple[str, str]:
    """(HTTP status or 000, body) of one request from inside the sandbox."""
    args = " ".join(shlex.quote(a) for a in extra)
    out = sh(api, sid, f"curl -s -m 10 -w '\\n%{{http_code}}' {args} {shlex.quote(url)}")
    body, _, code = out.rpartition("\n")
    return code.strip(), body


#: Every readable mapping of every process in the sandbox, searched for a needle: a memory dump.
MEMSCAN = r"""
import os, re, sys
needle = bytes.fromhex(sys.argv[1])  # given in hex: only this scanner holds the bytes, and it skips itself
found = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) == os.getpid():
        continue
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb", 0)
    except OSError:
        continue
    for line in maps:
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) r", line)
        if not m:
            continue
        lo, hi = int(m.group(1), 16), int(m.group(2), 16)
        try:
            mem.seek(lo)
            if needle in mem.read(hi - lo):
                found.append(f"{pid}:{line}")
        except (OSError, ValueError, OverflowError):
            pass
print("scanned", len(found), *found)
"""


@pytest.fixture
def sandbox(api: httpx.Client) -> Iterator[str]:
    sid = create(api, egress=ALLOW_API)
    yield sid
    api.delete(f"/v1/sandboxes/{sid}")


def test_allowed_host_reachable_denied_ones_fail_fast_and_are_never_reached(
        api: httpx.Client, lab: NetLab, sandbox: str) -> None:
    code, body = curl(api, sandbox, "http://api.test/hello")
    assert code == "200" and '"path": "/hello"' in body
    # TLS passes through untouched: the sandbox verifies the upstream's own certificate (issued by
    # the lab's CA, not the gateway's).
    r = api.put(f"/v1/sandboxes/{sandbox}/files", params={"path": "/tmp/lab-ca.pem"},
                content=lab.upstream_ca.read_bytes())
    assert r.status_code in (200, 201), r.text
    code, _ = curl(api, sandbox, "https://api.test/secure", "--cacert", "/tmp/lab-ca.pem")
    assert code == "200"
    assert [h["path"] for h in lab.hits(API)] == ["/hello", "/secure"]

    # Names and addresses it may not reach: the gateway answers 403 with its reason, at once.
    for url in (f"http://{EVIL}/", f"http://{META}/latest/meta-data/", f"http://{DB}/"):
        code, body = curl(api, sandbox, url)
        assert code == "403" and "SPACE egress policy denied" in body, (url, code, body)
    # A name of the metadata host does not even resolve; dialled by address under that name, the
    # gateway decides on the name: not on the allow list, denied before any lookup...
    assert curl(api, sandbox, "http://metadata.test/")[0] == "000"
    code, body = curl(api, sandbox, "http://metadata.test/", "--resolve", f"metadata.test:80:{API}")
    assert code == "403" and "not on the allow list" in body, body
    # ...and where a policy allows the name, the gateway's own resolution decides (and denies).
    r = api.put(f"/v1/sandboxes/{sandbox}/policy", json={"allow": [*ALLOW_API["allow"], "metadata.test"]})
    assert r.status_code == 200, r.text
    code, body = curl(api, sandbox, "http://metadata.test/", "--resolve", f"metadata.test:80:{API}")
    assert code == "403" and "blocked range" in body, body
    assert api.put(f"/v1/sandboxes/{sandbox}/policy", json=ALLOW_API).status_code == 200
    # TLS to a denied address: the connection is refused, no handshake with anything.
    code, _ = curl(api, sandbox, f"https://{META}/")
    assert code == "000"
    # DNS for a name outside the policy does not resolve (and the allowed one does).
    res = sh(api, sandbox, "getent hosts api.test; getent hosts evil.test; echo rc=$?")
    assert f"{API}" in res and "rc=2" in res, res
    for addr in (EVIL, META, DB):
        assert lab.hits(addr) == [], f"{addr} was reached"


def test_host_ports_and_other_sandboxes_are_unreachable(api: httpx.Client, srv: Server, sandbox: str) -> None:
    other = create(api, egress={"default": "allow"})
    try:
        sh(api, other, "nohup python3 -m http.server 8000 >/tmp/srv.log 2>&1 & sleep 1")
        other_ip = sh(api, other, "hostname -I").split()[0]
        gateway_ip = sh(api, sandbox, "awk '/nameserver/{print $2}' /etc/resolv.conf").strip()
        # The server answers inside its own sandbox...
        assert curl(api, other, "http://127.0.0.1:8000/")[0] == "200"
        # ...but not from the other sandbox, even with a policy that allows everything public.
        for url in (f"http://{other_ip}:8000/", f"http://{gateway_ip}:{srv.port}/healthz",
                    f"http://{gateway_ip}:22/", f"http://10.250.0.1:{srv.port}/healthz"):
            code, body = curl(api, sandbox, url)
            assert code != "200", (url, body)
        log = sh(api, other, "cat /tmp/srv.log")
        assert log.count("GET /") == 1, log  # only its own request
    finally:
        api.delete(f"/v1/sandboxes/{other}")


def test_policy_change_applies_to_the_running_sandbox(api: httpx.Client, sandbox: str) -> None:
    code, body = curl(api, sandbox, "http://api.test/", "-i")
    assert code == "200", body
    r = api.put(f"/v1/sandboxes/{sandbox}/policy", json={"deny": ["api.test"]})
    assert r.status_code == 200, r.text
    assert r.json()["effective"] == {"deny": ["api.test"]}
    assert curl(api, sandbox, "http://api.test/")[0] == "000"  # the name no longer resolves
    code, body = curl(api, sandbox, "http://api.test/", "--resolve", f"api.test:80:{API}")
    assert code == "403" and "deny rule" in body, body
    r = api.put(f"/v1/sandboxes/{sandbox}/policy", json=ALLOW_API)
    assert r.status_code == 200
    assert curl(api, sandbox, "http://api.test/")[0] == "200"
    # A bad rule is refused with a clear error; the policy stays as it was.
    r = api.put(f"/v1/sandboxes/{sandbox}/policy", json={"allow": ["exa mple.com"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert api.get(f"/v1/sandboxes/{sandbox}/policy").json()["policy"] == ALLOW_API


def test_secret_is_injected_and_never_inside_the_sandbox(api: httpx.Client, lab: NetLab, srv: Server) -> None:
    value = "sk-test-" + pysecrets.token_hex(16)
    r = api.put("/v1/secrets/API_TOKEN", json={"value": value, "hosts": ["api.test"]})
    assert r.status_code in (200, 201), r.text
    sid = create(api, egress=ALLOW_API, secrets=["API_TOKEN"])
    try:
        code, body = curl(api, sid, "https://api.test/with-secret", "-H", "Authorization: Bearer forged")
        assert code == "200"
        seen = [h for h in lab.hits(API) if h["path"] == "/with-secret"]
        assert seen and seen[-1]["headers"]["authorization"] == f"Bearer {value}"  # replaced, not forged
        assert value not in body  # the upstream echoed it: redacted on the way back
        # Rotated: the running sandbox's next request carries the new value.
        rotated = value + "-2"
        assert api.put("/v1/secrets/API_TOKEN", json={"value": rotated, "hosts": ["api.test"]}).status_code == 200
        assert curl(api, sid, "https://api.test/rotated")[0] == "200"
        assert [h for h in lab.hits(API) if h["path"] == "/rotated"][-1]["headers"]["authorization"] == \
            f"Bearer {rotated}"
        # Not for another host, and not over plain HTTP (the value would cross in clear).
        curl(api, sid, "http://api.test/plain")
        plain = [h for h in lab.hits(API) if h["path"] == "/plain"]
        assert plain and "authorization" not in plain[-1]["headers"]

        # Nowhere inside: env, every process's environ, every file.
        res = sh(api, sid, f"env | grep -c {value}; cat /proc/*/environ 2>/dev/null | grep -ac {value}; "
                           f"grep -rlaF {value} / --exclude-dir=proc --exclude-dir=sys 2>/dev/null | head; "
                           "echo end", timeout=300)
        assert res.split() == ["0", "0", "end"], res
        # Nor in any process's memory (the sandbox's own view of it, /proc/<pid>/mem).
        res = sh(api, sid, f"python3 -c {shlex.quote(MEMSCAN)} {value.encode().hex()}", timeout=300)
        assert res.split() == ["scanned", "0"], res
        # Nor in the memory image of a full snapshot (the sentry's, network buffers included):
        # taking it also proves a sandbox that used the network can be checkpointed.
        r = api.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"})
        assert r.status_code == 202, r.text
        op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
        assert op["status"] == "succeeded", op
        images = [p for p in (srv.data_dir / "pool" / "sandboxes" / sid / "snapshots" / op["result"]["snapshot"]
                              / "checkpoint").rglob("*") if p.is_file()]
        assert images
        for img in images:
            assert value.encode() not in img.read_bytes(), f"{img} holds the secret"

        # Listing never shows it.
        assert value not in api.get("/v1/secrets").text
        # The audit log has the resolution and the injection (names only, never the value).
        def injected() -> bool:
            recs = api.get("/v1/audit", params={"action": "secret."}).json()
            items = recs.get("records", recs.get("audit", []))
            return any(a["action"] == "secret.inject" and a["details"].get("sandbox") == sid for a in items)
        wait_for(injected, 30, "the secret.inject audit record")
        assert value not in api.get("/v1/audit", params={"limit": 1000}).text
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
        api.delete("/v1/secrets/API_TOKEN")


def test_fork_keeps_policy_and_audit_shows_decisions(api: httpx.Client, sandbox: str) -> None:
    assert curl(api, sandbox, "http://api.test/before-fork")[0] == "200"
    r = api.post(f"/v1/sandboxes/{sandbox}/fork", json={"count": 1})
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "succeeded", op
    fid = op["result"]["sandbox_ids"][0]
    try:
        assert api.get(f"/v1/sandboxes/{fid}/policy").json()["policy"] == ALLOW_API
        assert curl(api, fid, "http://api.test/from-fork")[0] == "200"
        assert curl(api, fid, f"http://{META}/")[0] == "403"

        def decisions() -> list[dict[str, Any]]:
            recs = api.get("/v1/audit", params={"action": "egress.", "limit": 1000}).json()
            return list(recs.get("records", recs.get("audit", [])))
        wait_for(lambda: any(d["action"] == "egress.deny" and d["details"].get("sandbox") == fid
                             for d in decisions()), 30, "the fork's deny decision in the audit log")
        mine = [d for d in decisions() if d["details"].get("sandbox") == fid]
        assert any(d["action"] == "egress.allow" and d["target"].startswith("api.test") for d in mine), mine
        deny = next(d for d in mine if d["action"] == "egress.deny")
        assert META in deny["target"] and deny["result"] == "denied" and deny["actor"].startswith("gateway:")
    finally:
        api.delete(f"/v1/sandboxes/{fid}")


def test_teardown_leaves_no_network_state(tmp_path: Path) -> None:
    """A node's namespaces, nftables table and gateway go with ``space node teardown``."""
    import subprocess

    from space.node.network.namespaces import node_tag

    with own_server(tmp_path) as s:
        with s.client() as c:
            sid = create(c)
            assert sid
        tag = node_tag(s.data_dir)
    assert f"space-{tag}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["nft", "list", "table", "inet", f"space_{tag}"], capture_output=True).returncode != 0
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(s.data_dir) not in ps and f"/{tag}" not in ps


def act(api: httpx.Client, sid: str, action: str) -> None:
    r = api.post(f"/v1/sandboxes/{sid}/{action}")
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "succeeded", op


def test_policy_follows_pause_and_suspend_restore(api: httpx.Client, lab: NetLab) -> None:
    """The policy lives with the sandbox, not with its runtime instance or its node."""
    sid = create(api, egress=ALLOW_API)
    try:
        # A connection open across the suspend: the gateway resets it first (a checkpoint cannot
        # hold an established TCP connection), and the sandbox's process sees that, not a hang.
        holder = ("import socket\n"
                  "s = socket.create_connection(('api.test', 80))\n"
                  "open('/root/connected', 'w').close()\n"
                  "try:\n    s.recv(1); outcome = 'eof'\n"
                  "except OSError as e:\n    outcome = type(e).__name__\n"
                  "open('/root/outcome', 'w').write(outcome)\n")
        code, _, err = run(api, sid, {"cmd": ["sh", "-c", f"nohup python3 -c {shlex.quote(holder)} "
                                              ">/root/holder.log 2>&1 &"], "user": "root"})
        assert code == 0, err
        wait_for(lambda: run(api, sid, {"cmd": ["test", "-f", "/root/connected"], "user": "root"})[0] == 0, 30,
                 "the sandbox to hold a connection")
        act(api, sid, "pause")
        act(api, sid, "resume")
        assert curl(api, sid, "http://api.test/after-resume")[0] == "200"
        act(api, sid, "suspend")
        act(api, sid, "restore")
        outcome = run(api, sid, {"cmd": ["cat", "/root/outcome"], "user": "root"})[1]
        assert outcome == b"ConnectionResetError", outcome
        assert curl(api, sid, "http://api.test/after-restore")[0] == "200"
        assert curl(api, sid, f"http://{META}/")[0] == "403"
        assert curl(api, sid, f"http://{EVIL}/")[0] == "403"
        assert {"/after-resume", "/after-restore"} <= {h["path"] for h in lab.hits(API)}
        assert lab.hits(META) == [] and lab.hits(EVIL) == []
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_a_dead_gateway_is_restarted_with_what_it_knew(api: httpx.Client, srv: Server, sandbox: str) -> None:
    import os
    import signal

    pidfile = srv.data_dir / "gateway" / "gateway.pid"
    old = int(pidfile.read_text())
    assert curl(api, sandbox, "http://api.test/before-crash")[0] == "200"
    os.kill(old, signal.SIGKILL)

    def back() -> bool:
        try:
            pid = int(pidfile.read_text())
        except (FileNotFoundError, ValueError):
            return False
        return pid != old and curl(api, sandbox, "http://api.test/after-crash")[0] == "200"
    wait_for(back, 60, "the node to restart its gateway and give it the sandbox's policy back")
    # The policy came back with it, not an open door.
    assert curl(api, sandbox, f"http://{META}/")[0] == "403"


def test_cli_contract(api: httpx.Client, srv: Server, lab: NetLab) -> None:
    """`space secret set`, `space sandbox create --secret --allow --deny`, `space policy get|set`."""
    import json
    import os
    import subprocess

    from tests.e2e.harness import SPACE

    def cli(*args: str, stdin: bytes | None = None) -> str:
        env = {**os.environ, "SPACE_URL": srv.url, "SPACE_API_KEY": srv.admin_key}
        p = subprocess.run([SPACE, *args], env=env, capture_output=True, input=stdin, timeout=300)
        assert p.returncode == 0, (args, p.stderr.decode())
        return p.stdout.decode()

    value = "cli-" + pysecrets.token_hex(12)
    cli("secret", "set", "CLI_TOKEN", "-", "--host", "api.test", "--header", "X-Api-Key", "--format", "{}",
        stdin=value.encode())
    assert value not in cli("secret", "list") and value not in cli("secret", "list", "--json")
    sid = cli("sandbox", "create", "--secret", "CLI_TOKEN", "--allow", "api.test", "--allow", f"{API}/32",
              "--deny", "evil.test").strip()
    try:
        view = json.loads(cli("policy", "get", sid, "--json"))
        assert view["policy"] == {"allow": ["api.test", f"{API}/32"], "deny": ["evil.test"]}
        assert view["secrets"] == ["CLI_TOKEN"]
        assert curl(api, sid, "https://api.test/cli")[0] == "200"
        assert [h for h in lab.hits(API) if h["path"] == "/cli"][-1]["headers"]["x-api-key"] == value
        view = json.loads(cli("policy", "set", sid, "--deny", "api.test", "--json"))
        assert view["effective"] == {"deny": ["api.test"]}
        assert curl(api, sid, "https://api.test/cli-denied", "--resolve", f"api.test:443:{API}")[0] == "000"
        assert "sandbox" in cli("policy", "get", sid)
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
        cli("secret", "delete", "CLI_TOKEN")


def test_tenant_default_policy_applies_to_sandboxes_without_their_own(api: httpx.Client, lab: NetLab) -> None:
    r = api.put("/v1/tenants/default/egress", json={"allow": ["api.test", f"{API}/32"]})
    assert r.status_code == 200, r.text
    try:
        sid = create(api)
        try:
            view = api.get(f"/v1/sandboxes/{sid}/policy").json()
            assert view["inherited"] and view["effective"] == {"allow": ["api.test", f"{API}/32"]}
            assert curl(api, sid, "http://api.test/tenant-default")[0] == "200"
            assert curl(api, sid, f"http://{EVIL}/")[0] == "403"  # not on the tenant's allow list
            assert lab.hits(EVIL) == []
        finally:
            api.delete(f"/v1/sandboxes/{sid}")
        assert api.put("/v1/tenants/default/egress", json={"allow": ["*.test"], "deny": ["exa mple"]}).status_code \
            == 400
    finally:
        assert api.put("/v1/tenants/default/egress", json={}).status_code == 200


def test_the_pool_never_honours_sandbox_setuid_binaries(api: httpx.Client, srv: Server, sandbox: str) -> None:
    """A sandbox can write a setuid-root binary into its root: the host mounts the pool nosuid, so
    no host process can use it to become root."""
    import subprocess

    pool = srv.data_dir / "pool"
    opts = subprocess.run(["findmnt", "-no", "OPTIONS", str(pool)], capture_output=True, text=True).stdout
    assert "nosuid" in opts.split(","), opts
    code, _, err = run(api, sandbox, {"cmd": ["sh", "-c", "cp /bin/id /root/suid-id && chmod 4755 /root/suid-id"],
                                      "user": "root"})
    assert code == 0, err
    suid = next((srv.data_dir / "pool" / "sandboxes" / sandbox / "rootfs" / "root").glob("suid-id"))
    assert suid.stat().st_mode & 0o4000  # on the host the file is setuid-root, but its mount is nosuid


def test_the_operators_ceiling_bounds_private_ranges_at_once(api: httpx.Client, lab: NetLab) -> None:
    """The deployment opens the lab (10.250.0.0/16); the operator narrows the tenant's ceiling: a
    running sandbox's CIDR beyond it stops working at once, its view says so, and new entries beyond
    it are refused naming the ceiling. Back to the deployment's: it works again."""
    ceiling = "/v1/tenants/default/egress-ceiling"
    sid = create(api, egress=ALLOW_API)
    try:
        assert curl(api, sid, "http://api.test/before-narrowing")[0] == "200"
        r = api.put(ceiling, json={"private": ["10.250.9.0/24"]})
        assert r.status_code == 200, r.text
        assert r.json() == {"tenant": "default", "private": ["10.250.9.0/24"], "effective": ["10.250.9.0/24"],
                            "deployment": ["10.250.0.0/16"]}
        assert curl(api, sid, "http://api.test/after-narrowing")[0] == "000"  # DNS answers no address
        code, body = curl(api, sid, "http://api.test/after-narrowing", "--resolve", f"api.test:80:{API}")
        assert code == "403" and "outside the operator's ceiling" in body, body
        view = api.get(f"/v1/sandboxes/{sid}/policy").json()
        assert view["policy"] == ALLOW_API and view["limits"]["private_ceiling"] == ["10.250.9.0/24"]
        assert any(f"{API}/32" in n for n in view["limits"]["clipped"]), view
        r = api.put(f"/v1/sandboxes/{sid}/policy", json={"allow": ["api.test", "10.250.1.0/24"]})
        assert r.status_code == 400 and r.json()["error"]["ceiling"] == ["10.250.9.0/24"], r.text
        assert api.put(ceiling, json={"private": None}).status_code == 200
        assert curl(api, sid, "http://api.test/after-widening")[0] == "200"
        assert "/after-narrowing" not in {h["path"] for h in lab.hits(API)}
    finally:
        api.put(ceiling, json={"private": None})
        api.delete(f"/v1/sandboxes/{sid}")
