"""The credential manager: set, list and delete secrets, check bindings, resolve them for a sandbox.

Values never leave this module except inside a :class:`ResolvedSecret` handed to the egress
gateway of the node a sandbox runs on; listings, errors, logs and audit records carry names,
scopes and injection rules only.

Scopes, most specific first: ``sandbox:<id>``, ``project:<name>``, ``tenant``. A sandbox bound to a
name gets the secret of that name in the most specific scope it can see. If that one has expired
the name resolves to nothing: a broader secret of the same name does not silently take its place
(the gateway, which enforces expiry at injection time, behaves the same way).
"""

from __future__ import annotations

import base64
import builtins
import dataclasses
import datetime as dt
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import structlog

from space import secret_hosts
from space.api.auth import Principal
from space.credentials.backends import Backends, BuiltinBackend
from space.egress_policy import match_host, validate_host_pattern
from space.errors import Conflict, Forbidden, InvalidRequest, NotFound, PayloadTooLarge, SpaceError
from space.store import Sandbox, Store
from space.store.models import AuditRecord, Secret, utcnow

log = structlog.get_logger(__name__)

AuditSink = Callable[[Sequence[AuditRecord]], Awaitable[None]]

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")
#: RFC 9110 token: what a header name may be made of.
HEADER_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,128}$")
PROJECT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SANDBOX_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
MAX_VALUE_BYTES = 16 * 1024
MAX_HOSTS = 64
MAX_FORMAT = 256
MAX_RATE_LIMIT = 1_000_000
MAX_TTL = 10 * 365 * 86400
#: Headers that frame or route the request (or talk to the proxy itself): injecting them would
#: let a secret smuggle requests or break the connection.
FORBIDDEN_HEADERS = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te",
    "trailer", "proxy-connection", "proxy-authorization", "proxy-authenticate",
})
FORMAT_ALIASES = {"bearer": "Bearer {}"}
BASIC = "basic"
TENANT = "tenant"


@dataclasses.dataclass(frozen=True)
class ResolvedSecret:
    """One secret ready for injection: ``header: value`` on requests to ``hosts``."""

    name: str
    scope: str
    secret_id: str
    hosts: tuple[str, ...]
    header: str
    #: The final header value (``Bearer abc``), not the raw secret.
    value: str
    expires_at: str | None
    #: Injections per minute per node; None is unlimited.
    rate_limit: int | None

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "scope": self.scope, "secret_id": self.secret_id,
                "hosts": list(self.hosts), "header": self.header, "value": self.value,
                "expires_at": self.expires_at, "rate_limit": self.rate_limit}

    def __repr__(self) -> str:  # keep the value out of logs and tracebacks
        return (f"ResolvedSecret(name={self.name!r}, scope={self.scope!r}, secret_id={self.secret_id!r}, "
                f"hosts={self.hosts!r}, header={self.header!r}, value=<redacted>)")


def view(row: Secret, now: dt.datetime | None = None) -> dict[str, Any]:
    """The wire form of a secret: everything but its value."""
    now = now or utcnow()
    return {
        "id": row.id,
        "name": row.name,
        "scope": row.scope,
        "backend": row.backend,
        "hosts": list(row.hosts or []),
        "header": row.header,
        "format": row.format,
        "expires_at": row.expires_at.isoformat() if row.expires_at else None,
        "expired": row.expires_at is not None and row.expires_at <= now,
        "rate_limit": row.rate_limit,
        "created_by": row.created_by,
        "created_at": row.created_at.isoformat() if row.created_at else None,
        "updated_at": row.updated_at.isoformat() if row.updated_at else None,
    }


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidRequest(f"invalid secret name {name!r}: letters, digits, '_', '.', '-' (at most 128), "
                             "starting with a letter or '_'", field="name")
    return name


