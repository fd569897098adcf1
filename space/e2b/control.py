"""E2B's control API (``/sandboxes``, ``/v2/sandboxes``, …) over SPACE's sandboxes.

The same sandboxes as SPACE's own API, with SPACE's tenancy and keys: ``X-API-KEY`` carries a
SPACE API key. E2B's timeout is SPACE's ``lifetime_s`` (``expires_at``); auto-pause is
``on_expire=pause``; E2B's "paused" is SPACE's ``paused`` or ``suspended``. Every answer keeps the
shapes and status codes of ``E2B_COMPAT.md`` B and D; errors are ``{"code": <int>, "message"}``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime as dt
import json
import time
import urllib.parse
from typing import Annotated, Any, Final

import structlog
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from space import egress_policy as egress_rules
from space.api import sandboxes as space_sandboxes
from space.api.auditing import AuditMiddleware
from space.api.auth import Principal, principal, principal_of_key
from space.api.dataplane import wait_operation
from space.api.egress import checked_policy
from space.api.egress import push as egress_push
from space.api.lifecycle import ForkBody, enqueue_action, fork_sandbox, start_suspend
from space.api.state import AppState, app_state
from space.e2b import tokens
from space.e2b.edge import json_body, timed_out
from space.errors import InvalidState, NotFound, SpaceError, Unauthorized
from space.lifecycle import Action, State
from space.node.network.port_proxy import PORT_HOST_MAX, PORT_HOST_PATTERN
from space.store import Operation, Sandbox

log = structlog.get_logger("space.e2b.control")

#: The envd version SPACE's facade implements (the SDK switches code paths on it; E2B_COMPAT C.5).
#: What SDKs gate on: 0.6.3's entries in watch events and 0.6.4's ``allow_network_mounts`` (no
#: network mounts here: watching is the same) are served; 0.6.2's file metadata is refused by name
#: (space.e2b.files: the sandbox filesystem has no extended attributes to keep it in).
ENVD_VERSION: Final = "0.6.4"
CLIENT_ID: Final = "space"
DEFAULT_TIMEOUT: Final = 300
MAX_TIMEOUT: Final = 30 * 86400
#: How long create, connect, pause and fork wait for their operation.
WAIT: Final = 300.0
#: E2B "paused": every state a paused E2B sandbox can be in here.
PAUSED_STATES: Final = (State.PAUSED, State.SUSPENDING, State.SUSPENDED, State.RESTORING)
#: A sandbox being moved to another node (a drain) is running for E2B: calls wait out the move.
LIVE_STATES: Final = (State.CREATING, State.RUNNING, State.MOVING, *PAUSED_STATES)
#: States a connect waits out before it looks again.
SETTLING_STATES: Final = (State.SUSPENDING, State.RESTORING, State.MOVING)
#: How far outside a metrics query's range a sample taken now may fall and still be returned.
METRICS_SLACK: Final = 5.0
#: A sandbox without a deadline reports one this far in the future (``endAt`` is required).
NO_DEADLINE: Final = dt.timedelta(days=3650)


class E2BError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.error_code = status, message, error_code

    def response(self) -> Response:
        body: dict[str, Any] = {"code": self.status, "message": self.message}
        if self.error_code:
            body["error_code"] = self.error_code
        # A retry would repeat a refusal: the SDK retries 429/502/503/504 unless told not to.
        return Response(json.dumps(body), status_code=self.status, media_type="application/json",
                        headers={"should-retry": "false"} if self.status != 503 else None)


def _error(exc: SpaceError) -> E2BError:
    return E2BError(exc.status, exc.message, exc.code)


# -- auth -----------------------------------------------------------------------------------------


async def e2b_principal(request: Request) -> Principal:
    """``X-API-KEY: <SPACE key>`` (what the SDK sends), or SPACE's own ``Authorization: Bearer``."""
    key = request.headers.get("x-api-key", "").strip()
    if key:
        return await principal_of_key(request, key)
    return await principal(request)


Auth = Annotated[Principal, Depends(e2b_principal)]
St = Annotated[AppState, Depends(app_state)]


# -- wire shapes ----------------------------------------------------------------------------------


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def e2b_state(sb: Sandbox) -> str:
    return "paused" if sb.state in PAUSED_STATES else "running"


