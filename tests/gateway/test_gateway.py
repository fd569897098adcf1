"""The egress gateway end to end, on loopback: policy, DNS, credential injection, resets, journal."""

from __future__ import annotations

import datetime as dt
import gzip
import http.client
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.harness import (
    SB1,
    SB2,
    STRANGER,
    Gateway,
    Upstream,
    UpstreamPKI,
    dns_query,
    running_gateway,
    tcp_state,
)
from tests.waiting import wait_for

LOOPBACK_OK = {"allow": ["127.0.0.0/8", "api.test", "other.test"]}
TOKEN = "Bearer sk-test-0123456789abcdef"


def secret(**over: Any) -> dict[str, Any]:
    return {"name": "github", "secret_id": "sec-1", "hosts": ["api.test"], "header": "Authorization",
            "value": TOKEN, "expires_at": None, "rate_limit": None, **over}


def actions(gw: Gateway, after: int) -> list[dict[str, Any]]:
    return gw.audit(after)


def last_seq(gw: Gateway) -> int:
    return int(gw.ctl({"op": "stats"})["audit_last"])


# ---- policy ----------------------------------------------------------------------------------------


def test_allowed_host_over_http_and_connect(gw: Gateway, upstream: Upstream, upstream_tls: Upstream) -> None:
    gw.put(SB1, LOOPBACK_OK)
    start = last_seq(gw)
    r = gw.http(SB1, f"http://api.test:{upstream.port}/echo")
    assert r.status == 200
    assert json.loads(r.read_body)["headers"]["host"] == f"api.test:{upstream.port}"  # type: ignore[attr-defined]
    status, body, _, issuer = gw.https(SB1, "api.test", upstream_tls.port)
    assert status == 200 and json.loads(body)["tls"] is True
    assert issuer == "upstream test CA"  # no secret for it: passed through, not intercepted
    recs = actions(gw, start)
    assert [(r["action"], r["details"]["via"]) for r in recs] == [("egress.allow", "http"), ("egress.allow", "connect")]
    assert recs[0]["sandbox"] == "sb-2" and recs[0]["tenant"] == "t1"
    assert recs[1]["target"] == f"api.test:{upstream_tls.port}"


def test_denied_host_gets_403_with_reason_and_is_audited(gw: Gateway, upstream: Upstream) -> None:
    gw.put(SB1, {"allow": ["api.test"]})
    start, hits = last_seq(gw), len(upstream.hits)
    r = gw.http(SB1, f"http://evil.test:{upstream.port}/echo")
    assert r.status == 403
    assert r.getheader("X-Space-Egress") == "denied"
    assert r.read_body.decode().startswith(  # type: ignore[attr-defined]
        f"SPACE egress policy denied evil.test:{upstream.port}: evil.test is not on the allow list")
    s, status, _ = gw.connect(SB1, "evil.test", 443)
    s.close()
    assert status == 403
    assert len(upstream.hits) == hits  # never contacted
    recs = actions(gw, start)
    assert [(r["action"], r["target"], r["details"]["rule"]) for r in recs] == [
        ("egress.deny", f"evil.test:{upstream.port}", "default"), ("egress.deny", "evil.test:443", "default")]
    assert "not on the allow list" in recs[0]["details"]["reason"]


def test_name_resolving_into_a_blocked_range_is_denied_even_if_allowed(gw: Gateway, upstream: Upstream) -> None:
    gw.put(SB1, {"allow": ["*.test"]})  # every name, but no CIDR: private/loopback/metadata stay shut
    for host in ("metadata.test", "private.test", "api.test"):
        r = gw.http(SB1, f"http://{host}:{upstream.port}/echo")
        assert r.status == 403, host
        assert "blocked range" in r.read_body.decode()  # type: ignore[attr-defined]
    s, status, _ = gw.connect(SB1, "metadata.test", 80)
    s.close()
    assert status == 403
    # An IP literal is no way around it either.
    r = gw.http(SB1, "http://169.254.169.254/latest/meta-data/")
    assert r.status == 403