def parse_scope(scope: str | None) -> tuple[str, str]:
    """``(kind, arg)`` of a scope string: ``("tenant", "")``, ``("project", p)``, ``("sandbox", id)``."""
    scope = TENANT if scope in (None, "") else scope
    assert scope is not None
    kind, sep, arg = scope.partition(":")
    if kind == TENANT and not sep:
        return TENANT, ""
    if kind == "project" and PROJECT_RE.match(arg):
        return "project", arg
    if kind == "sandbox" and SANDBOX_ID_RE.match(arg):
        return "sandbox", arg
    raise InvalidRequest(f"invalid scope {scope!r}: use 'tenant', 'project:<name>' or 'sandbox:<id>'",
                         field="scope")


def normalize_scope(scope: str | None) -> str:
    kind, arg = parse_scope(scope)
    return kind if kind == TENANT else f"{kind}:{arg}"


def scopes_for(project: str, sandbox_id: str | None) -> list[str]:
    """The scopes a sandbox sees, most specific first."""
    out = [f"sandbox:{sandbox_id}"] if sandbox_id else []
    if project:
        out.append(f"project:{project}")
    out.append(TENANT)
    return out


def _check_header_text(text: str, what: str) -> None:
    # CR/LF would let a value start a new header or request; no control character belongs in one.
    if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in text):
        raise InvalidRequest(f"the {what} contains control characters (CR, LF, NUL...), which cannot go "
                             "into an HTTP header", field=what)


def validate_format(fmt: str | None) -> str:
    fmt = "Bearer {}" if fmt is None else fmt
    low = fmt.strip().lower()
    if low == BASIC:
        return BASIC
    if low in FORMAT_ALIASES:
        return FORMAT_ALIASES[low]
    if len(fmt) > MAX_FORMAT or fmt.count("{}") != 1:
        raise InvalidRequest(f"invalid format {fmt!r}: it must contain '{{}}' (the value) exactly once, or be "
                             "'bearer' or 'basic'", field="format")
    _check_header_text(fmt, "format")
    return fmt


def validate_header(header: str | None) -> str:
    header = "Authorization" if header is None else header
    if not HEADER_RE.match(header):
        raise InvalidRequest(f"invalid header name {header!r}: letters, digits and !#$%&'*+-.^_`|~ only",
                             field="header")
    if header.lower() in FORBIDDEN_HEADERS:
        raise InvalidRequest(f"header {header!r} cannot carry a secret (it frames or routes the request)",
                             field="header")
    return header


def validate_hosts(hosts: Iterable[str] | None) -> list[str]:
    if isinstance(hosts, str):
        hosts = [hosts]
    try:
        found = list(dict.fromkeys(validate_host_pattern(str(h)) for h in (hosts or [])))
    except InvalidRequest as e:
        raise InvalidRequest(e.message, field="hosts", **e.details) from None
    if not found:
        raise InvalidRequest("a secret needs at least one host pattern it is injected for", field="hosts")
    if len(found) > MAX_HOSTS:
        raise InvalidRequest(f"a secret may name at most {MAX_HOSTS} host patterns", field="hosts")
    secret_hosts.check(found)  # never '*' nor '*.<public suffix>', whoever asks (docs/notes/secrets.md)
    return found