def token_view(st: AppState, sb: Sandbox) -> dict[str, str]:
    """The sandbox's tokens, for a key that may write (space.e2b.tokens): the envd token, and the
    port-only traffic token when its ports are private."""
    view = {"envdAccessToken": tokens.envd_token(st.secret, sb)}
    if not sb.public_ports:
        view["trafficAccessToken"] = tokens.traffic_token(st.secret, sb)
    return view


def sandbox_view(st: AppState, sb: Sandbox) -> dict[str, Any]:
    """What create, connect, fork and a rotation answer: only to keys that may write."""
    return {"templateID": sb.template, "sandboxID": sb.id, "clientID": CLIENT_ID, "alias": sb.template,
            "envdVersion": ENVD_VERSION, "domain": st.e2b_domain, **token_view(st, sb)}


def listed_view(sb: Sandbox) -> dict[str, Any]:
    end = sb.expires_at or (sb.created_at + NO_DEADLINE)
    return {"templateID": sb.template, "sandboxID": sb.id, "clientID": CLIENT_ID, "alias": sb.template,
            "startedAt": _iso(sb.created_at), "endAt": _iso(end), "envdVersion": ENVD_VERSION,
            "cpuCount": max(1, round(sb.cpu)), "memoryMB": sb.memory_mb, "diskSizeMB": 0,
            "state": e2b_state(sb), "metadata": dict(sb.meta or {})}


def detail_view(st: AppState, sb: Sandbox, who: Principal) -> dict[str, Any]:
    # A readonly key sees the sandbox, not its tokens: either would let it act on the sandbox.
    secrets = {} if who.read_only else {"envdAccessToken": tokens.envd_token(st.secret, sb)}
    return {**listed_view(sb), **secrets, "domain": st.e2b_domain,
            "allowInternetAccess": (sb.egress or {}).get("default") != "deny",
            "lifecycle": {"onTimeout": "kill" if sb.expire_action == "delete" else "pause",
                          "autoResume": bool(sb.auto_resume)},
            "pauseMode": "filesystem" if _files_only(sb) else "full"}


async def _files_only_snapshot(st: AppState, sb: Sandbox) -> bool:
    """Whether the sandbox is suspended as its files only (a resume boots it afresh anyway)."""
    if sb.state != State.SUSPENDED or sb.snapshot_id is None:
        return False
    return (await st.store.get_snapshot(sb.snapshot_id)).kind == "disk"


def _files_only(sb: Sandbox) -> bool:
    """Whether its pause (on timeout, or the one it is in) keeps only its files."""
    return sb.expire_action == "suspend_disk"


# -- bodies ---------------------------------------------------------------------------------------


class AutoResume(BaseModel):
    enabled: bool = False