def test_policy_change_applies_to_the_next_request(gw: Gateway, upstream: Upstream, upstream_tls: Upstream) -> None:
    gw.put(SB1, LOOPBACK_OK)
    conn = http.client.HTTPConnection("127.0.0.1", gw.proxy_port, timeout=10, source_address=(SB1, 0))
    try:
        conn.request("GET", f"http://api.test:{upstream.port}/echo")
        assert conn.getresponse().read()
        tunnel, status, _ = gw.connect(SB1, "api.test", upstream_tls.port)
        assert status == 200
        gw.put(SB1, {"allow": ["other.test"]})
        conn.request("GET", f"http://api.test:{upstream.port}/echo")  # same keep-alive connection
        resp = conn.getresponse()
        assert resp.status == 403 and b"not on the allow list" in resp.read()
        # The open tunnel to a now-denied host was reset.
        with pytest.raises((ConnectionResetError, ConnectionAbortedError)):
            tunnel.settimeout(5)
            if tunnel.recv(1) == b"":
                raise AssertionError("closed with a FIN, not reset")
        tunnel.close()
    finally:
        conn.close()


def test_each_source_address_has_its_own_policy(gw: Gateway, upstream: Upstream) -> None:
    gw.put(SB1, LOOPBACK_OK)
    gw.put(SB2, {"allow": ["other.test"]})
    assert gw.http(SB1, f"http://api.test:{upstream.port}/echo").status == 200
    assert gw.http(SB2, f"http://api.test:{upstream.port}/echo").status == 403
    recs = gw.ctl({"op": "list"})["sandboxes"]
    assert {r["ip"]: r["sandbox"] for r in recs} == {SB1: "sb-2", SB2: "sb-3"}


def test_unknown_source_is_refused(gw: Gateway, upstream: Upstream) -> None:
    hits = len(upstream.hits)
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError)):
        gw.http(STRANGER, f"http://api.test:{upstream.port}/echo")
    assert len(upstream.hits) == hits


def test_control_socket_is_private_and_validates(gw: Gateway) -> None:
    st = Path(gw.control).stat()  # the owner and its group (the node agent's) only
    assert st.st_mode & 0o777 == 0o660 and st.st_gid == os.getegid()
    bad = gw.ctl({"op": "put", "ip": SB1, "sandbox": "sb", "policy": {"allow": ["not a host!"]}})
    assert bad["ok"] is False and bad["error"]["code"] == "invalid_request"
    assert gw.ctl({"op": "nope"})["error"]["code"] == "invalid_request"
    assert gw.ctl({"op": "reset", "ip": "127.0.0.77"})["error"]["code"] == "not_found"


# ---- credentials -----------------------------------------------------------------------------------


def test_secret_injected_over_intercepted_https_and_redacted(gw: Gateway, upstream_tls: Upstream) -> None:
    gw.put(SB1, LOOPBACK_OK, [secret()])
    start = last_seq(gw)
    status, body, _, issuer = gw.https(SB1, "api.test", upstream_tls.port, headers={"Authorization": "mine"})
    assert status == 200 and issuer == "SPACE egress CA"  # the client trusted the SPACE CA
    assert upstream_tls.hits[-1]["headers"]["authorization"] == TOKEN  # replaced, not added
    # An echoing upstream cannot hand it back: not in the body, not in a header, not the bare token.
    status, body, headers, _ = gw.https(SB1, "api.test", upstream_tls.port, "/echo-header?name=authorization")
    assert status == 200
    assert TOKEN.encode() not in body and TOKEN.split()[1].encode() not in body
    assert b"plain:" + b"*" * len(TOKEN) in body
    assert headers["x-echo"] == "[REDACTED]"
    # An upstream compressing the echo anyway: decoded, redacted, re-encoded.
    status, body, headers, _ = gw.https(SB1, "api.test", upstream_tls.port, "/echo-header?name=authorization&gzip=1")
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert gzip.decompress(body).startswith(b"plain:" + b"*" * len(TOKEN) + b"\n")
    recs = actions(gw, start)
    injects = [r for r in recs if r["action"] == "secret.inject"]
    assert len(injects) == 3
    assert injects[0]["details"] == {"name": "github", "secret_id": "sec-1", "header": "Authorization"}
    assert TOKEN.split()[1] not in json.dumps(gw.audit())