def validate_value(value: str, fmt: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequest("the secret value must be a non-empty string", field="value")
    size = len(value.encode())
    if size > MAX_VALUE_BYTES:
        raise PayloadTooLarge(f"the secret value is {size} bytes, more than {MAX_VALUE_BYTES}", field="value",
                              max_bytes=MAX_VALUE_BYTES)
    _check_header_text(value, "value")
    if fmt == BASIC and ":" not in value:
        raise InvalidRequest("format 'basic' needs a 'user:password' value", field="value")


def header_value(fmt: str, value: str) -> str:
    if fmt == BASIC:
        return "Basic " + base64.b64encode(value.encode()).decode()
    return fmt.replace("{}", value, 1)


def expiry(expires_at: dt.datetime | None, ttl_seconds: int | None, now: dt.datetime) -> dt.datetime | None:
    if expires_at is not None and ttl_seconds is not None:
        raise InvalidRequest("give expires_at or ttl_seconds, not both", field="ttl_seconds")
    if ttl_seconds is not None:
        if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not 0 < ttl_seconds <= MAX_TTL:
            raise InvalidRequest(f"ttl_seconds must be an integer from 1 to {MAX_TTL}", field="ttl_seconds")
        return now + dt.timedelta(seconds=ttl_seconds)
    if expires_at is not None:
        if expires_at.tzinfo is None:
            raise InvalidRequest("expires_at needs a time zone (e.g. '2030-01-01T00:00:00Z')", field="expires_at")
        if expires_at <= now:
            raise InvalidRequest("expires_at is in the past", field="expires_at")
        return expires_at.astimezone(dt.UTC)
    return None


def validate_rate_limit(rate_limit: int | None) -> int | None:
    if rate_limit is None:
        return None
    if isinstance(rate_limit, bool) or not isinstance(rate_limit, int) or not 1 <= rate_limit <= MAX_RATE_LIMIT:
        raise InvalidRequest(f"rate_limit (injections per minute) must be from 1 to {MAX_RATE_LIMIT}",
                             field="rate_limit")
    return rate_limit


class CredentialManager:
    """Secrets of every tenant, behind the configured vault backends, with an audit trail."""

    def __init__(self, store: Store, backends: Backends, audit: AuditSink | None = None) -> None:
        self.store = store
        self.backends = backends
        self._audit_sink: AuditSink = audit if audit is not None else store.record_audit

    async def aclose(self) -> None:
        await self.backends.aclose()

    # ---- management (API, CLI) ------------------------------------------------------------------

    async def set(
        self,
        who: Principal,
        name: str,
        value: str,
        *,
        hosts: Iterable[str],
        header: str | None = None,
        format: str | None = None,
        scope: str | None = None,
        expires_at: dt.datetime | None = None,
        ttl_seconds: int | None = None,
        rate_limit: int | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """Create or replace the secret ``name`` in ``scope``; returns its view and whether it is new."""
        details: dict[str, Any] = {"name": name, "scope": scope or TENANT}
        try:
            who.require_write()
            validate_name(name)
            scope = normalize_scope(scope)
            details["scope"] = scope
            fmt = validate_format(format)
            validate_value(value, fmt)
            row = Secret(tenant=who.tenant, scope=scope, name=name, backend=self.backends.default,
                         hosts=validate_hosts(hosts), header=validate_header(header), format=fmt,
                         expires_at=expiry(expires_at, ttl_seconds, utcnow()),
                         rate_limit=validate_rate_limit(rate_limit), created_by=who.key_id)
            await self._check_scope_target(who.tenant, scope)
            previous = await self._find(who.tenant, scope, name)
            await self.backends.get(row.backend).put(row, value)
            stored, created = await self.store.put_secret(row)
            if previous is not None and previous.backend != stored.backend:
                await self._forget(previous)
        except SpaceError as e:
            await self._record(who, "secret.set", name, e.code, e.status, details)
            raise
        details.update(secret_id=stored.id, created=created, backend=stored.backend, hosts=stored.hosts,
                       header=stored.header, expires_at=view(stored)["expires_at"], rate_limit=stored.rate_limit)
        await self._record(who, "secret.set", name, "ok", 201 if created else 200, details)
        log.info("secret.set", tenant=who.tenant, name=name, scope=scope, created=created)
        return view(stored), created

    async def list(self, who: Principal, scope: str | None = None) -> list[dict[str, Any]]:
        """The tenant's secrets (in one scope if given), without values."""
        scopes = None if scope in (None, "") else [normalize_scope(scope)]
        rows = await self.store.list_secrets(who.tenant, scopes=scopes)
        await self._record(who, "secret.list", "", "ok", 200, {"scope": scope or None, "count": len(rows)})
        now = utcnow()
        return [view(r, now) for r in rows]

    async def delete(self, who: Principal, name: str, scope: str | None = None) -> None:
        details: dict[str, Any] = {"name": name, "scope": scope or TENANT}
        try:
            who.require_write()
            validate_name(name)
            scope = normalize_scope(scope)
            details["scope"] = scope
            row = await self.store.delete_secret(who.tenant, scope, name)
        except SpaceError as e:
            await self._record(who, "secret.delete", name, e.code, e.status, details)
            raise
        details["secret_id"] = row.id
        await self._record(who, "secret.delete", name, "ok", 204, details)
        await self._forget(row)
        log.info("secret.deleted", tenant=who.tenant, name=name, scope=scope)

    async def check_bindable(
        self, who: Principal, tenant: str, project: str, sandbox_id: str | None, names: Iterable[str]
    ) -> builtins.list[str]:
        """May ``who`` bind these secrets to a sandbox of ``tenant``/``project`` (``sandbox_id`` when it
        exists already)? Returns the names, de-duplicated in order; raises Forbidden (a read-only key,
        another tenant) or NotFound naming the first secret no visible scope holds."""
        who.require_write()
        if who.tenant != tenant:
            raise Forbidden("secrets can only be bound to sandboxes of the key's own tenant")
        wanted = list(dict.fromkeys(validate_name(n) for n in names))
        if not wanted:
            return []
        scopes = scopes_for(project, sandbox_id)
        held = {r.name for r in await self.store.list_secrets(tenant, scopes=scopes, names=wanted)}
        for n in wanted:
            if n not in held:
                raise NotFound(f"secret {n} not found in any scope visible to the sandbox "
                               f"({', '.join(scopes)})", secret=n, scopes=scopes)
        return wanted

    # ---- resolution (placement) -----------------------------------------------------------------

    async def resolve(self, sandbox: Sandbox, actor: str = "system") -> builtins.list[ResolvedSecret]:
        """The secrets bound to ``sandbox``, each from the most specific scope that holds it, as the
        gateway will inject them. Expired and missing ones resolve to nothing; every name is audited."""
        names = list(dict.fromkeys(sandbox.secrets or []))
        if not names:
            return []
        scopes = scopes_for(sandbox.project or "", sandbox.id)
        rank = {s: i for i, s in enumerate(scopes)}
        best: dict[str, Secret] = {}
        for r in await self.store.list_secrets(sandbox.tenant, scopes=scopes, names=names):
            if r.name not in best or rank[r.scope] < rank[best[r.name].scope]:
                best[r.name] = r
        now = utcnow()
        out: builtins.list[ResolvedSecret] = []
        records: builtins.list[AuditRecord] = []

        def audit(action: str, result: str, **details: Any) -> None:
            records.append(AuditRecord(tenant=sandbox.tenant, actor=actor, action=action, target=sandbox.id,
                                       result=result, details=details))

        try:
            for n in names:
                row = best.get(n)
                if row is None:
                    audit("secret.resolve", "not_found", name=n, scopes=scopes)
                    continue
                broad = [h for h in row.hosts or () if secret_hosts.too_broad(h) is not None]
                hosts = tuple(h for h in row.hosts or () if h not in broad)
                if broad:
                    # Written before patterns were checked (or into the database directly): the
                    # broad ones never reach a gateway.
                    audit("secret.refused", "denied", name=n, scope=row.scope, secret_id=row.id, hosts=broad,
                          reason="host pattern too broad")
                    if not hosts:
                        continue
                if row.expires_at is not None and row.expires_at <= now:
                    audit("secret.expired", "denied", name=n, scope=row.scope, secret_id=row.id,
                          expires_at=row.expires_at.isoformat())
                    continue
                try:
                    raw = await self.backends.get(row.backend).get(row)
                except SpaceError as e:
                    audit("secret.resolve", e.code, name=n, scope=row.scope, secret_id=row.id)
                    raise
                out.append(ResolvedSecret(
                    name=n, scope=row.scope, secret_id=row.id, hosts=hosts, header=row.header,
                    value=header_value(row.format, raw),
                    expires_at=row.expires_at.isoformat() if row.expires_at else None, rate_limit=row.rate_limit))
                audit("secret.resolve", "ok", name=n, scope=row.scope, secret_id=row.id)
        finally:
            await self._audit_sink(records)
        return out

    # ---- container registries -------------------------------------------------------------------

    async def registry_login(self, tenant: str, registry: str, actor: str = "system",
                             target: str = "") -> tuple[str, str] | None:
        """The username and password template builds pull from ``registry`` (``host[:port]``)
        with: the ``tenant``'s (the operator's: templates are theirs) tenant-scope secret of format
        ``basic`` whose hosts match the registry's host, the most specific match if several (an
        exact host over ``*.domain``); None when there is none (an anonymous pull). Audited."""
        host = registry.rsplit(":", 1)[0] if registry.count(":") == 1 else registry
        candidates: builtins.list[tuple[int, Secret]] = []
        for row in await self.store.list_secrets(tenant, scopes=[TENANT]):
            if row.format != BASIC:
                continue
            exact = [h for h in row.hosts or () if h == host]
            wild = [h for h in row.hosts or () if h.startswith("*.") and match_host(h, host)]
            if exact or wild:
                candidates.append((0 if exact else 1, row))
        if not candidates:
            return None
        best = min(rank for rank, _ in candidates)
        chosen = [row for rank, row in candidates if rank == best]
        if len(chosen) > 1:
            raise Conflict(f"secrets {', '.join(sorted(r.name for r in chosen))} all name registry host {host}: "
                           "keep one", registry=registry)
        row = chosen[0]
        now = utcnow()
        record = AuditRecord(tenant=tenant, actor=actor, action="secret.resolve", target=target or registry,
                             result="ok", details={"name": row.name, "secret_id": row.id, "registry": registry})
        try:
            if row.expires_at is not None and row.expires_at <= now:
                record.result, record.action = "denied", "secret.expired"
                return None
            raw = await self.backends.get(row.backend).get(row)
        except SpaceError as e:
            record.result = e.code
            raise
        finally:
            await self._audit_sink([record])
        user, _, password = raw.partition(":")
        return user, password

    # ---- key rotation ---------------------------------------------------------------------------

    async def rekey(self) -> int:
        """Re-encrypt every built-in secret not yet under the newest master key; returns how many.

        Run after putting a new key first in ``SPACE_MASTER_KEY`` (or ``master.key``); once it
        returns, the old keys can be removed.
        """
        builtin = self.backends.get("builtin")
        assert isinstance(builtin, BuiltinBackend)
        done = 0
        for row in await self.store.list_secrets(None, backend="builtin"):
            old = row.key_id
            if builtin.reseal(row):
                assert row.ciphertext is not None and row.key_id is not None
                if await self.store.reseal_secret(row.id, old_key_id=old, ciphertext=row.ciphertext,
                                                  key_id=row.key_id):
                    done += 1
        log.info("secrets.rekeyed", count=done, key_id=builtin.keyring.current_id)
        return done

    # ---- internals ------------------------------------------------------------------------------

    async def _find(self, tenant: str, scope: str, name: str) -> Secret | None:
        try:
            return await self.store.get_secret(tenant, scope, name)
        except NotFound:
            return None

    async def _check_scope_target(self, tenant: str, scope: str) -> None:
        kind, arg = parse_scope(scope)
        if kind == "sandbox":
            sb = await self.store.get_sandbox(arg, tenant)  # another tenant's: NotFound, as a missing one
            if sb.terminated_at is not None:
                raise InvalidRequest(f"sandbox {arg} is terminated", field="scope")

    async def _forget(self, row: Secret) -> None:
        """Drop a value from its backend once its row is gone; a failure leaves an orphan, not an error."""
        try:
            await self.backends.get(row.backend).delete(row)
        except SpaceError as e:
            log.warning("secret.orphaned_value", backend=row.backend, secret_id=row.id, error=str(e))

    async def _record(self, who: Principal, action: str, target: str, result: str, status: int,
                      details: dict[str, Any]) -> None:
        await self._audit_sink([AuditRecord(tenant=who.tenant, actor=who.key_id, action=action, target=target,
                                            result=result, status=status, details=dict(details))])
