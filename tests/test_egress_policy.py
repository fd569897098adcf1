"""The egress policy language (space/egress_policy.py): hosts parsed as a resolver would, the fence
no policy opens, the operator's ceiling, layers that only narrow, name-first decisions, and the
API's check of what an entry may open. Properties are checked with hypothesis."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from space.egress_policy import (
    NEVER,
    PRIVATE,
    Egress,
    Fence,
    InvalidHost,
    Policy,
    check_reach,
    classify_host,
    narrow,
    parse_ceiling,
    parse_sandbox_network,
    reach_report,
    validate,
)
from space.errors import InvalidRequest

ip = ipaddress.ip_address
net = ipaddress.ip_network
SANDBOXES = (net("10.208.0.0/12"),)
NODE = [ip("192.0.2.2"), ip("fd00::2"), ip("fe80::fc00:ff:fe00:1")]


def fence() -> Fence:
    return Fence(SANDBOXES, NODE)


def egress(*docs: dict[str, object] | None, ceiling: tuple[str, ...] = ()) -> Egress:
    return Egress.build(docs, parse_ceiling(ceiling), fence())


OPEN = {"allow": ["0.0.0.0/0", "::/0", "*"]}

# ---- hosts: parsed as the address they mean, or refused --------------------------------------------


@pytest.mark.parametrize("spelling", ["127.0.0.1", "127.1", "127.0.1", "2130706433", "0x7f000001", "0x7F000001",
                                      "0177.0.0.1", "0x7f.0.0.1", "0x7f.1", "017700000001", "127.0.0.1.",
                                      "[::ffff:127.0.0.1]", "::ffff:7f00:1"])
def test_every_spelling_of_loopback_is_loopback(spelling: str) -> None:
    got = classify_host(spelling)
    assert not isinstance(got, str)
    assert got == ip("127.0.0.1") or getattr(got, "ipv4_mapped", None) == ip("127.0.0.1")


@pytest.mark.parametrize("bad", ["1.2.3.4.5", "256.1.1.1", "1.256.1.1", "4294967296", "08", "0x", "foo.123",
                                 "example.0x10", "[127.0.0.1]", "[::zz]", "a..b", "-a.com", "exa mple.com",
                                 "caf\u00e9.com", ""])
def test_what_is_neither_address_nor_name_is_refused(bad: str) -> None:
    with pytest.raises(InvalidHost):
        classify_host(bad)


def test_names_stay_names() -> None:
    assert classify_host("API.Example.com.") == "api.example.com"
    assert classify_host("123.example.com") == "123.example.com"  # a numeric label, not the last
    assert classify_host("xn--caf-dma.com") == "xn--caf-dma.com"


_part = st.integers(0, 255)


@st.composite
def numeric_spellings(draw: st.DrawFn) -> tuple[str, int]:
    """An IPv4 address in one of inet_aton's forms: 1-4 parts, each decimal, octal or hex."""
    n = draw(st.integers(0, 2**32 - 1))
    parts = draw(st.integers(1, 4))
    b = n.to_bytes(4, "big")
    values = [*b[:parts - 1], int.from_bytes(b[parts - 1:], "big")]

    def spell(v: int) -> str:
        form = draw(st.sampled_from(["dec", "oct", "hex", "HEX"]))
        if form == "oct":
            return "0" + format(v, "o")
        if form == "hex":
            return "0x" + format(v, "x")
        if form == "HEX":
            return "0X" + format(v, "X")
        return str(v)
    return ".".join(spell(v) for v in values), n


@settings(max_examples=400, deadline=None)
@given(numeric_spellings())
def test_numeric_forms_mean_what_inet_aton_says(case: tuple[str, int]) -> None:
    text, n = case
    assert classify_host(text) == ipaddress.IPv4Address(n)
    assert socket.inet_aton(text) == n.to_bytes(4, "big")  # the resolver agrees


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="0123456789abcdefxX.", min_size=1, max_size=20))
def test_anything_inet_aton_reads_as_an_address_is_that_address(text: str) -> None:
    try:
        packed = socket.inet_aton(text)
    except OSError:
        packed = None
    try:
        got = classify_host(text)
    except InvalidHost:
        got = None
    if packed is not None:
        assert got == ipaddress.IPv4Address(packed), text  # never mistaken for a name
    elif isinstance(got, str):
        assert not got.rsplit(".", 1)[-1].isdigit(), text  # a name never ends in a number


