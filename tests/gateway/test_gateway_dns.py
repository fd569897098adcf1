"""The real gateway against a real resolver on loopback (tests/security/egress_fixtures.CountingDns):
what reaches upstream DNS, and the DNS server's bounds.

- a name the policy settles (an allowlist without it, a deny rule, a host that is an address in some
  spelling or neither address nor name) is never asked upstream: not for a CONNECT, a plain-HTTP
  request, nor the sandbox's own query; with a CIDR in the allow list too;
- a flood of queries from one sandbox is bounded: at most MAX_INFLIGHT_PER_SOURCE of its lookups
  are in flight upstream, the rest are REFUSED at once (counted), and another sandbox is still
  answered; DNS-over-TCP connections per sandbox are bounded too.
"""

from __future__ import annotations

import secrets
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.harness import SB1, SB2, Gateway, UpstreamPKI, dns_query
from tests.security.egress_fixtures import CountingDns
from tests.waiting import wait_for

MAX_INFLIGHT_PER_SOURCE = 32  # space/gateway/dns.py
MAX_TCP_PER_SOURCE = 8


@pytest.fixture(scope="module")
def resolver() -> Iterator[CountingDns]:
    d = CountingDns({"api.test": "198.51.100.7"})
    yield d
    d.close()


@pytest.fixture(scope="module")
def real_dns_gateway(tmp_path_factory: pytest.TempPathFactory, pki: UpstreamPKI,
                     resolver: CountingDns) -> Iterator[Gateway]:
    gw = Gateway(tmp_path_factory.mktemp("gw-dns"), pki, upstream_dns=resolver.address)
    try:
        gw.start()
        yield gw
    finally:
        gw.stop()


@pytest.mark.parametrize("policy", [{"allow": ["api.test"]}, {"allow": ["api.test", "198.51.100.0/24"]},
                                    {"deny": ["*.evil.tld"]}], ids=["allowlist", "allowlist-with-cidr", "deny"])
def test_a_name_the_policy_settles_is_never_asked_upstream(real_dns_gateway: Gateway, resolver: CountingDns,
                                                           policy: dict[str, list[str]]) -> None:
    gw = real_dns_gateway
    gw.put(SB1, policy)
    data = "x" + secrets.token_hex(6)
    s, status, _ = gw.connect(SB1, f"{data}-1.evil.tld", 443)
    s.close()
    assert status == 403
    r = gw.http(SB1, f"http://{data}-2.evil.tld/")
    assert r.status == 403
    for qtype in ("A", "AAAA", "TXT"):
        assert dns_query(("127.0.0.1", gw.dns_port), f"{data}-3.evil.tld", qtype)[0] == "NXDOMAIN"
    assert resolver.questions(data) == []
    # The allowed name is still looked up (and answered).
    assert dns_query(("127.0.0.1", gw.dns_port), "api.test")[1] == ["198.51.100.7"] or "deny" in policy


# 169.254.169.254 spelled as a resolver would also read it (loopback is open to this test gateway).
@pytest.mark.parametrize("host", ["2852039166", "0xa9fea9fe", "0251.0376.0251.0376", "169.254.43518", "0xa9.0xfe.43518",
                                  "1.2.3.4.5", "256.0.0.1", "foo.0x10"])
def test_a_host_that_ends_in_a_number_is_never_a_name(real_dns_gateway: Gateway, resolver: CountingDns,
                                                      host: str) -> None:
    gw = real_dns_gateway
    gw.put(SB1, {"allow": ["0.0.0.0/0", "*"]})
    s, status, _ = gw.connect(SB1, host, 443)
    s.close()
    assert status == 403
    r = gw.http(SB1, f"http://{host}:80/")
    assert r.status == 403
    assert dns_query(("127.0.0.1", gw.dns_port), host)[0] == "NXDOMAIN"
    assert resolver.questions(host) == []


