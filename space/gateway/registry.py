"""Who is behind a source address: the sandbox, its tenant, its egress policy and its secrets.

The node replaces a whole entry with ``put``; every decision looks the entry up afresh, so a change
applies to the next request or connection. Rate-limit buckets outlive a ``put`` that keeps the
secret and its limit, so re-sending the same configuration does not refill them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import re
import time
from collections.abc import Mapping
from typing import Any

from space import secret_hosts
from space.egress_policy import (
    Egress,
    Fence,
    IPNetwork,
    match_host,
    narrow,
    parse_ceiling,
    validate,
    validate_host_pattern,
)
from space.errors import InvalidRequest

_HEADER_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")
#: A bare value shorter than this is not redacted on its own: it would mangle unrelated text.
MIN_BARE = 8


@dataclasses.dataclass
class TokenBucket:
    """``rate`` requests per minute, bursting up to ``rate``."""

    rate: int
    tokens: float
    stamp: float

    @classmethod
    def full(cls, rate: int) -> TokenBucket:
        return cls(rate=rate, tokens=float(rate), stamp=time.monotonic())

    def take(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self.tokens = min(float(self.rate), self.tokens + (now - self.stamp) * self.rate / 60.0)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclasses.dataclass(frozen=True)
class Secret:
    name: str
    secret_id: str
    hosts: tuple[str, ...]
    header: str
    value: str
    expires_at: dt.datetime | None = None
    rate_limit: int | None = None

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Secret:
        if not isinstance(doc, Mapping):
            raise InvalidRequest("each secret must be an object")
        missing = [k for k in ("name", "secret_id", "hosts", "header", "value") if not doc.get(k)]
        if missing:
            raise InvalidRequest(f"secret is missing {', '.join(missing)}")
        hosts = doc["hosts"]
        if isinstance(hosts, str) or not isinstance(hosts, list):
            raise InvalidRequest("secret 'hosts' must be a list of host patterns")
        header = str(doc["header"])
        if not _HEADER_RE.match(header):
            raise InvalidRequest(f"invalid header name {header!r}")
        value = str(doc["value"])
        if "\r" in value or "\n" in value:
            raise InvalidRequest("a secret value cannot contain line breaks")
        rate = doc.get("rate_limit")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int) or rate < 1):
            raise InvalidRequest("secret 'rate_limit' must be a positive integer (per minute) or null")
        patterns = tuple(validate_host_pattern(str(h)) for h in hosts)
        secret_hosts.check(patterns)  # the control plane refuses them already: never inject one
        return cls(name=str(doc["name"]), secret_id=str(doc["secret_id"]),
                   hosts=patterns, header=header, value=value,
                   expires_at=_parse_time(doc.get("expires_at")), rate_limit=rate)

    def matches(self, host: str) -> bool:
        return any(match_host(p, host) for p in self.hosts)

    def expired(self, now: dt.datetime | None = None) -> bool:
        return self.expires_at is not None and (now or dt.datetime.now(dt.UTC)) >= self.expires_at

    def needles(self) -> list[bytes]:
        """What redaction looks for: the header value, and the token after an auth scheme."""
        out = [self.value.encode()]
        scheme, _, bare = self.value.partition(" ")
        if bare and len(bare) >= MIN_BARE and scheme.isalpha():
            out.append(bare.encode())
        return out

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "secret_id": self.secret_id, "hosts": list(self.hosts),
                "header": self.header, "expires_at": self.expires_at.isoformat() if self.expires_at else None,
                "rate_limit": self.rate_limit}


def _parse_time(raw: Any) -> dt.datetime | None:
    if raw is None:
        return None
    try:
        t = dt.datetime.fromisoformat(str(raw).replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"invalid expires_at {raw!r}: use ISO 8601") from None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


@dataclasses.dataclass(frozen=True)
class Entry:
    ip: str
    sandbox: str
    tenant: str
    policy_doc: dict[str, Any]
    #: The tenant's default policy (a layer under the sandbox's own: both must allow).
    tenant_doc: dict[str, Any]
    #: The tenant's ceiling as the control plane sent it (None: the node's own).
    ceiling: tuple[IPNetwork, ...] | None
    egress: Egress
    secrets: tuple[Secret, ...]

    def secrets_for(self, host: str) -> list[Secret]:
        return [s for s in self.secrets if s.matches(host)]

    def public(self) -> dict[str, Any]:
        return {"ip": self.ip, "sandbox": self.sandbox, "tenant": self.tenant, "policy": self.policy_doc,
                "tenant_policy": self.tenant_doc,
                "ceiling": [str(n) for n in self.egress.ceiling], "secrets": [s.public() for s in self.secrets]}


def normalize_ip(raw: str) -> str:
    """The canonical text of an address (an IPv4-mapped IPv6 peer becomes its IPv4 form)."""
    ip = ipaddress.ip_address(raw.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


class Registry:
    """``fence``: what no sandbox of this node reaches; ``ceiling``: the private ranges this node
    lets any policy open (a tenant's ceiling, sent with its sandboxes, only narrows it)."""

    def __init__(self, fence: Fence | None = None, ceiling: tuple[IPNetwork, ...] = ()) -> None:
        self.fence = fence or Fence()
        self.ceiling = ceiling
        self._entries: dict[str, Entry] = {}
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def put(self, doc: Mapping[str, Any]) -> Entry:
        """Validate and install a whole entry (``InvalidRequest`` leaves the old one in place)."""
        try:
            ip = normalize_ip(str(doc.get("ip", "")))
        except ValueError:
            raise InvalidRequest(f"invalid ip {doc.get('ip')!r}") from None
        sandbox, tenant = doc.get("sandbox"), doc.get("tenant")
        if not sandbox or not isinstance(sandbox, str) or not isinstance(tenant, str | None):
            raise InvalidRequest("'sandbox' (and 'tenant', if given) must be strings")
        raw_policy, raw_tenant = doc.get("policy") or {}, doc.get("tenant_policy") or {}
        if not isinstance(raw_policy, Mapping) or not isinstance(raw_tenant, Mapping):
            raise InvalidRequest("'policy' and 'tenant_policy' must be objects")
        raw_ceiling = doc.get("ceiling")
        if raw_ceiling is not None and (isinstance(raw_ceiling, str) or not isinstance(raw_ceiling, list)):
            raise InvalidRequest("'ceiling' must be a list of CIDRs or null")
        tenant_ceiling = parse_ceiling(raw_ceiling) if raw_ceiling is not None else None
        # Never wider than this node's own ceiling, whatever the control plane sent.
        ceiling = self.ceiling if tenant_ceiling is None else narrow(tenant_ceiling, self.ceiling)
        policy_doc, tenant_doc = validate(raw_policy), validate(raw_tenant)
        egress = Egress.build((tenant_doc, policy_doc), ceiling, self.fence)
        raw_secrets = doc.get("secrets") or []
        if not isinstance(raw_secrets, list):
            raise InvalidRequest("'secrets' must be a list")
        secrets = tuple(Secret.from_doc(s) for s in raw_secrets)
        entry = Entry(ip=ip, sandbox=sandbox, tenant=tenant or "", policy_doc=policy_doc, tenant_doc=tenant_doc,
                      ceiling=tenant_ceiling, egress=egress, secrets=secrets)
        self._entries[ip] = entry
        keep = {(ip, s.secret_id) for s in secrets if s.rate_limit}
        for key, bucket in list(self._buckets.items()):
            if key[0] == ip and (key not in keep or bucket.rate != self._rate(entry, key[1])):
                del self._buckets[key]
        return entry

    @staticmethod
    def _rate(entry: Entry, secret_id: str) -> int | None:
        return next((s.rate_limit for s in entry.secrets if s.secret_id == secret_id), None)

    def delete(self, ip: str) -> Entry | None:
        ip = normalize_ip(ip)
        for key in [k for k in self._buckets if k[0] == ip]:
            del self._buckets[key]
        return self._entries.pop(ip, None)

    def get(self, ip: str) -> Entry | None:
        hit = self._entries.get(ip)
        if hit is not None:
            return hit
        try:
            return self._entries.get(normalize_ip(ip))
        except ValueError:
            return None

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def take(self, ip: str, secret: Secret) -> bool:
        """One use of ``secret`` by the sandbox at ``ip``: False when over its rate limit."""
        if not secret.rate_limit:
            return True
        key = (ip, secret.secret_id)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket.full(secret.rate_limit)
        return bucket.take()
