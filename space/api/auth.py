"""API keys → principals. Keys are bearer tokens stored hashed; every principal has one tenant."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import time

from fastapi import Request
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from space.api.limits import has_body
from space.errors import Forbidden, JoinTokenRefused, SpaceError, Unauthorized
from space.keyforms import canonical
from space.web import error_response

ROLES = ("admin", "member", "readonly")


@dataclasses.dataclass(frozen=True)
class Principal:
    key_id: str
    tenant: str
    role: str
    #: The key belongs to the operator tenant (``ServeSettings.operator_tenant``): its admin keys
    #: manage every tenant (keys, quotas, egress defaults, audit), where a tenant's own admin keys
    #: manage only their tenant.
    operator_tenant: bool = False

    @property
    def is_operator(self) -> bool:
        return self.operator_tenant and self.role == "admin"

    @property
    def read_only(self) -> bool:
        """A readonly key: it reads, and nothing it does changes a thing (not even wakes a sandbox)."""
        return self.role == "readonly"

    def require_write(self) -> None:
        if self.read_only:
            raise Forbidden("this API key is read-only")

    def require_admin(self) -> None:
        if self.role != "admin":
            raise Forbidden("this action needs an admin API key")

    def require_operator(self) -> None:
        """Platform-wide actions: only an admin key of the operator tenant."""
        if not self.is_operator:
            raise Forbidden("this action needs an operator admin key (an admin key of the operator tenant)")

    def can_manage(self, tenant: str) -> bool:
        """Whether this key may administer ``tenant`` (its keys, quota, egress default, audit)."""
        return self.role == "admin" and (self.operator_tenant or tenant == self.tenant)

    def require_manage(self, tenant: str) -> None:
        if self.role != "admin":
            raise Forbidden("this action needs an admin API key")
        if not self.can_manage(tenant):
            raise Forbidden(f"an admin key of tenant {self.tenant!r} cannot manage tenant {tenant!r}",
                            tenant=tenant)

    def can_read_tenant(self, tenant: str) -> bool:
        """Whether this key may read ``tenant``'s settings (quota, egress default): any key of the
        tenant itself, or an operator admin."""
        return tenant == self.tenant or self.is_operator


class KeyCache:
    """Recently authenticated keys, so a burst of calls costs one lookup, not one per call.

    Entries live ``ttl`` seconds: a key revoked through another replica stops working within that
    time; through this replica at once (:meth:`clear`). Keys are held by their SHA-256 only.
    """

    def __init__(self, ttl: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[bytes, tuple[float, Principal]] = {}

    def get(self, key: str) -> Principal | None:
        hit = self._entries.get(_digest(key))
        if hit is None or hit[0] < time.monotonic():
            return None
        return hit[1]

    def put(self, key: str, who: Principal) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[_digest(key)] = (time.monotonic() + self.ttl, who)

    def clear(self) -> None:
        self._entries.clear()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


#: Where :class:`AuthenticateFirst` leaves the principal it authenticated (in the request's scope).
_AUTHENTICATED = "space.principal"


#: The one route whose body is authenticated by a join token (space.api.nodes.join).
JOIN_PATH = "/v1/nodes/join"


async def join_token(request: Request) -> str:
    """The join token a request carries if it admits nodes now (:class:`JoinTokenRefused` if not)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise JoinTokenRefused("a join needs Authorization: Bearer <join token>")
    await request.app.state.space.store.check_join_token(token)
    return token


async def principal(request: HTTPConnection) -> Principal:
    who = request.scope.get(_AUTHENTICATED)
    if isinstance(who, Principal):
        return who
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    return await principal_of_key(request, key)


async def principal_of_key(request: HTTPConnection, key: str) -> Principal:
    """The principal of an API key however the request carried it (E2B's facade: ``X-API-KEY``)."""
    state = request.app.state.space
    key = canonical(key)  # E2B's spelling of it too (space.keyforms): one cache entry for both
    who: Principal | None = state.keys.get(key)
    if who is None:
        row = await state.store.authenticate(key)
        if row is None:
            raise Unauthorized("invalid API key")
        who = Principal(key_id=row.id, tenant=row.tenant, role=row.role,
                        operator_tenant=row.tenant == state.operator_tenant)
        state.keys.put(key, who)
    # For the audit middleware (space.api.auditing), which runs outside the dependency system.
    request.state.principal = who
    return who


def attach_token(secret: bytes, sandbox_id: str, command_id: str) -> str:
    """A capability for one command's data plane, verifiable without a database lookup."""
    mac = hmac.new(secret, f"{sandbox_id}:{command_id}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac[:24]).decode().rstrip("=")


def check_attach_token(secret: bytes, sandbox_id: str, command_id: str, token: str) -> bool:
    return same_secret(attach_token(secret, sandbox_id, command_id), token)


def same_secret(expected: str | bytes, given: str | bytes) -> bool:
    """Whether a credential a client sent is the expected one, in constant time, whatever it is:
    text of any script (``hmac.compare_digest`` refuses non-ASCII ``str``: a 500), lone surrogates,
    bytes. Every credential comparison goes through here."""
    return hmac.compare_digest(_bytes(expected), _bytes(given))


def _bytes(v: str | bytes) -> bytes:
    return v if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass")


class AuthenticateFirst:
    """ASGI middleware in front of SPACE's routes: a request that carries a body is authenticated
    before anything reads it (FastAPI reads and parses a route's body before it solves the route's
    dependencies, ``principal`` among them). Without a valid key it is answered 401 at once, its
    body unread; with one, the route's ``principal`` is the one found here (no second lookup).
    Requests without a body authenticate in the route, as before (an attach token is no API key)."""

    def __init__(self, app: ASGIApp, prefix: str = "/v1/") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix) and has_body(scope):
            request = Request(scope)
            try:
                if scope["path"] == JOIN_PATH:
                    await join_token(request)  # a node joining holds a join token, not an API key
                else:
                    scope[_AUTHENTICATED] = await principal(request)
            except SpaceError as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)