# ---- the fence -------------------------------------------------------------------------------------

ALWAYS = ["127.0.0.1", "127.255.0.9", "0.0.0.0", "0.1.2.3", "169.254.169.254", "169.254.0.1", "100.100.100.200",
          "::1", "::", "fe80::1", "fd00:ec2::254", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1",
          "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "2002:7f00:1::1", "224.0.0.1", "255.255.255.255",
          "10.208.0.6", "10.223.32.1", "192.0.2.2", "::ffff:192.0.2.2", "fd00::2", "fe80::fc00:ff:fe00:1"]
POLICIES = [None, OPEN, {"allow": ["0.0.0.0/0:80"]}, {"default": "allow"}, {"allow": ["127.0.0.0/8", "::/0"]},
            {"allow": ["10.208.0.0/12", "169.254.169.254/32", "*"]}]


@pytest.mark.parametrize("addr", ALWAYS)
@pytest.mark.parametrize("policy", POLICIES)
def test_the_fence_holds_whatever_policy_and_ceiling_say(addr: str, policy: dict[str, object] | None) -> None:
    e = egress(policy, policy, ceiling=("10.0.0.0/8", "fc00::/7", "100.64.0.0/10"))
    for port in (0, 80, 8080):
        d = e.decide(addr, port)
        assert not d.allowed, (addr, policy, d)
        assert d.rule in ("blocked-range", "node-address")
        assert not e.decide("api.example.com", port, [ip(addr)]).allowed


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([n for n, _ in NEVER] + list(SANDBOXES)), st.integers(0, 2**128 - 1),
       st.sampled_from(POLICIES))
def test_no_address_of_a_never_range_is_ever_allowed(network: ipaddress.IPv4Network | ipaddress.IPv6Network,
                                                    r: int, policy: dict[str, object] | None) -> None:
    addr = network[r % network.num_addresses]
    e = egress(policy, ceiling=("10.0.0.0/8", "fc00::/7"))
    assert not e.decide(str(addr), 443).allowed
    mapped = ipaddress.IPv6Address(f"::ffff:{addr}") if addr.version == 4 else addr
    assert not e.decide("name.example", 443, [mapped]).allowed


def test_node_addresses_follow_the_node() -> None:
    f = Fence(SANDBOXES)
    e = Egress.build([OPEN], (), f)
    assert e.decide("203.0.113.7", 443).allowed
    f.set_node_addresses([ip("203.0.113.7"), ip("2001:db8::7")])
    assert e.decide("203.0.113.7", 443).rule == "node-address"
    assert not e.decide("::ffff:203.0.113.7", 443).allowed
    assert not e.decide("[2001:db8::7]", 443).allowed


def test_loopback_for_the_gateway_tests_is_a_private_range() -> None:
    f = Fence(allow_loopback=True)
    assert not Egress.build([{"allow": ["*"]}], (net("127.0.0.0/8"),), f).decide("127.0.0.1", 80).allowed
    assert Egress.build([{"allow": ["127.0.0.0/8"]}], (net("127.0.0.0/8"),), f).decide("127.0.0.1", 80).allowed


# ---- private ranges: the operator's ----------------------------------------------------------------


def test_private_ranges_need_the_ceiling_and_a_cidr() -> None:
    policy = {"allow": ["db.internal", "10.0.0.0/8:5432"]}
    assert not egress(policy).decide("10.1.2.3", 5432).allowed  # no ceiling: closed
    e = egress(policy, ceiling=("10.0.0.0/8",))
    assert e.decide("10.1.2.3", 5432).allowed
    assert not e.decide("10.1.2.3", 22).allowed  # the rule's port only
    assert e.decide("db.internal", 5432, [ip("10.1.2.3")]).allowed  # a name a host rule allows
    # A host rule never opens a private address by itself, even inside the ceiling.
    assert not egress({"allow": ["*"]}, ceiling=("10.0.0.0/8",)).decide("x.example", 443, [ip("10.1.2.3")]).allowed
    # A CIDR wider than the ceiling opens only the ceiling.
    wide = egress({"allow": ["10.0.0.0/8"]}, ceiling=("10.5.0.0/16",))
    assert wide.decide("10.5.1.1", 80).allowed and not wide.decide("10.6.1.1", 80).allowed
    assert "ceiling" in wide.decide("10.6.1.1", 80).reason


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PRIVATE), st.integers(0, 2**128 - 1))
def test_private_addresses_outside_the_ceiling_stay_closed(network: ipaddress.IPv4Network | ipaddress.IPv6Network,
                                                           r: int) -> None:
    addr = network[r % network.num_addresses]
    for policy in POLICIES:
        assert not egress(policy, ceiling=()).decide(str(addr), 443).allowed