def test_secret_not_injected_for_other_hosts(gw: Gateway, upstream_tls: Upstream) -> None:
    gw.put(SB1, LOOPBACK_OK, [secret()])
    status, _, _, issuer = gw.https(SB1, "other.test", upstream_tls.port)
    assert status == 200 and issuer == "upstream test CA"
    assert "authorization" not in upstream_tls.hits[-1]["headers"]
    # Inside a tunnel to api.test, a request naming another host is refused rather than sent on
    # (with the credential) somewhere else.
    raw, st, _ = gw.connect(SB1, "api.test", upstream_tls.port)
    assert st == 200
    tls = gw.client_context().wrap_socket(raw, server_hostname="api.test")
    tls.sendall(b"GET /echo HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n")
    answer = b""
    while chunk := tls.recv(65536):
        answer += chunk
    tls.close()
    assert answer.startswith(b"HTTP/1.1 421")


def test_list_never_shows_secret_values(gw: Gateway) -> None:
    gw.put(SB1, LOOPBACK_OK, [secret(rate_limit=5)])
    listed = gw.ctl({"op": "list"})
    text = json.dumps(listed)
    assert "sk-test" not in text and "value" not in text
    (entry,) = [e for e in listed["sandboxes"] if e["ip"] == SB1]
    assert entry["secrets"] == [{"name": "github", "secret_id": "sec-1", "hosts": ["api.test"],
                                 "header": "Authorization", "expires_at": None, "rate_limit": 5}]


def test_expired_secret_gets_403(gw: Gateway, upstream_tls: Upstream) -> None:
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)).isoformat()
    gw.put(SB1, LOOPBACK_OK, [secret(expires_at=past)])
    start, hits = last_seq(gw), len(upstream_tls.hits)
    status, body, _, _ = gw.https(SB1, "api.test", upstream_tls.port)
    assert status == 403 and b"expired" in body
    assert len(upstream_tls.hits) == hits
    assert [r["action"] for r in actions(gw, start)] == ["egress.allow", "secret.expired"]


def test_rate_limited_secret_gets_429(gw: Gateway, upstream_tls: Upstream) -> None:
    gw.put(SB1, LOOPBACK_OK, [secret(rate_limit=2)])
    start = last_seq(gw)
    conn = http.client.HTTPSConnection("127.0.0.1", gw.proxy_port, timeout=10, source_address=(SB1, 0),
                                       context=gw.client_context())
    conn.set_tunnel("api.test", upstream_tls.port)
    try:
        codes = []
        for _ in range(3):
            conn.request("GET", "/echo")
            resp = conn.getresponse()
            resp.read()
            codes.append(resp.status)
    finally:
        conn.close()
    assert codes == [200, 200, 429]
    recs = actions(gw, start)
    assert [r["action"] for r in recs][-1] == "secret.rate_limited"
    assert recs[-1]["details"]["rate_limit"] == 2


# ---- DNS -------------------------------------------------------------------------------------------


def test_dns_answers_by_policy(gw: Gateway) -> None:
    server = ("127.0.0.1", gw.dns_port)
    gw.put(SB1, {"allow": ["127.0.0.0/8", "*.test"], "deny": ["evil.test", "api.test:25"]})
    start = last_seq(gw)
    assert dns_query(server, "api.test") == ("NOERROR", ["127.0.0.1"])  # a port-limited deny keeps the name
    assert dns_query(server, "api.test", tcp=True) == ("NOERROR", ["127.0.0.1"])
    assert dns_query(server, "evil.test") == ("NXDOMAIN", [])
    assert dns_query(server, "metadata.test") == ("NXDOMAIN", [])  # its only address is blocked
    assert dns_query(server, "nowhere.test") == ("NXDOMAIN", [])
    assert dns_query(server, "api.test", "AAAA") == ("NOERROR", [])
    assert dns_query(server, "v6.test", "AAAA") == ("NOERROR", [])  # no IPv6 allowed
    denied = [(r["action"], r["target"]) for r in actions(gw, start)]
    assert denied == [("dns.deny", "evil.test"), ("dns.deny", "metadata.test")]
    gw.put(SB1, {"allow": ["*.test", "2001:db8::/32"]})
    assert dns_query(server, "v6.test", "AAAA") == ("NOERROR", ["2001:db8::5"])
    gw.put(SB2, {"allow": ["other.test"]})
    assert dns_query(server, "api.test", src=SB2) == ("NXDOMAIN", [])
    assert dns_query(server, "api.test", src=STRANGER) == ("REFUSED", [])


# ---- closing connections ---------------------------------------------------------------------------