class Network(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    allow_out: list[str] | None = Field(None, alias="allowOut", max_length=256)
    deny_out: list[str] | None = Field(None, alias="denyOut", max_length=256)
    allow_public_traffic: bool | None = Field(None, alias="allowPublicTraffic")
    #: The Host its servers see (``${PORT}``: the port); checked here as SPACE's ``port_host`` is.
    mask_request_host: str | None = Field(None, alias="maskRequestHost", min_length=1, max_length=PORT_HOST_MAX,
                                          pattern=PORT_HOST_PATTERN)


class NewSandbox(BaseModel):
    """``NewSandboxV2`` (and the older ``NewSandbox``); fields SPACE has no use for are ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    template_id: str = Field(..., alias="templateID", min_length=1, max_length=128)
    timeout: int | None = Field(None, ge=0, le=MAX_TIMEOUT)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    auto_pause: bool = Field(False, alias="autoPause")
    #: False: the timeout keeps the files only (a resume boots afresh).
    auto_pause_memory: bool | None = Field(None, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(None, alias="autoResume")
    allow_internet_access: bool | None = None
    network: Network | None = None


class ConnectBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout: int | None = Field(None, ge=0, le=MAX_TIMEOUT)
    #: False asks for a cold boot from the disk state (``on_resume="reboot"``).
    memory: bool | None = None


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    timeout: int | None = Field(None, ge=0, le=MAX_TIMEOUT)
    auto_pause: bool | None = Field(None, alias="autoPause")


class TimeoutBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout: int = Field(..., ge=0, le=MAX_TIMEOUT)


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout: int | None = Field(None, ge=0, le=MAX_TIMEOUT)
    count: int = Field(1, ge=1, le=16)


def egress_of(allow_internet: bool | None, network: Network | None) -> dict[str, Any] | None:
    """E2B's network options as a SPACE egress policy. E2B lets ``allowOut`` win over ``denyOut``
    and uses ``0.0.0.0/0`` in ``denyOut`` for "nothing else": that is SPACE's ``default: deny``."""
    allow = list(network.allow_out or []) if network else []
    deny = list(network.deny_out or []) if network else []
    doc: dict[str, Any] = {}
    if allow_internet is False or "0.0.0.0/0" in deny:
        doc["default"] = "deny"
    deny = [d for d in deny if d not in ("0.0.0.0/0", "::/0")]
    if allow:
        doc["allow"] = allow
    if deny:
        doc["deny"] = deny
    if not doc:
        return None
    try:
        return egress_rules.validate(doc)
    except SpaceError as exc:
        raise E2BError(400, f"invalid network rules: {exc.message}") from None


# -- helpers --------------------------------------------------------------------------------------


def _deadline(seconds: int | None) -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=DEFAULT_TIMEOUT if seconds is None else seconds)


async def live_sandbox(st: AppState, who: Principal, sandbox_id: str) -> Sandbox:
    """The tenant's sandbox unless it is gone (terminated, deleting or failed): 404 as E2B says."""
    try:
        sb = await st.store.get_sandbox(short_id(sandbox_id), tenant=who.tenant)
    except NotFound:
        raise E2BError(404, f"sandbox {sandbox_id} not found") from None
    if sb.state not in LIVE_STATES or (timed_out(sb) and sb.expire_action == "delete"):
        raise E2BError(404, f"sandbox {sandbox_id} not found ({sb.state})")
    return sb


def short_id(sandbox_id: str) -> str:
    """infra accepts ``<id>-<clientID>`` on paths."""
    return sandbox_id.removesuffix(f"-{CLIENT_ID}")


async def finish_operation(st: AppState, op: Operation, what: str) -> Operation:
    op = await wait_operation(st, op.id, time.monotonic() + WAIT)
    if op.status == "failed":
        raise E2BError(500, f"{what} failed: {op.error_message or op.error_code}")
    if op.status != "succeeded":
        raise E2BError(504, f"{what} did not finish within {WAIT:.0f}s (operation {op.id})")
    return op


async def wait_running(st: AppState, sandbox_id: str, what: str) -> Sandbox:
    deadline = time.monotonic() + WAIT
    while True:
        sb = await st.store.get_sandbox(sandbox_id)
        if sb.state == State.RUNNING:
            return sb
        if sb.state in (State.FAILED, State.TERMINATING, State.TERMINATED):
            raise E2BError(500, f"{what} failed: {sb.error_message or sb.state}")
        if time.monotonic() > deadline:
            raise E2BError(504, f"{what} did not finish within {WAIT:.0f}s")
        await asyncio.sleep(0.05)


async def _wake(st: AppState, sb: Sandbox) -> Sandbox:
    """Resume a paused sandbox or restore a suspended one, and wait for it to run."""
    if sb.state == State.PAUSED:
        _, op = await enqueue_action(st, sb.tenant, sb.id, Action.RESUME, "sandbox.resume", {})
        await finish_operation(st, op, f"resuming sandbox {sb.id}")
    elif sb.state == State.SUSPENDED:
        _, op = await enqueue_action(st, sb.tenant, sb.id, Action.RESTORE, "sandbox.restore",
                                     {"snapshot": sb.snapshot_id, "node": None})
        await finish_operation(st, op, f"restoring sandbox {sb.id}")
    return await wait_running(st, sb.id, f"resuming sandbox {sb.id}")


# -- routes ---------------------------------------------------------------------------------------

router = APIRouter()