def test_ceilings_are_private_ranges_and_narrow() -> None:
    assert parse_ceiling(["10.5.0.0/16", "fd12::/16"]) == (net("10.5.0.0/16"), net("fd12::/16"))
    for bad in (["127.0.0.0/8"], ["0.0.0.0/0"], ["203.0.113.0/24"], ["nope"]):
        with pytest.raises(InvalidRequest):
            parse_ceiling(bad)
    assert narrow([net("10.0.0.0/8")], [net("10.5.0.0/16"), net("192.168.0.0/16")]) == (net("10.5.0.0/16"),)
    assert narrow([net("10.5.0.0/16")], []) == ()


# ---- layers: a sandbox policy only narrows its tenant's --------------------------------------------

LAYER_DOCS = [None, {}, {"allow": ["api.example.com"]}, {"deny": ["evil.example"]}, {"allow": ["*.example.com"]},
              {"allow": ["203.0.113.0/24"]}, {"allow": ["0.0.0.0/0"], "deny": ["203.0.113.9/32"]},
              {"default": "deny"}, {"allow": ["api.example.com:443"], "deny": ["*.evil.example"]}]
TARGETS = [("api.example.com", 443, ["93.184.216.34"]), ("api.example.com", 80, ["93.184.216.34"]),
           ("evil.example", 443, ["198.51.100.1"]), ("x.evil.example", 443, ["198.51.100.1"]),
           ("203.0.113.9", 443, []), ("203.0.113.10", 22, []), ("www.example.com", 443, ["203.0.113.5"])]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(LAYER_DOCS), st.sampled_from(LAYER_DOCS), st.sampled_from(TARGETS))
def test_a_second_layer_never_widens(tenant: dict[str, object] | None, own: dict[str, object] | None,
                                     target: tuple[str, int, list[str]]) -> None:
    host, port, addrs = target
    ips = [ip(a) for a in addrs]
    both = egress(tenant, own).decide(host, port, ips).allowed
    assert both == (egress(tenant).decide(host, port, ips).allowed and egress(own).decide(host, port, ips).allowed)


def test_tenant_denies_and_allowlists_bind_the_sandbox() -> None:
    tenant = {"allow": ["api.example.com"], "deny": ["evil.example"]}
    assert not egress(tenant, {"allow": ["evil.example"], "default": "allow"}).decide(
        "evil.example", 443, [ip("198.51.100.1")]).allowed
    assert not egress(tenant, {"default": "allow"}).decide("other.example", 443, [ip("198.51.100.1")]).allowed
    assert egress(tenant, {"default": "allow"}).decide("api.example.com", 443, [ip("93.184.216.34")]).allowed


# ---- names are decided before any lookup -----------------------------------------------------------


def test_an_allowlist_settles_unlisted_names_without_a_lookup() -> None:
    for doc in ({"allow": ["api.test"]}, {"allow": ["api.test", "203.0.113.0/24"]}, {"allow": ["0.0.0.0/0"]}):
        e = egress(doc)
        denied = e.check_name("data1234.evil.tld", 443)
        assert denied is not None and not denied.allowed, doc
        assert e.check_name("data1234.evil.tld", 0) is not None  # the DNS server's question too
        assert e.check_name("api.test", 443) is None or "0.0.0.0/0" in str(doc)
    # The CIDR is reached by address.
    assert egress({"allow": ["api.test", "203.0.113.0/24"]}).decide("203.0.113.5", 443).allowed
    # Deny rules are name decisions too; a deny limited to a port leaves the name resolvable.
    e = egress({"deny": ["smtp.example.com:25", "bad.example.com"]})
    assert e.check_name("smtp.example.com", 0) is None
    assert e.check_name("smtp.example.com", 25) is not None
    assert e.check_name("bad.example.com", 0) is not None
    assert e.check_name("anything.org", 443) is None  # default allow: resolved, then decided
    # An address in any spelling is no name to look up; garbage is refused.
    assert e.check_name("2130706433", 80) is None and not e.decide("2130706433", 80).allowed
    d = e.check_name("1.2.3.4.5", 80)
    assert d is not None and d.rule == "invalid-host"
    assert egress({}).check_name("localhost", 80) is not None


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(LAYER_DOCS), st.sampled_from(LAYER_DOCS), st.sampled_from(TARGETS),
       st.lists(st.sampled_from(["93.184.216.34", "10.1.2.3", "127.0.0.1", "198.51.100.1"]), max_size=3))
