"""The E2B edge: which plane a request is for, and the sandbox an envd request targets.

On the one port SPACE serves, a request carrying ``E2b-Sandbox-Id`` (or, with a configured domain,
a ``Host`` of the form ``<port>-<sandbox id>.<domain>``) is sandbox traffic: port 49983 is the envd
protocol, any other port is proxied to that port inside the sandbox. E2B's control-API paths go
to the E2B control API; everything else is SPACE's own API.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import datetime as dt
import json
import re
import time
from typing import Any, Final

from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from space.api.auth import Principal
from space.api.dataplane import SandboxNode, running_sandbox
from space.api.state import AppState
from space.e2b import tokens
from space.errors import InvalidState, NotFound, SpaceError
from space.lifecycle import WAKE, State
from space.store import Sandbox

ENVD_PORT: Final = 49983
#: The audit's actor for calls authorized by a sandbox's envd access token.
ENVD_ACTOR: Final = "e2b-envd-token"
#: Paths of E2B's control API (SPACE's own API lives under /v1).
CONTROL_PREFIXES: Final = ("/sandboxes", "/v2/sandboxes", "/snapshots", "/templates", "/v2/templates",
                           "/v3/templates")
NOT_FOUND_MESSAGE: Final = "The sandbox was not found"
_HOST = re.compile(r"^(\d{1,5})-([a-z0-9]{1,64})\.(.+?)(?::\d+)?$")


#: A sandbox in these states is gone for every caller, whatever token it shows (its tokens were
#: rotated by the delete; the SDK must still learn "not found").
GONE: Final = (State.TERMINATING, State.TERMINATED)
#: How long a request for an auto-resuming sandbox waits for its timeout's pause or suspend to be
#: done before waking it (a pause takes well under a second; a suspend uploads its files first).
SETTLE_TIMEOUT: Final = 120.0


class EdgeError(Exception):
    """What E2B's edge proxy answers when it cannot reach a sandbox (502, JSON, E2B's wording)."""

    def __init__(self, sandbox_id: str, message: str = NOT_FOUND_MESSAGE, status: int = 502) -> None:
        super().__init__(message)
        self.sandbox_id = sandbox_id
        self.message = message
        self.status = status

    def response(self) -> Response:
        body = {"sandboxId": self.sandbox_id, "message": self.message, "code": self.status}
        return Response(json.dumps(body), status_code=self.status, media_type="application/json")


class Unauthenticated(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclasses.dataclass(frozen=True)
class Route:
    sandbox_id: str
    port: int


def route_of(scope: Scope, domain: str | None) -> Route | None:
    """The sandbox and port a request is for, or None for control traffic."""
    sandbox_id = port = host = None
    for k, v in scope.get("headers") or ():
        if k == b"e2b-sandbox-id":
            sandbox_id = v.decode("latin-1").strip()
        elif k == b"e2b-sandbox-port":
            port = v.decode("latin-1").strip()
        elif k == b"host":
            host = v.decode("latin-1").strip().lower()
    if sandbox_id:
        return Route(sandbox_id, int(port) if port and port.isdigit() else ENVD_PORT)
    if domain and host:
        m = _HOST.match(host)
        if m and m.group(3) == domain:
            return Route(m.group(2), int(m.group(1)))
    return None


class E2BDispatch:
    """ASGI middleware in front of SPACE's app: sends E2B traffic to the facade's apps."""

    def __init__(self, app: ASGIApp, *, control: ASGIApp, envd: ASGIApp, ports: ASGIApp,
                 domain: str | None = None) -> None:
        self.app, self.control, self.envd, self.ports, self.domain = app, control, envd, ports, domain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # A WebSocket to a sandbox's port (envd serves none: its port falls through to a 404).
            route = route_of(scope, self.domain)
            if route is not None and route.port != ENVD_PORT:
                await self.ports({**scope, "e2b": route}, receive, send)
                return
        if scope["type"] == "http":
            route = route_of(scope, self.domain)
            if route is not None:
                scope = {**scope, "e2b": route}
                await (self.envd if route.port == ENVD_PORT else self.ports)(scope, receive, send)
                return
            path: str = scope["path"]
            if path == "/files" and b"signature=" in scope.get("query_string", b""):
                # A signed URL made with E2B_SANDBOX_URL names no sandbox: its signature does.
                await self.envd(scope, receive, send)
                return
            if any(path == p or path.startswith(p + "/") for p in CONTROL_PREFIXES):
                await self.control(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclasses.dataclass
class Target:
    """An envd request's sandbox, ready to be talked to."""

    sandbox: Sandbox
    node: SandboxNode
    #: The user the call acts as (``Authorization: Basic <user>:``), None for the template's default.
    user: str | None


