"""Name resolution for the gateway: the answers its DNS server gives and the addresses it connects to.

The gateway connects only to an address it resolved and checked itself, so a name re-bound between
the sandbox's lookup and its connection cannot smuggle it to a blocked address. A hosts file
(tests only) replaces resolution entirely: a name it does not list does not resolve at all.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.rdatatype

from space.egress_policy import IPAddress

MAX_TTL = 30.0  # seconds an upstream answer is reused
NEGATIVE_TTL = 5.0
CACHE_SIZE = 4096


def load_hosts(path: str | Path) -> dict[str, list[IPAddress]]:
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, Mapping):
        raise ValueError("hosts file: expected a JSON object {name: ip or [ips]}")
    out: dict[str, list[IPAddress]] = {}
    for name, ips in raw.items():
        vals: list[Any] = ips if isinstance(ips, list) else [ips]
        out[str(name).lower().rstrip(".")] = [ipaddress.ip_address(str(v)) for v in vals]
    return out


def split_upstream(raw: str) -> tuple[str, int]:
    """``IP``, ``IP:PORT`` or ``[IPv6]:PORT`` → (address, port); port 53 when none is given."""
    text = raw.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or "53"
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, "53"
    ipaddress.ip_address(host)  # an address, never a name to resolve with itself
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid upstream DNS port in {raw!r}")
    return host, int(port)


class Resolver:
    def __init__(self, hosts: dict[str, list[IPAddress]] | None = None, upstream: str | None = None,
                 timeout: float = 3.0) -> None:
        self.hosts = hosts
        self._cache: dict[tuple[str, int], tuple[float, list[IPAddress]]] = {}
        self._dns: dns.asyncresolver.Resolver | None = None
        if hosts is None:
            self._dns = dns.asyncresolver.Resolver(configure=upstream is None)
            if upstream is not None:
                host, port = split_upstream(upstream)
                self._dns.nameservers = [host]
                self._dns.port = port
            self._dns.lifetime = timeout

    async def resolve(self, name: str, version: int = 4) -> list[IPAddress]:
        """The addresses of ``name`` (IPv4 or IPv6); ``[]`` when it does not resolve."""
        host = name.lower().rstrip(".")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            pass
        else:
            return [ip] if ip.version == version else []
        if self.hosts is not None:
            return [ip for ip in self.hosts.get(host, []) if ip.version == version]
        key = (host, version)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        ips, ttl = await self._query(host, version)
        if len(self._cache) >= CACHE_SIZE:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
        self._cache[key] = (now + ttl, ips)
        return ips

    async def _query(self, host: str, version: int) -> tuple[list[IPAddress], float]:
        assert self._dns is not None
        rdtype = dns.rdatatype.A if version == 4 else dns.rdatatype.AAAA
        try:
            answer = await self._dns.resolve(host, rdtype, search=False)
        except (dns.exception.DNSException, ValueError):
            return [], NEGATIVE_TTL
        ips = [ipaddress.ip_address(r.address) for r in answer]
        ttl = min(float(answer.rrset.ttl) if answer.rrset is not None else 0.0, MAX_TTL)
        return ips, ttl