def _on_expire(body: NewSandbox) -> str:
    if not body.auto_pause:
        return "delete"
    # A filesystem-only auto-pause is a suspend of the files: nothing of its memory is kept.
    return "suspend_disk" if body.auto_pause_memory is False else "pause"


async def _create(st: AppState, who: Principal, body: NewSandbox, idempotency_key: str | None) -> Response:
    timeout = DEFAULT_TIMEOUT if body.timeout is None else body.timeout
    # ``Sandbox.create(<snapshot id>)``: the template is the snapshot's (space.e2b.snapshots).
    source = {"snapshot": body.template_id} if body.template_id.startswith("snap-") else {
        "template": body.template_id}
    space_body = space_sandboxes.CreateSandboxBody.model_validate({
        **source, "env": body.env_vars or {}, "metadata": body.metadata or {},
        "lifetime_s": max(1, timeout), "on_expire": _on_expire(body),
        "auto_resume": bool(body.auto_resume and body.auto_resume.enabled),
        "egress": egress_of(body.allow_internet_access, body.network),
        # E2B's default: a sandbox's ports are public unless it says otherwise.
        "public_ports": body.network is None or body.network.allow_public_traffic is not False,
        **({"port_host": body.network.mask_request_host}
           if body.network is not None and body.network.mask_request_host is not None else {}),
    })
    sb, op, status = await space_sandboxes.create(st, who, space_body, idempotency_key)
    if status != 201:
        await finish_operation(st, op, f"creating sandbox {sb.id}")
        sb = await wait_running(st, sb.id, f"creating sandbox {sb.id}")
    log.info("e2b.sandbox.created", sandbox=sb.id, template=sb.template)
    return json_body(sandbox_view(st, sb), 201)


@router.post("/v2/sandboxes")
async def create_v2(body: NewSandbox, who: Auth, st: St,
                    idempotency_key: Annotated[str | None, Header(max_length=255)] = None) -> Response:
    return await _create(st, who, body, idempotency_key)


@router.post("/sandboxes")
async def create_v1(body: NewSandbox, who: Auth, st: St,
                    idempotency_key: Annotated[str | None, Header(max_length=255)] = None) -> Response:
    return await _create(st, who, body, idempotency_key)


async def _connect(st: AppState, who: Principal, sandbox_id: str, timeout: int | None,
                   memory: bool | None = None) -> Response:
    who.require_write()
    sb = await live_sandbox(st, who, sandbox_id)
    if memory is False and sb.state in PAUSED_STATES and not await _files_only_snapshot(st, sb):
        # The SDK's contract: refused where unsupported, never silently restored with memory.
        raise E2BError(400, "resuming from the disk state only (on_resume='reboot') is not supported by this "
                            "server; connect without it to restore the sandbox with its memory")
    if sb.state == State.CREATING:
        sb = await wait_running(st, sb.id, f"creating sandbox {sb.id}")
    if sb.state == State.RUNNING and timed_out(sb):
        # Its timeout ran out and its auto-pause is due (live_sandbox refused one due to be killed): pause
        # it now, whoever gets there first, then resume it below like any paused sandbox.
        await _pause_now(st, sb)
        sb = await st.store.get_sandbox(sb.id)
    if sb.state == State.RUNNING:
        if timeout is not None:
            new_end = _deadline(timeout)
            # Connecting never shortens a running sandbox's time (infra: allowShorter=false).
            if sb.expires_at is not None and new_end > sb.expires_at:
                sb = await st.store.update_sandbox(sb.id, expires_at=new_end)
        return json_body(sandbox_view(st, sb), 200)
    if sb.state in SETTLING_STATES:
        await _wait_settled(st, sb.id)
        sb = await st.store.get_sandbox(sb.id)
        if sb.state == State.RUNNING:
            return json_body(sandbox_view(st, sb), 200)
    sb = await _wake(st, sb)
    # A resumed sandbox gets a fresh timeout (E2B: the given one, else the default).
    sb = await st.store.update_sandbox(sb.id, expires_at=_deadline(timeout))
    return json_body(sandbox_view(st, sb), 201)


async def _wait_settled(st: AppState, sandbox_id: str) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        sb = await st.store.get_sandbox(sandbox_id)
        if sb.state not in SETTLING_STATES:
            return
        await asyncio.sleep(0.1)
    raise E2BError(504, f"sandbox {sandbox_id} is still {sb.state}")