def test_what_the_name_settles_no_address_overturns(tenant: dict[str, object] | None, own: dict[str, object] | None,
                                                     target: tuple[str, int, list[str]], addrs: list[str]) -> None:
    host, port, _ = target
    e = egress(tenant, own, ceiling=("10.0.0.0/8",))
    early = e.check_name(host, port)
    if early is not None:
        assert not e.decide(host, port, [ip(a) for a in addrs]).allowed


# ---- the API's check of what an entry opens --------------------------------------------------------


def test_entries_that_open_only_what_they_may_not_are_refused_naming_the_entry_and_ceiling() -> None:
    ceiling = parse_ceiling(["10.5.0.0/16"])
    for rule in ("10.208.0.0/12", "10.210.0.4/30", "127.0.0.0/8", "169.254.169.254/32", "::1/128", "fe80::/10",
                 "::ffff:127.0.0.1/128"):
        with pytest.raises(InvalidRequest, match="never reachable") as e:
            check_reach({"allow": [rule]}, ceiling, SANDBOXES)
        assert e.value.details["rule"] == rule
    for rule in ("10.0.0.0/8", "192.168.1.0/24", "fd00::/8", "10.5.0.0/15"):
        with pytest.raises(InvalidRequest, match=r"outside this tenant's ceiling \(10.5.0.0/16\)") as e:
            check_reach({"allow": [rule]}, ceiling, SANDBOXES)
        assert e.value.details == {"rule": rule, "ceiling": ["10.5.0.0/16"]}
    assert check_reach({"allow": ["10.5.1.0/24", "203.0.113.0/24", "api.example.com"]}, ceiling, SANDBOXES) == []
    notes = check_reach({"allow": ["0.0.0.0/0", "::/0"]}, ceiling, SANDBOXES)
    assert len(notes) == 2 and all("stay closed" in n for n in notes)
    assert check_reach({"deny": ["127.0.0.0/8"]}, (), SANDBOXES) == []  # denying is always fine
    assert reach_report({"allow": ["10.0.0.0/8"]}, (), SANDBOXES) == [("10.0.0.0/8", "outside")]


def test_validate_normalizes_and_is_idempotent() -> None:
    doc = {"allow": ["API.example.com", "api.example.com", "10.0.0.1/8:5432"], "deny": [" x.com "]}
    norm = validate(doc)
    assert norm == {"allow": ["API.example.com", "api.example.com", "10.0.0.1/8:5432"], "deny": ["x.com"]}
    assert validate(norm) == norm
    assert Policy.from_doc(norm).allow[0].host == "api.example.com"
    for bad in ({"allow": "x.com"}, {"allow": ["not a host"]}, {"allow": ["1.2.3.4.5"]}, {"allow": ["x.com:0"]},
                {"default": "maybe"}, {"other": []}):
        with pytest.raises(InvalidRequest):
            validate(bad)


@pytest.mark.parametrize("text", ["10.208.0.0/12", "172.29.0.0/16", "100.72.0.0/20", "192.168.0.0/16", " 10.0.0.0/8 "])
def test_a_sandbox_network_is_a_private_range_of_a_node_slot_at_least(text: str) -> None:
    assert str(parse_sandbox_network(text)) == text.strip()


@pytest.mark.parametrize("text", ["10.208.0.0/21", "8.8.0.0/16", "fd00::/48", "10.208.0.1/12", "nope", "",
                                  "169.254.0.0/16", "127.0.0.0/8"])
def test_anything_else_is_refused_as_a_sandbox_network(text: str) -> None:
    with pytest.raises(InvalidRequest, match="sandbox network"):
        parse_sandbox_network(text)
