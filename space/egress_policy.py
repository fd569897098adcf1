"""Egress policy: what a sandbox may connect to. The one definition, used by the API (validation),
the controller and the node (what they send on) and the node's gateway (every decision).

Standard library and :mod:`space.errors` only: the gateway imports this from its own virtualenv.

**A policy** is ``{"allow": [...], "deny": [...], "default": "allow" | "deny"}``. An entry is a host
pattern (``pypi.org``, ``*.example.com``, ``*``) or a CIDR (``203.0.113.0/24``, ``2001:db8::/32``),
either with an optional port (``api.example.com:443``, ``10.1.0.0/16:5432``). Left out, ``default``
is ``deny`` when the policy lists anything to allow (an allowlist) and ``allow`` otherwise.

**What decides** a connection (:class:`Egress`), in this order:

1. **Never** (:class:`Fence`): loopback and unspecified in every spelling, link-local and the cloud
   metadata addresses, multicast and reserved ranges, the node's sandbox networks and every
   address of the node itself. No policy, ceiling or operator opens these.
2. **Private ranges** (RFC 1918, CGNAT, benchmarking, IPv6 unique-local, ...) are the operator's:
   reachable only inside the *ceiling* (a deployment setting, narrowed per tenant by the operator)
   and only where an ``allow`` **CIDR** covers the address (a host pattern never opens one, so a
   name that resolves or is rebound into a private range stays blocked).
3. **Layers**: the tenant's default policy and the sandbox's own, *each* must allow the connection
   (a sandbox policy narrows its tenant's, never widens it). In a layer: a matching ``deny`` entry
   denies; else a matching ``allow`` entry allows; else its ``default``.

**Names and addresses.** A host is first parsed the way a resolver would (:func:`classify_host`):
``2130706433``, ``0x7f000001``, ``0177.0.0.1`` and ``127.1`` *are* 127.0.0.1, and something that ends
in a number without being an address is refused, never looked up as a name. A connection to an
address is decided on the address: ``allow`` CIDRs (and ``*``) allow it. A connection to a name is
decided on the name: ``allow`` host patterns allow it, and under ``default: deny`` a name no host
pattern allows is denied **before any lookup** (:meth:`Egress.check_name`) — a CIDR never makes an
arbitrary name worth resolving, so a sandbox cannot exfiltrate data through upstream DNS by asking
for ``<data>.evil.tld``. The price: under an allowlist, a CIDR is reached by address, or by a name
a host pattern allows (whose addresses must then be public or inside an allowed CIDR).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from space.errors import InvalidRequest

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_ENTRIES = 256


def _nets(*cidrs: str) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(c) for c in cidrs)


LOOPBACK = _nets("127.0.0.0/8", "::1/128")

#: Never reachable, whatever any policy or ceiling says (with what each range is, for messages).
NEVER: tuple[tuple[IPNetwork, str], ...] = tuple((ipaddress.ip_network(c), what) for c, what in (
    ("0.0.0.0/8", "unspecified"), ("127.0.0.0/8", "loopback"), ("169.254.0.0/16", "link-local/metadata"),
    ("100.100.100.200/32", "metadata"), ("168.63.129.16/32", "metadata"), ("192.0.0.192/32", "metadata"),
    ("224.0.0.0/4", "multicast"), ("240.0.0.0/4", "reserved"), ("255.255.255.255/32", "broadcast"),
    ("::/128", "unspecified"), ("::1/128", "loopback"), ("::/96", "IPv4-compatible"),
    ("fe80::/10", "link-local"), ("fd00:ec2::/32", "metadata"), ("100::/64", "discard"),
    ("ff00::/8", "multicast"),
))

#: The operator's: reachable only inside the ceiling, and only where an allow CIDR covers them.
PRIVATE = _nets("10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16",
                "198.18.0.0/15", "fc00::/7", "fec0::/10", "64:ff9b:1::/48")

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_6TO4 = ipaddress.ip_network("2002::/16")

_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_HOST_RE = re.compile(rf"^(\*|(\*\.)?{_LABEL}(\.{_LABEL})*)$")
_NAME_RE = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_NUMBER_RE = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")


# ---- hosts -----------------------------------------------------------------------------------------


class InvalidHost(InvalidRequest):
    """A host that is neither an address nor a name (never looked up)."""


def parse_ipv4_number(text: str) -> ipaddress.IPv4Address | None:
    """An IPv4 address in any form ``inet_aton`` accepts (``127.1``, ``2130706433``, ``0x7f.0.0.1``,
    ``0177.0.0.1``), else None."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values: list[int] = []
    for p in parts:
        if not _NUMBER_RE.match(p):
            return None
        try:
            if p.startswith("0x"):
                values.append(int(p[2:], 16))  # "0x" alone is no number (inet_aton agrees)
            elif len(p) > 1 and p.startswith("0"):
                values.append(int(p, 8))
            else:
                values.append(int(p))
        except ValueError:  # "08"
            return None
    *head, last = values
    if any(v > 255 for v in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    n = last
    for i, v in enumerate(head):
        n |= v << (8 * (3 - i))
    return ipaddress.IPv4Address(n)


@functools.lru_cache(maxsize=4096)
def classify_host(raw: str) -> IPAddress | str:
    """The address ``raw`` means, or the name it is (lower-case, no trailing dot).

    Raises :class:`InvalidHost` for what is neither: something that ends in a number but is no
    address (``1.2.3.4.5``, ``foo.0x1``, ``256.1``), a bad IPv6 literal, a malformed name. Such a
    host is refused, never sent to a resolver (which might read it as an address after all)."""
    text = raw.strip().lower()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
        if ":" not in text:
            raise InvalidHost(f"invalid host {raw!r}", host=raw[:256])
    if ":" in text:
        try:
            return ipaddress.IPv6Address(text.split("%", 1)[0])
        except ValueError:
            raise InvalidHost(f"invalid IPv6 address {raw!r}", host=raw[:256]) from None
    if text.endswith("."):
        text = text[:-1]
    last = text.rsplit(".", 1)[-1]
    if _NUMBER_RE.match(last):
        ip = parse_ipv4_number(text)
        if ip is None:
            raise InvalidHost(f"invalid host {raw!r}: it ends in a number but is no IPv4 address", host=raw[:256])
        return ip
    if len(text) > 253 or not _NAME_RE.match(text):
        raise InvalidHost(f"invalid host name {raw!r}", host=raw[:256])
    return text


def canonical(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address is the IPv4 address it maps (a connection to it is one)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address a translated IPv6 one reaches (NAT64, 6to4, IPv4-compatible), if any."""
    n = int(ip)
    if ip in _NAT64 or (n >> 32 == 0 and n > 1):
        return ipaddress.IPv4Address(n & 0xFFFFFFFF)
    if ip in _6TO4:
        return ipaddress.IPv4Address((n >> 80) & 0xFFFFFFFF)
    return None


def _in(ip: IPAddress, nets: Iterable[IPNetwork]) -> bool:
    return any(ip.version == n.version and ip in n for n in nets)


class Ranges:
    """Networks as integer bounds per IP version: a lookup is a few integer comparisons (it runs on
    every connection and DNS answer; ``ip in network`` costs a microsecond each)."""

    def __init__(self, nets: Iterable[tuple[IPNetwork, str]]) -> None:
        bounds: dict[int, list[tuple[int, int, str]]] = {4: [], 6: []}
        for net, label in nets:
            bounds[net.version].append((int(net.network_address), int(net.broadcast_address), label))
        self.v4, self.v6 = tuple(bounds[4]), tuple(bounds[6])

    @classmethod
    def of(cls, nets: Iterable[IPNetwork]) -> Ranges:
        return cls((n, str(n)) for n in nets)

    def find(self, ip: IPAddress) -> str | None:
        x = int(ip)
        for lo, hi, label in (self.v4 if ip.version == 4 else self.v6):
            if lo <= x <= hi:
                return label
        return None


_PRIVATE = Ranges.of(PRIVATE)
_LOOPBACK = Ranges.of(LOOPBACK)


def is_private(ip: IPAddress) -> bool:
    ip = canonical(ip)
    if _PRIVATE.find(ip) is not None:
        return True
    inner = embedded_ipv4(ip) if isinstance(ip, ipaddress.IPv6Address) else None
    return inner is not None and _PRIVATE.find(inner) is not None


# ---- the fence: what nothing opens -----------------------------------------------------------------


class Fence:
    """What no policy reaches: :data:`NEVER`, the node's sandbox networks and the node's own
    addresses (the gateway keeps those current: :meth:`set_node_addresses`).

    ``allow_loopback`` is for the gateway's own tests only (their upstreams live on 127.0.0.x):
    loopback then becomes a private range like the others, open only inside the ceiling."""

    def __init__(self, sandbox_networks: Iterable[IPNetwork] = (), node_addresses: Iterable[IPAddress] = (),
                 *, allow_loopback: bool = False) -> None:
        self.allow_loopback = allow_loopback
        self.never = tuple((n, w) for n, w in NEVER if not (allow_loopback and n in LOOPBACK))
        self.sandbox_networks = tuple(sandbox_networks)
        self._ranges = Ranges([*((n, f"{w} ({n})") for n, w in self.never),
                               *((n, "a sandbox network of this node") for n in self.sandbox_networks)])
        self.node_addresses: frozenset[IPAddress] = frozenset()
        self.set_node_addresses(node_addresses)

    def set_node_addresses(self, addrs: Iterable[IPAddress]) -> None:
        self.node_addresses = frozenset(
            a for a in (canonical(x) for x in addrs) if not (self.allow_loopback and a.is_loopback))

    def reason(self, ip: IPAddress) -> str | None:
        """Why ``ip`` is never reachable, or None."""
        ip = canonical(ip)
        found = self._reason(ip)
        if found is None and ip.version == 6:
            assert isinstance(ip, ipaddress.IPv6Address)
            inner = embedded_ipv4(ip)
            if inner is not None:
                found = self._reason(inner)
        return found

    def _reason(self, ip: IPAddress) -> str | None:
        if ip in self.node_addresses:
            return "an address of the node itself"
        return self._ranges.find(ip)


# ---- rules and layers ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """One entry: a host pattern or a network, and the port it is limited to (None: any)."""

    text: str
    host: str | None = None
    network: IPNetwork | None = None
    port: int | None = None
    #: The network as (version, first, last) integers (see :class:`Ranges`).
    bounds: tuple[int, int, int] = (0, 0, -1)

    def matches_port(self, port: int) -> bool:
        return self.port is None or self.port == port

    def matches_host(self, host: str, port: int) -> bool:
        return self.host is not None and self.matches_port(port) and match_host(self.host, host)

    def matches_ip(self, ip: IPAddress, port: int) -> bool:
        version, lo, hi = self.bounds
        return ip.version == version and lo <= int(ip) <= hi and self.matches_port(port)


@dataclasses.dataclass(frozen=True)
class Decision:
    allowed: bool
    #: The entry that decided, or ``blocked-range``/``node-address``/``invalid-host``/``default``.
    rule: str
    reason: str


def match_host(pattern: str, host: str) -> bool:
    """``*`` matches every host; ``*.example.com`` matches its subdomains (not itself); else exact."""
    host = host.lower().rstrip(".")
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


def validate_host_pattern(pattern: str) -> str:
    """The pattern, lower-cased, or :class:`InvalidRequest` saying what is wrong with it."""
    p = pattern.strip().lower().rstrip(".")
    if not p or len(p) > 253 or not _HOST_RE.match(p) or _NUMBER_RE.match(p.rsplit(".", 1)[-1]):
        raise InvalidRequest(f"invalid host pattern {pattern!r}: use a name, '*.domain' or '*'",
                             pattern=pattern)
    return p


def parse_rule(entry: str) -> Rule:
    text = entry.strip()
    if not text:
        raise InvalidRequest("empty egress rule")
    port: int | None = None
    body = text
    # "[v6]:port", "v4/len:port", "host:port"; a bare IPv6 CIDR has several colons and no port.
    if body.startswith("["):
        inner, _, rest = body[1:].partition("]")
        body = inner
        if rest:
            port = _port(rest.removeprefix(":"), text)
    elif body.count(":") == 1:
        body, raw = body.split(":")
        port = _port(raw, text)
    try:
        net = ipaddress.ip_network(body, strict=False)
    except ValueError:
        pass
    else:
        if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96 and (
                mapped := net.network_address.ipv4_mapped) is not None:
            net = ipaddress.IPv4Network((mapped, net.prefixlen - 96))  # one spelling per network
        return Rule(text=text, network=net, port=port,
                    bounds=(net.version, int(net.network_address), int(net.broadcast_address)))
    try:
        return Rule(text=text, host=validate_host_pattern(body), port=port)
    except InvalidRequest:
        raise InvalidRequest(f"invalid egress rule {entry!r}: use a host pattern or a CIDR, "
                             "optionally with ':port'", rule=entry) from None


def _port(raw: str, text: str) -> int:
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise InvalidRequest(f"invalid port in egress rule {text!r}", rule=text)
    return int(raw)


def validate(doc: Mapping[str, Any] | None) -> dict[str, Any]:
    """A normalized policy document, or :class:`InvalidRequest` naming the bad entry (syntax only:
    :func:`check_reach` checks what the entries open)."""
    if not doc:
        return {}
    if not isinstance(doc, Mapping):
        raise InvalidRequest("an egress policy is an object {allow, deny, default}")
    unknown = set(doc) - {"allow", "deny", "default"}
    if unknown:
        raise InvalidRequest(f"unknown egress policy field(s): {', '.join(sorted(map(str, unknown)))}")
    out: dict[str, Any] = {}
    for key in ("allow", "deny"):
        entries = doc.get(key) or []
        if isinstance(entries, str) or not isinstance(entries, Sequence):
            raise InvalidRequest(f"egress '{key}' must be a list of host patterns or CIDRs")
        if len(entries) > MAX_ENTRIES:
            raise InvalidRequest(f"egress '{key}' has more than {MAX_ENTRIES} entries")
        rules = [parse_rule(str(e)).text for e in entries]
        if rules:
            out[key] = list(dict.fromkeys(rules))
    default = doc.get("default")
    if default is not None:
        if default not in ("allow", "deny"):
            raise InvalidRequest("egress 'default' must be 'allow' or 'deny'")
        out["default"] = default
    return out


@dataclasses.dataclass(frozen=True)
class Policy:
    """One layer: a validated policy document."""

    allow: tuple[Rule, ...] = ()
    deny: tuple[Rule, ...] = ()
    default_allow: bool = True

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any] | None) -> Policy:
        norm = validate(doc)
        allow = tuple(parse_rule(e) for e in norm.get("allow", []))
        deny = tuple(parse_rule(e) for e in norm.get("deny", []))
        default = norm.get("default") or ("deny" if allow else "allow")
        return cls(allow=allow, deny=deny, default_allow=default == "allow")

    @property
    def allows_ipv6(self) -> bool:
        return any(r.network is not None and r.network.version == 6 for r in self.allow)

    def name_denial(self, name: str, port: int) -> Decision | None:
        """The denial this layer settles from the name alone. Port 0: "some port no rule names"
        (what DNS asks): a deny limited to a port then leaves the name usable on the others, and
        an allow limited to a port still makes the name worth resolving."""
        for rule in self.deny:
            if rule.host is not None and rule.matches_port(port) and match_host(rule.host, name):
                return Decision(False, rule.text, f"{name} matches deny rule {rule.text!r}")
        if not self.default_allow and not any(
                r.host is not None and (port == 0 or r.matches_port(port)) and match_host(r.host, name)
                for r in self.allow):
            return Decision(False, "default", f"{name} is not on the allow list")
        return None

    def decide(self, host: str, port: int, ips: Sequence[IPAddress], by_name: bool) -> Decision:
        """This layer's verdict on a connection to ``host`` at ``ips``, once :meth:`name_denial` found
        nothing against the name (no ranges considered: :class:`Egress` checks those)."""
        for ip in ips:
            for rule in self.deny:
                if rule.matches_ip(ip, port):
                    return Decision(False, rule.text, f"{ip} matches deny rule {rule.text!r}")
        for rule in self.allow:
            if rule.matches_host(host, port):
                return Decision(True, rule.text, f"{host}:{port} matches allow rule {rule.text!r}")
        if not by_name and ips and all(any(r.matches_ip(ip, port) for r in self.allow) for ip in ips):
            return Decision(True, "cidr", f"{host}:{port} is in an allowed network")
        if self.default_allow:
            return Decision(True, "default", "allowed by default")
        return Decision(False, "default", f"{host}:{port} is not on the allow list")

    def opens(self, ip: IPAddress, port: int) -> bool:
        """Whether an allow CIDR of this layer covers ``ip`` (what a private address needs)."""
        return any(r.matches_ip(ip, port) for r in self.allow)


# ---- ceilings --------------------------------------------------------------------------------------


#: Where nodes give their sandboxes addresses unless told otherwise; each node takes a /20 of it.
DEFAULT_SANDBOX_NETWORK = "10.208.0.0/12"
#: A node's share of the sandbox network (1023 sandboxes).
SANDBOX_SLOT_PREFIX = 20
_SANDBOX_NETWORK_HOMES = _nets("10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16")


def parse_sandbox_network(text: str) -> ipaddress.IPv4Network:
    """The deployment's sandbox address range (``--sandbox-network``): IPv4, inside RFC 1918 or
    CGNAT space (a public range would shadow real destinations), and at least one node's /20. Pick
    one that collides with neither the VPC nor the pod and service CIDRs."""
    try:
        net = ipaddress.IPv4Network(text.strip())
    except ValueError as e:
        raise InvalidRequest(f"sandbox network {text!r}: not an IPv4 network ({e})") from None
    if net.prefixlen > SANDBOX_SLOT_PREFIX:
        raise InvalidRequest(f"sandbox network {net}: at least a /{SANDBOX_SLOT_PREFIX} (one node's share)")
    if not any(net.subnet_of(home) for home in _SANDBOX_NETWORK_HOMES if isinstance(home, ipaddress.IPv4Network)):
        raise InvalidRequest(f"sandbox network {net}: must lie inside "
                             f"{', '.join(str(h) for h in _SANDBOX_NETWORK_HOMES)}")
    return net


def parse_ceiling(entries: Iterable[str] | None) -> tuple[IPNetwork, ...]:
    """The private ranges an operator opens (CIDRs, each inside :data:`PRIVATE`)."""
    out: list[IPNetwork] = []
    for raw in entries or ():
        try:
            net = ipaddress.ip_network(str(raw).strip(), strict=False)
        except ValueError:
            raise InvalidRequest(f"invalid ceiling entry {raw!r}: use a CIDR", entry=str(raw)[:64]) from None
        if not any(net.version == p.version and net.subnet_of(p) for p in PRIVATE):  # type: ignore[arg-type]
            raise InvalidRequest(
                f"ceiling entry {raw!r} is not a private range: a ceiling opens private ranges only "
                f"({', '.join(map(str, PRIVATE))}); loopback, link-local, metadata, the node and its "
                "sandboxes are never reachable", entry=str(raw)[:64])
        out.append(net)
    return tuple(dict.fromkeys(out))


def narrow(a: Iterable[IPNetwork], b: Iterable[IPNetwork]) -> tuple[IPNetwork, ...]:
    """The addresses in both lists of networks."""
    out: list[IPNetwork] = []
    bs = list(b)
    for x in a:
        for y in bs:
            if x.version != y.version or not x.overlaps(y):
                continue
            out.append(x if x.prefixlen >= y.prefixlen else y)
    return tuple(dict.fromkeys(out))


def ceiling_text(ceiling: Iterable[IPNetwork]) -> str:
    nets = [str(n) for n in ceiling]
    return ", ".join(nets) if nets else "none"


# ---- what decides a connection ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Egress:
    """A sandbox's egress: its policy layers (every one must allow), the private ranges open to it
    (its ceiling) and the fence. The gateway builds one per sandbox; the fence is the node's."""

    layers: tuple[Policy, ...]
    ceiling: tuple[IPNetwork, ...]
    fence: Fence
    _ceiling: Ranges = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ceiling", Ranges.of(self.ceiling))

    @classmethod
    def build(cls, docs: Iterable[Mapping[str, Any] | None], ceiling: Iterable[IPNetwork], fence: Fence) -> Egress:
        layers = tuple(Policy.from_doc(d) for d in docs if d)
        return cls(layers=layers or (Policy(),), ceiling=tuple(ceiling), fence=fence)

    @property
    def allows_ipv6(self) -> bool:
        """Some layer allows an IPv6 network (else IPv6 answers only send clients down a dead route)."""
        return any(p.allows_ipv6 for p in self.layers)

    def check_name(self, host: str, port: int) -> Decision | None:
        """The denial the host alone settles, before any lookup; None: resolve it and :meth:`decide`.

        An address (in any spelling) settles nothing here; a host that is neither address nor name
        is denied; a name is denied when some layer denies it by name or, under ``default: deny``,
        has no host pattern that allows it."""
        try:
            target = classify_host(host)
        except InvalidHost as e:
            return Decision(False, "invalid-host", e.message)
        if not isinstance(target, str):
            return None
        return self._name_denial(target, port)

    def _name_denial(self, target: str, port: int) -> Decision | None:
        if target == "localhost" or target.endswith(".localhost"):
            return Decision(False, "blocked-range", f"{target} is loopback, in a blocked range")
        for layer in self.layers:
            denied = layer.name_denial(target, port)
            if denied is not None:
                return denied
        return None

    def decide(self, host: str, port: int, ips: Iterable[IPAddress] = ()) -> Decision:
        """The decision for a connection to ``host`` (a name, resolved to ``ips``, or an address in
        any spelling: then ``ips`` is ignored) on ``port``."""
        try:
            target = classify_host(host)
        except InvalidHost as e:
            return Decision(False, "invalid-host", e.message)
        if isinstance(target, str):
            early = self._name_denial(target, port)
            if early is not None:
                return early
            addrs = [canonical(ip) for ip in ips]
            if not addrs:
                return Decision(False, "dns", f"{target} does not resolve")
            by_name = True
        else:
            addrs, by_name = [canonical(target)], False
            host = str(addrs[0])
        for ip in addrs:
            blocked = self._range_denial(host, ip, port)
            if blocked is not None:
                return blocked
        # Names were settled above (_name_denial): each layer now judges the addresses and rules.
        verdict: Decision | None = None
        for layer in self.layers:
            d = layer.decide(host, port, addrs, by_name)
            if not d.allowed:
                return d
            verdict = verdict or d
        assert verdict is not None
        return verdict

    def _range_denial(self, host: str, ip: IPAddress, port: int) -> Decision | None:
        why = self.fence.reason(ip)
        if why is not None:
            rule = "node-address" if why.startswith("an address of the node") else "blocked-range"
            return Decision(False, rule, f"{host} is {ip}, {why}: a blocked range no policy opens")
        if is_private(ip) or (self.fence.allow_loopback and _LOOPBACK.find(ip) is not None):
            if self._ceiling.find(ip) is None:
                return Decision(False, "blocked-range",
                                f"{host} is {ip}, a private address outside the operator's ceiling "
                                f"({ceiling_text(self.ceiling)}): in a blocked range")
            if not any(layer.opens(ip, port) for layer in self.layers):
                return Decision(False, "blocked-range",
                                f"{host} is {ip}, a private address (a blocked range): only an allow CIDR "
                                "opens one")
        return None

    def permitted_somewhere(self, name: str, ip: IPAddress) -> bool:
        """Whether a connection to ``ip`` (named ``name``) could be allowed on at least one port:
        the ports the rules name, and 0 for "any other"."""
        ports = {0} | {r.port for p in self.layers for r in (*p.allow, *p.deny) if r.port}
        return any(self.decide(name, port, [ip]).allowed for port in sorted(ports))


# ---- what an entry may open (the API's check) ------------------------------------------------------


def _subtract(nets: list[IPNetwork], holes: Iterable[IPNetwork]) -> list[IPNetwork]:
    out = nets
    for hole in holes:
        nxt: list[IPNetwork] = []
        for n in out:
            if n.version != hole.version or not n.overlaps(hole):
                nxt.append(n)
            elif n.subnet_of(hole):  # type: ignore[arg-type]
                continue
            else:
                nxt.extend(n.address_exclude(hole))  # type: ignore[arg-type]
        out = nxt
    return out


def reach_report(doc: Mapping[str, Any] | None, ceiling: Sequence[IPNetwork],
                 sandbox_networks: Sequence[IPNetwork]) -> list[tuple[str, str]]:
    """What each ``allow`` CIDR of ``doc`` may open: ``(rule, verdict)`` for every one that is not
    plainly public. ``never``: nothing but never-reachable ranges; ``outside``: only private
    ranges, some outside ``ceiling``; ``clipped``: public addresses too, and parts that stay shut."""
    out: list[tuple[str, str]] = []
    never = [n for n, _ in NEVER] + list(sandbox_networks)
    for text in validate(doc).get("allow", []):
        net = parse_rule(text).network
        if net is None:
            continue
        rest = _subtract([net], never)
        public = _subtract(rest, PRIVATE)
        outside = _subtract(_subtract(rest, public), ceiling)  # private, and not in the ceiling
        if not rest:
            out.append((text, "never"))
        elif not public and outside:
            out.append((text, "outside"))
        elif outside or rest != [net]:
            out.append((text, "clipped"))
    return out


def check_reach(doc: Mapping[str, Any] | None, ceiling: Sequence[IPNetwork],
                sandbox_networks: Sequence[IPNetwork]) -> list[str]:
    """Refuse an ``allow`` CIDR that opens nothing but what it may not (never-reachable ranges, or
    private ranges outside ``ceiling``): :class:`InvalidRequest` naming the entry and the ceiling.

    A CIDR that also covers public addresses (``0.0.0.0/0``: "the internet") is accepted, and the
    part it may not open stays shut: the notes returned say so, for the policy's view. The gateway
    enforces the same limits again, whatever was accepted here."""
    notes = []
    for text, verdict in reach_report(doc, ceiling, sandbox_networks):
        if verdict != "clipped":
            raise InvalidRequest(reach_note(text, verdict, ceiling), rule=text, ceiling=[str(c) for c in ceiling])
        notes.append(reach_note(text, verdict, ceiling))
    return notes


def reach_note(rule: str, verdict: str, ceiling: Sequence[IPNetwork]) -> str:
    if verdict == "never":
        return (f"egress rule {rule!r} opens nothing a policy may open: loopback, link-local and metadata "
                "addresses, the node and its sandbox networks are never reachable")
    if verdict == "outside":
        return (f"egress rule {rule!r} reaches private addresses outside this tenant's ceiling "
                f"({ceiling_text(ceiling)}): only the operator opens private ranges")
    return (f"{rule}: loopback, link-local/metadata, the node's own addresses and sandbox networks stay "
            f"closed; private ranges only inside the ceiling ({ceiling_text(ceiling)})")