@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_v2(sandbox_id: str, who: Auth, st: St, body: ConnectBody | None = None) -> Response:
    return await _connect(st, who, sandbox_id, body.timeout if body else None, body.memory if body else None)


@router.post("/sandboxes/{sandbox_id}/connect")
async def connect_v1(sandbox_id: str, who: Auth, st: St, body: ConnectBody | None = None) -> Response:
    return await _connect(st, who, sandbox_id, body.timeout if body else None)


@router.post("/sandboxes/{sandbox_id}/resume")
async def resume(sandbox_id: str, who: Auth, st: St, body: ResumeBody | None = None) -> Response:
    """1.x SDKs: resume a paused sandbox (409 when it runs)."""
    who.require_write()  # before anything changes (autoPause below)
    sb = await live_sandbox(st, who, sandbox_id)
    if sb.state == State.RUNNING:
        raise E2BError(409, f"sandbox {sandbox_id} is already running")
    if body is not None and body.auto_pause is not None:
        await st.store.update_sandbox(sb.id, expire_action="pause" if body.auto_pause else "delete")
    return await _connect(st, who, sandbox_id, body.timeout if body else None)


@router.delete("/sandboxes/{sandbox_id}")
async def kill(sandbox_id: str, who: Auth, st: St) -> Response:
    sb = await live_sandbox(st, who, sandbox_id)
    try:
        _, op = await space_sandboxes.delete(st, who, sb.id)
    except InvalidState:
        raise E2BError(404, f"sandbox {sandbox_id} not found ({sb.state})") from None
    # E2B's kill returns once the sandbox is gone: its processes are dead when the caller goes on.
    await finish_operation(st, op, f"killing sandbox {sb.id}")
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}")
async def get_info(sandbox_id: str, who: Auth, st: St) -> Response:
    return json_body(detail_view(st, await live_sandbox(st, who, sandbox_id), who))


@router.post("/sandboxes/{sandbox_id}/tokens/rotate")
async def rotate_tokens(sandbox_id: str, who: Auth, st: St) -> Response:
    """SPACE's own (not E2B's): new envd and traffic tokens for the sandbox. The old ones, and every
    URL signed with them, stop working at once on every replica (each check reads the row); the
    answer is ``connect``'s, with the new tokens. Any key of its tenant that may write."""
    who.require_write()
    sb = await live_sandbox(st, who, sandbox_id)
    sb = await st.store.update_sandbox(sb.id, token_nonce=tokens.fresh_nonce())
    log.info("e2b.tokens.rotated", sandbox=sb.id, by=who.key_id)
    return json_body(sandbox_view(st, sb))


@router.post("/sandboxes/{sandbox_id}/timeout")
async def set_timeout(sandbox_id: str, body: TimeoutBody, who: Auth, st: St) -> Response:
    who.require_write()
    sb = await live_sandbox(st, who, sandbox_id)
    # set_timeout may shorten (infra: allowShorter=true).
    await st.store.update_sandbox(sb.id, expires_at=_deadline(body.timeout))
    return Response(status_code=204)


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    #: False: keep only the files (``pause(keep_memory=False)``): a resume boots afresh.
    memory: bool | None = None


@router.post("/sandboxes/{sandbox_id}/pause")
async def pause(sandbox_id: str, who: Auth, st: St, body: PauseBody | None = None) -> Response:
    who.require_write()
    sb = await live_sandbox(st, who, sandbox_id)
    if sb.state == State.CREATING:
        sb = await wait_running(st, sb.id, f"creating sandbox {sb.id}")
    if sb.state != State.RUNNING:
        raise E2BError(409, f"sandbox {sandbox_id} is already paused")
    try:
        if body is not None and body.memory is False:
            # Only the files are kept: a suspend of a disk snapshot (the memory is let go).
            _, op = await start_suspend(st, who.tenant, sb.id, memory=False)
        else:
            _, op = await enqueue_action(st, who.tenant, sb.id, Action.PAUSE, "sandbox.pause", {})
    except InvalidState as exc:
        raise E2BError(409, exc.message) from None
    await finish_operation(st, op, f"pausing sandbox {sb.id}")
    return Response(status_code=204)