def route(request: HTTPConnection) -> Route:
    r = request.scope.get("e2b")
    assert isinstance(r, Route), "an envd route without E2BDispatch"
    return r


def access_token_ok(st: AppState, request: HTTPConnection, sb: Sandbox) -> bool:
    """Whether the request carries the sandbox's envd token (``X-Access-Token``)."""
    token = request.headers.get("x-access-token")
    return token is not None and tokens.check_envd(st.secret, sb, token)


async def sandbox_row(st: AppState, sandbox_id: str) -> Sandbox:
    """The sandbox a request names, unless it is unknown or gone (E2B's 502 "not found"). A read,
    nothing more: what a request may do to it is decided by its credentials after this."""
    try:
        sb = await st.store.get_sandbox(sandbox_id)
    except NotFound:
        raise EdgeError(sandbox_id) from None
    if sb.state in GONE:
        raise EdgeError(sb.id)
    return sb


async def authenticate(st: AppState, request: HTTPConnection) -> Sandbox:
    """The sandbox of an envd request whose ``X-Access-Token`` is its envd token (else 401):
    before anything else happens for the request, not even reading its body. Once per request."""
    done = getattr(request.state, "e2b_sandbox", None)
    if isinstance(done, Sandbox):
        return done
    sb = await sandbox_row(st, route(request).sandbox_id)
    if not access_token_ok(st, request, sb):
        raise Unauthenticated("invalid or missing access token (X-Access-Token)")
    request.state.e2b_sandbox = sb
    return sb


async def target(st: AppState, request: HTTPConnection, authenticated: Sandbox | None = None) -> Target:
    """The running sandbox an envd request is for: what its credentials allow, done. ``authenticated``
    is the row the caller already checked a credential of (a signed URL, a port's token); without
    one, the request's envd token is checked first. Only then may a paused sandbox be woken (when it
    auto-resumes) and the call count as activity. A missing, ended or paused one (unless it
    auto-resumes) is E2B's 502 "not found"."""
    sb = authenticated if authenticated is not None else await authenticate(st, request)
    if sb.auto_resume and (sb.state == State.SUSPENDING or timed_out(sb)):
        # Its timeout is pausing (or suspending) it: wait for that, then wake it below, as E2B's
        # auto-resume does, rather than answer "not found" for the second it takes.
        sb = await _settled(st, sb)
    state = State(sb.state)
    if state != State.RUNNING and not (state in WAKE and sb.auto_resume) \
            and state not in (State.RESTORING, State.MOVING):
        raise EdgeError(sb.id)
    if timed_out(sb):
        # Its timeout ran out and the controller's next tick will act on it: for E2B it ended at
        # its deadline, not up to a tick later.
        raise EdgeError(sb.id)
    try:
        sb, node = await running_sandbox(st, sb.id, sb.tenant)
    except (InvalidState, NotFound):
        raise EdgeError(sb.id) from None
    # Who the audit names: the sandbox's tenant, acting through the sandbox's envd token.
    request.state.principal = Principal(key_id=ENVD_ACTOR, tenant=sb.tenant, role="member")
    return Target(sb, node, basic_user(request))


async def _settled(st: AppState, sb: Sandbox) -> Sandbox:
    """The sandbox once its timeout's pause or suspend is done (or SETTLE_TIMEOUT passed: then as
    it is). Polled with backoff: this is the rare request that lands in that second."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    delay = 0.02
    while (sb.state == State.SUSPENDING or timed_out(sb)) and time.monotonic() < deadline:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.25)
        try:
            sb = await st.store.get_sandbox(sb.id)
        except NotFound:
            raise EdgeError(sb.id) from None
    return sb


def timed_out(sb: Sandbox) -> bool:
    """Whether the sandbox's E2B timeout has run out (it is being killed or paused)."""
    return sb.expires_at is not None and sb.expires_at <= dt.datetime.now(dt.UTC) and sb.state == State.RUNNING


def basic_user(request: HTTPConnection) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value.strip():
        return None
    try:
        user = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        return None
    return user or None


def edge_error_of(sandbox_id: str, exc: SpaceError) -> EdgeError | None:
    """A node error that means the sandbox is gone, as the edge would say it."""
    if isinstance(exc, InvalidState) or exc.details.get("sandbox_dead"):
        return EdgeError(sandbox_id)
    return None


def json_body(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj), status_code=status, media_type="application/json")


def http_error(status: int, message: str) -> Response:
    """envd's own HTTP error body (``/files``, ``/health``)."""
    return Response(json.dumps({"code": status, "message": message}), status_code=status,
                    media_type="application/json")
