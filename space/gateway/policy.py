"""Egress policy: what a sandbox may connect to. Pure logic, shared by the API (validation) and the
node's gateway (decisions).

A policy document is ``{"allow": [...], "deny": [...], "default": "allow" | "deny"}``. An entry is a
host pattern (``pypi.org``, ``*.example.com``, ``*``) or a CIDR (``203.0.113.0/24``, ``2001:db8::/32``),
either with an optional port (``api.example.com:443``, ``10.1.0.0/16:5432``).

A decision, for a host name, a port and the addresses the name resolved to:

1. a matching ``deny`` entry denies;
2. an address in a blocked range (private, loopback, link-local and cloud metadata, CGNAT,
   multicast, reserved, IPv6 unique-local...) is denied unless a ``allow`` **CIDR** covers it: a
   host-name allow never unlocks one, so a name that resolves (or is rebound) to the metadata
   address stays blocked;
3. a matching ``allow`` entry allows;
4. otherwise ``default``. Left out, it is ``deny`` when the policy lists anything to allow (an
   allowlist) and ``allow`` otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from space.errors import InvalidRequest

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_ENTRIES = 256

#: Ranges no sandbox reaches unless a CIDR in its policy says so: private, loopback, link-local
#: (metadata), CGNAT, benchmarking, multicast and reserved. Not the documentation ranges: nothing
#: private lives there, and some networks route them (this one's registry proxy is 203.0.113.80).
BLOCKED_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
        "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
        "255.255.255.255/32",
        "::/128", "::1/128", "::ffff:0:0/96", "64:ff9b::/96", "100::/64",
        "fc00::/7", "fe80::/10", "ff00::/8",
    )
)

_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_HOST_RE = re.compile(rf"^(\*|(\*\.)?{_LABEL}(\.{_LABEL})*)$")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One entry: a host pattern or a network, and the port it is limited to (None: any)."""

    text: str
    host: str | None = None
    network: IPNetwork | None = None
    port: int | None = None

    def matches_port(self, port: int) -> bool:
        return self.port is None or self.port == port

    def matches_host(self, host: str, port: int) -> bool:
        return self.host is not None and self.matches_port(port) and match_host(self.host, host)

    def matches_ip(self, ip: IPAddress, port: int) -> bool:
        return (self.network is not None and self.matches_port(port)
                and ip.version == self.network.version and ip in self.network)


@dataclasses.dataclass(frozen=True)
class Decision:
    allowed: bool
    #: The entry that decided, or ``blocked-range``/``default``.
    rule: str
    reason: str


def match_host(pattern: str, host: str) -> bool:
    """``*`` matches every name; ``*.example.com`` matches its subdomains (not itself); else exact."""
    host = host.lower().rstrip(".")
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


def validate_host_pattern(pattern: str) -> str:
    """The pattern, lower-cased, or :class:`InvalidRequest` saying what is wrong with it."""
    p = pattern.strip().lower().rstrip(".")
    if not p or len(p) > 253 or not _HOST_RE.match(p):
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
        return Rule(text=text, network=ipaddress.ip_network(body, strict=False), port=port)
    except ValueError:
        pass
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
    """A normalized policy document, or :class:`InvalidRequest` naming the bad entry."""
    if not doc:
        return {}
    unknown = set(doc) - {"allow", "deny", "default"}
    if unknown:
        raise InvalidRequest(f"unknown egress policy field(s): {', '.join(sorted(unknown))}")
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


def effective(*docs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The first non-empty document: the sandbox's own, else its tenant's default, else ``{}``."""
    for doc in docs:
        if doc:
            return dict(doc)
    return {}


@dataclasses.dataclass(frozen=True)
class Policy:
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

    def check_name(self, host: str, port: int) -> Decision | None:
        """The decision a name alone settles (a deny, or an allow/default-deny before resolving).

        Used for DNS: a denied name gets no answer at all. None: it depends on the addresses.
        Port 0 stands for "some port not named in any rule" (what DNS asks): a deny limited to a
        port then does not deny the name, which stays usable on the other ports.
        """
        for rule in self.deny:
            if rule.host is not None and rule.matches_port(port) and match_host(rule.host, host):
                return Decision(False, rule.text, f"{host} matches deny rule {rule.text!r}")
        if not self.default_allow and not any(
            rule.host is not None and match_host(rule.host, host) for rule in self.allow
        ) and not any(rule.network is not None for rule in self.allow):
            return Decision(False, "default", f"{host} is not on the allow list")
        return None

    def decide(self, host: str, port: int, ips: Iterable[IPAddress]) -> Decision:
        addrs = list(ips)
        for ip in addrs:
            if is_node_address(ip):
                return Decision(False, "node-address", f"{host} resolves to {ip}, an address of the node itself")
        early = self.check_name(host, port)
        if early is not None and not early.allowed:
            return early
        for ip in addrs:
            for rule in self.deny:
                if rule.matches_ip(ip, port):
                    return Decision(False, rule.text, f"{ip} matches deny rule {rule.text!r}")
        for ip in addrs:
            if is_blocked(ip) and not any(rule.matches_ip(ip, port) for rule in self.allow):
                return Decision(False, "blocked-range",
                                f"{host} resolves to {ip}, in a blocked range (private, loopback, "
                                "link-local or metadata)")
        for rule in self.allow:
            if rule.matches_host(host, port):
                return Decision(True, rule.text, f"{host}:{port} matches allow rule {rule.text!r}")
        if addrs and all(any(rule.matches_ip(ip, port) for rule in self.allow) for ip in addrs):
            return Decision(True, "cidr", f"{host} resolves into an allowed network")
        if self.default_allow:
            return Decision(True, "default", "allowed by default")
        return Decision(False, "default", f"{host}:{port} is not on the allow list")


def is_blocked(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return is_blocked(ip.ipv4_mapped)
    return any(ip.version == net.version and ip in net for net in BLOCKED_NETWORKS)


#: The node's own addresses (a public one included) and loopback: never a destination, whatever a
#: tenant's policy says (an allowed CIDR would otherwise open the node's own services).
_node_addresses: frozenset[IPAddress] = frozenset()
_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_loopback_allowed = False


def set_node_addresses(addrs: Iterable[IPAddress], *, allow_loopback: bool | None = None) -> None:
    """``allow_loopback``: TEST ONLY, for gateway tests whose upstreams live on 127.0.0.x."""
    global _node_addresses, _loopback_allowed
    if allow_loopback is not None:
        _loopback_allowed = allow_loopback
    _node_addresses = frozenset(a for a in addrs if not (_loopback_allowed and a.is_loopback))


def is_node_address(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not _loopback_allowed and any(ip.version == n.version and ip in n for n in _LOOPBACK):
        return True
    return ip in _node_addresses


def read_node_addresses(fib_trie: str = "/proc/net/fib_trie") -> set[IPAddress]:
    """The host's local IPv4 addresses (the ``/32 host LOCAL`` entries of the FIB)."""
    found: set[IPAddress] = set()
    last: str | None = None
    with open(fib_trie) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "|--":
                last = parts[1]
            elif last and "/32 host LOCAL" in line:
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(last))
    return found