async def _pause_now(st: AppState, sb: Sandbox) -> None:
    """Pause a running sandbox, or wait for the pause someone else (the controller's timeout
    policy) already started."""
    try:
        _, op = await enqueue_action(st, sb.tenant, sb.id, Action.PAUSE, "sandbox.pause", {"reason": "timeout"})
    except InvalidState:
        pending = await st.store.find_operations(target=sb.id, kind="sandbox.pause", status=["pending", "running"])
        if not pending:
            return  # it is not running any more: the caller looks again
        op = pending[0]
    await finish_operation(st, op, f"pausing sandbox {sb.id}")


def _metadata_filter(raw: str | None) -> dict[str, str]:
    if not raw:
        return {}
    return dict(urllib.parse.parse_qsl(raw, keep_blank_values=True))


def page_token(created_at: dt.datetime, row_id: str) -> str:
    """``X-Next-Token`` of a listing ordered by (creation time, id): the last row given."""
    return base64.urlsafe_b64encode(f"{created_at.timestamp():.6f}|{row_id}".encode()).decode().rstrip("=")


def page_cursor(token: str) -> tuple[float, str]:
    """The (creation time, id) a ``nextToken`` continues after."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        at, _, sid = raw.partition("|")
        return float(at), sid
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise E2BError(400, "invalid nextToken") from None


async def _listing(st: AppState, who: Principal, states: list[State]) -> list[Sandbox]:
    return await st.store.list_sandboxes(tenant=who.tenant, states=[s.value for s in states])


@router.get("/v2/sandboxes")
async def list_v2(
    who: Auth, st: St,
    state: str | None = None,
    metadata: str | None = None,
    template: str | None = None,
    order: str = "desc",
    started_after: Annotated[str | None, Query(alias="startedAfter")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> Response:
    wanted = {s.strip() for s in (state or "running,paused").split(",") if s.strip()}
    if not wanted <= {"running", "paused"}:
        raise E2BError(400, f"unknown state filter {state!r} (running, paused)")
    if order not in ("asc", "desc"):
        raise E2BError(400, "order must be asc or desc")
    states = ([State.CREATING, State.RUNNING] if "running" in wanted else []) + (
        list(PAUSED_STATES) if "paused" in wanted else [])
    rows = await _listing(st, who, states)
    meta = _metadata_filter(metadata)
    if meta:
        rows = [sb for sb in rows if all((sb.meta or {}).get(k) == v for k, v in meta.items())]
    if template:
        rows = [sb for sb in rows if sb.template == template]
    if started_after:
        try:
            after = dt.datetime.fromisoformat(started_after.replace("Z", "+00:00"))
        except ValueError:
            raise E2BError(400, "startedAfter must be an ISO 8601 time") from None
        if after.tzinfo is None:
            after = after.replace(tzinfo=dt.UTC)
        rows = [sb for sb in rows if sb.created_at >= after]
    rows.sort(key=lambda sb: (sb.created_at.timestamp(), sb.id), reverse=order == "desc")
    if next_token:
        cursor = page_cursor(next_token)
        if order == "desc":
            rows = [sb for sb in rows if (sb.created_at.timestamp(), sb.id) < cursor]
        else:
            rows = [sb for sb in rows if (sb.created_at.timestamp(), sb.id) > cursor]
    page = rows[:limit]
    headers = {"x-next-token": page_token(page[-1].created_at, page[-1].id)} if len(rows) > limit else None
    return Response(json.dumps([listed_view(sb) for sb in page]), media_type="application/json",
                    headers=headers)


@router.get("/sandboxes")
async def list_v1(who: Auth, st: St, metadata: str | None = None) -> Response:
    """The deprecated listing: running sandboxes only, one page."""
    rows = await _listing(st, who, [State.CREATING, State.RUNNING])
    meta = _metadata_filter(metadata)
    rows = [sb for sb in rows if all((sb.meta or {}).get(k) == v for k, v in meta.items())]
    return json_body([listed_view(sb) for sb in rows])


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(sandbox_id: str, who: Auth, st: St, start: int | None = None, end: int | None = None) -> Response:
    """One sample taken now (SPACE keeps no history), when now is in the asked range (unix seconds;
    a few seconds of slack, as E2B's samples are aligned to buckets): a paused sandbox has none."""
    sb = await live_sandbox(st, who, sandbox_id)
    now = time.time()
    if sb.state != State.RUNNING or sb.node_id is None:
        return json_body([])
    if (start is not None and now < start - METRICS_SLACK) or (end is not None and now > end + METRICS_SLACK):
        return json_body([])
    node = await st.nodes.client(sb.node_id)
    try:
        s = await node.call("GET", f"/v1/sandboxes/{sb.id}/stats", timeout=10)
    except SpaceError as exc:
        log.warning("e2b.metrics.failed", sandbox=sb.id, error=str(exc))
        return json_body([])
    at = dt.datetime.fromtimestamp(float(s["at"]), dt.UTC)
    return json_body([{
        "timestamp": _iso(at), "timestampUnix": int(at.timestamp()),
        "cpuCount": max(1, round(float(s.get("cpu_count") or sb.cpu))),
        "cpuUsedPct": float(s.get("cpu_used_pct") or 0.0),
        "memUsed": int(s.get("mem_used") or 0), "memTotal": int(s.get("mem_total") or sb.memory_mb << 20),
        "memCache": int(s.get("mem_cache") or 0),
        # The root's own usage would need a tree walk per call; not measured yet.
        "diskUsed": 0, "diskTotal": 0,
    }])


@router.post("/sandboxes/{sandbox_id}/fork")
async def fork(sandbox_id: str, who: Auth, st: St, body: ForkRequest | None = None) -> Response:
    body = body or ForkRequest.model_validate({})
    sb = await live_sandbox(st, who, sandbox_id)
    try:
        rows, _, op = await fork_sandbox(st, who, sb.id, ForkBody.model_validate({"count": body.count}), None)
    except InvalidState as exc:
        raise E2BError(409, exc.message) from None
    op = await wait_operation(st, op.id, time.monotonic() + WAIT)
    out: list[dict[str, Any]] = []
    for row in rows:
        child = await st.store.get_sandbox(row.id)
        if child.state == State.RUNNING:
            child = await st.store.update_sandbox(child.id, expires_at=_deadline(body.timeout),
                                                  expire_action=sb.expire_action)
            out.append({"sandbox": sandbox_view(st, child)})
        else:
            out.append({"error": {"code": 500, "message": child.error_message or f"fork is {child.state}"}})
    return json_body(out, 201)


@router.put("/sandboxes/{sandbox_id}/network")
async def update_network(sandbox_id: str, body: Network, who: Auth, st: St) -> Response:
    who.require_write()
    sb = await live_sandbox(st, who, sandbox_id)
    try:
        doc = await checked_policy(st, sb.tenant, egress_of(None, body) or {})
    except SpaceError as exc:
        raise E2BError(400, f"invalid network rules: {exc.message}") from None
    sb = await st.store.update_sandbox(sb.id, egress=doc)
    await egress_push(st, sb, with_secrets=False)
    return Response(status_code=204)


def create_control_app(state: AppState) -> FastAPI:
    app = FastAPI(title="SPACE E2B control API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.space = state
    app.add_middleware(AuditMiddleware, prefix="/")

    @app.exception_handler(E2BError)
    async def _e2b(_: Request, exc: E2BError) -> Response:
        return exc.response()

    @app.exception_handler(Unauthorized)
    async def _unauth(_: Request, exc: Unauthorized) -> Response:
        return E2BError(401, exc.message).response()

    @app.exception_handler(SpaceError)
    async def _space(_: Request, exc: SpaceError) -> Response:
        return _error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return E2BError(400, f"invalid request: {where}: {first.get('msg', 'invalid')}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return E2BError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("e2b.control.unhandled", error=repr(exc))
        return E2BError(500, "internal error; see the server log").response()

    from space.e2b import snapshots, template_files, templates  # they build on this module's helpers

    app.include_router(router)
    app.include_router(templates.router)  # first: DELETE /templates/tags is not snapshot "tags"
    app.include_router(snapshots.router)
    app.include_router(template_files.router)
    return app