def test_a_flood_of_queries_is_bounded_and_others_are_still_answered(tmp_path: Path, pki: UpstreamPKI) -> None:
    silent = CountingDns({}, silent=True)
    gw = Gateway(tmp_path / "gw", pki, upstream_dns=silent.address)
    try:
        gw.start()
        gw.put(SB1, {})  # default allow: every name goes upstream, where nothing answers
        gw.put(SB2, {"allow": ["api.test"]})
        flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        flood.bind((SB1, 0))
        flood.settimeout(10)
        n = 400
        rcodes: list[int] = []
        for i in range(n):
            q = struct.pack("!HHHHHH", i, 0x0100, 1, 0, 0, 0) + bytes([5]) + f"q{i:04d}".encode() + b"\0" + \
                struct.pack("!HH", 1, 1)
            flood.sendto(q, ("127.0.0.1", gw.dns_port))
            if i % 50 == 49:  # paced, and replies read, so that the kernel drops none of them
                wait_for(lambda i=i: _seen(gw) >= i + 1, 30, "the gateway to read the datagrams sent")
                while len(rcodes) < _seen(gw) - MAX_INFLIGHT_PER_SOURCE:
                    rcodes.append(_reply(flood, gw, rcodes, n))
        while len(rcodes) < n:
            rcodes.append(_reply(flood, gw, rcodes, n))
        # Each lookup let through ends in NXDOMAIN (upstream never answers) and frees its slot: so
        # at most MAX_INFLIGHT_PER_SOURCE + (those ended) were let through, the rest REFUSED.
        ended, refused = rcodes.count(3), rcodes.count(5)
        assert ended + refused == n, rcodes
        assert refused >= n - MAX_INFLIGHT_PER_SOURCE - ended, (ended, refused)
        assert len({q for q, _ in silent.questions("q")}) <= MAX_INFLIGHT_PER_SOURCE + ended
        assert gw.ctl({"op": "stats"})["dns_busy"] == refused
        # Another sandbox is answered at once (its name is settled locally).
        assert dns_query(("127.0.0.1", gw.dns_port), "elsewhere.example", src=SB2)[0] == "NXDOMAIN"
        flood.close()

        # DNS over TCP: at most MAX_TCP_PER_SOURCE connections of one sandbox at once.
        held = [socket.create_connection(("127.0.0.1", gw.dns_port), source_address=(SB1, 0))
                for _ in range(MAX_TCP_PER_SOURCE)]
        wait_for(lambda: gw.ctl({"op": "stats"})["dns_tcp_refused"] == 0 and _open(gw, held), 10,
                 "the held connections to be accepted")
        extra = socket.create_connection(("127.0.0.1", gw.dns_port), source_address=(SB1, 0))
        extra.settimeout(10)
        with pytest.raises((ConnectionResetError, ConnectionAbortedError)):
            if extra.recv(1) == b"":
                raise AssertionError("closed, not reset")
        assert gw.ctl({"op": "stats"})["dns_tcp_refused"] == 1
        for s in [*held, extra]:
            s.close()
    finally:
        gw.stop()
        silent.close()


def _reply(s: socket.socket, gw: Gateway, rcodes: list[int], n: int) -> int:
    try:
        data = s.recv(512)
    except TimeoutError:
        raise AssertionError(f"{n - len(rcodes)} queries unanswered; {rcodes.count(3)} NXDOMAIN, "
                             f"{rcodes.count(5)} REFUSED; {gw.ctl({'op': 'stats'})}") from None
    assert data[4:6] == b"\0\1" and data[12:], data  # its question echoed
    return data[3] & 0xF


def _seen(gw: Gateway) -> int:
    st = gw.ctl({"op": "stats"})
    return int(st["dns_queries"]) + int(st["dns_busy"])


def _open(gw: Gateway, held: list[socket.socket]) -> bool:
    # Every held connection is accepted once a query on it is answered (REFUSED or otherwise is
    # fine): send one whose name is settled locally (no upstream) and read the reply.
    for s in held:
        s.settimeout(10)
        q = struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\x012\x00" + struct.pack("!HH", 1, 1)
        s.sendall(struct.pack("!H", len(q)) + q)
        if len(s.recv(2)) != 2:
            return False
        s.recv(4096)
    return True