def test_reset_aborts_open_connections(gw: Gateway, upstream: Upstream) -> None:
    gw.put(SB1, LOOPBACK_OK)
    s, status, _ = gw.connect(SB1, "api.test", upstream.port)
    assert status == 200
    s.sendall(b"GET /echo HTTP/1.1\r\n")  # half a request: both legs open and idle
    plain = http.client.HTTPConnection("127.0.0.1", gw.proxy_port, timeout=10, source_address=(SB1, 0))
    plain.request("GET", f"http://api.test:{upstream.port}/echo")
    assert plain.getresponse().read()  # and a kept-alive plain-HTTP connection
    local = s.getsockname()
    wait_for(lambda: gw.ctl({"op": "list"})["sandboxes"][0]["connections"] == 2, 10, "two connections")
    r = gw.ctl({"op": "reset", "ip": SB1})
    assert r == {"ok": True, "reset": 2}
    s.settimeout(5)
    with pytest.raises(ConnectionResetError):
        if s.recv(1) == b"":
            raise AssertionError("closed with a FIN, not reset")
    s.close()
    assert tcp_state(local) is None  # reset: nothing left on the sandbox's side, no TIME_WAIT
    plain.close()
    assert gw.ctl({"op": "list"})["sandboxes"][0]["connections"] == 0


def test_client_closing_first_leaves_no_time_wait(gw: Gateway, upstream: Upstream) -> None:
    gw.put(SB1, LOOPBACK_OK)
    conn = http.client.HTTPConnection("127.0.0.1", gw.proxy_port, timeout=10, source_address=(SB1, 0))
    conn.request("GET", f"http://api.test:{upstream.port}/echo")
    assert conn.getresponse().read()
    assert conn.sock is not None
    local = conn.sock.getsockname()
    conn.close()  # our FIN first: the gateway answers with a RST, not a FIN
    wait_for(lambda: tcp_state(local) is None, 10, f"the client socket to be gone (is {tcp_state(local)})")


def test_gateway_closing_first_is_a_clean_eof_and_no_time_wait(gw: Gateway, upstream: Upstream) -> None:
    gw.put(SB1, LOOPBACK_OK)
    s = socket.create_connection(("127.0.0.1", gw.proxy_port), timeout=10, source_address=(SB1, 0))
    local = s.getsockname()
    s.sendall(f"GET http://api.test:{upstream.port}/close HTTP/1.1\r\nHost: api.test\r\n\r\n".encode())
    data = b""
    while chunk := s.recv(65536):  # to EOF: a FIN after the whole answer, not a reset
        data += chunk
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"}")
    s.close()
    wait_for(lambda: tcp_state(local) is None, 10, f"the client socket to be gone (is {tcp_state(local)})")


# ---- the journal -----------------------------------------------------------------------------------


def test_journal_survives_restart_and_ack_trims_it(tmp_path: Path, pki: UpstreamPKI, upstream: Upstream) -> None:
    with running_gateway(tmp_path / "gw", pki) as gw:
        gw.put(SB1, {"allow": ["api.test"]})
        for _ in range(3):
            assert gw.http(SB1, f"http://evil.test:{upstream.port}/x").status == 403
        before = gw.audit()
        assert [r["seq"] for r in before] == [1, 2, 3]
        proc = gw.proc
        gw.stop()
        assert proc is not None and proc.returncode == 0  # SIGTERM: a clean exit
        gw.start()
        assert gw.audit() == before
        gw.put(SB1, {"allow": ["api.test"]})  # a restart forgets registrations: the node re-puts
        assert gw.http(SB1, f"http://evil.test:{upstream.port}/x").status == 403
        assert [r["seq"] for r in gw.audit()] == [1, 2, 3, 4]
        assert gw.ctl({"op": "ack", "upto": 3}) == {"ok": True, "acked": 3}
        assert [r["seq"] for r in gw.audit()] == [4]
        assert gw.ctl({"op": "audit", "after": 4})["last"] == 4
        gw.ctl({"op": "ack", "upto": 4})
        assert gw.audit() == []
        assert not list((tmp_path / "gw" / "journal").glob("seg-*"))  # fully acked segments are gone
        gw.stop()
        gw.start()
        gw.put(SB1, {"allow": ["api.test"]})
        assert gw.http(SB1, f"http://evil.test:{upstream.port}/x").status == 403
        assert [r["seq"] for r in gw.audit()] == [5]  # seq keeps increasing across restarts
