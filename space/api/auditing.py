"""The audit trail of the API: one record per mutating call, written off the response path.

Every ``POST``/``PUT``/``PATCH``/``DELETE`` under ``/v1/`` leaves exactly one :class:`AuditRecord`,
whatever its outcome (refused, failed, crashed, unauthenticated):

- ``tenant`` / ``actor``: the caller's tenant and API key id, from the principal the ``principal``
  dependency stashed on ``request.state``; ``""`` / ``"anonymous"`` when the call did not
  authenticate (a 401, or a request refused before its key was looked at and not in the key cache).
- ``action``: the route's stable name (:data:`ACTIONS`; a route missing there gets
  ``<resource>.<verb>`` by :func:`action_for`'s rule).
- ``target``: what the call was about: the created object's id when the response names one (sandbox,
  snapshot, API key, node, template), else the most specific id in the path (snapshot, command's
  sandbox, key, template, pool, tenant).
- ``result``: ``ok`` for a 2xx/3xx answer, else the error's stable code (``http_<status>`` when the
  body carries none); ``status`` is the HTTP status.
- ``details``: ``method``, ``path``, the path parameters, ``request_id`` (the client's
  ``X-Request-Id``) and ``idempotency_key`` when given, and what the response named beyond the target
  (a command id, a fork's sandboxes).

Records go through :class:`AuditWriter`, a bounded in-memory queue flushed in batches by a background
task: the call never waits for the audit write and never fails because of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import json
from collections.abc import Iterable
from typing import Any

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.errors import Unavailable
from space.store import Store
from space.store.models import AuditRecord

log = structlog.get_logger("space.api.audit")

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: Responses larger than this are not parsed for a created id or an error code.
MAX_CAPTURE = 64 * 1024

#: (method, route template) → action. Stable names: clients filter on them.
ACTIONS: dict[tuple[str, str], str] = {
    ("POST", "/v1/sandboxes"): "sandbox.create",
    ("PATCH", "/v1/sandboxes/{sandbox_id}"): "sandbox.update",
    ("DELETE", "/v1/sandboxes/{sandbox_id}"): "sandbox.delete",
    ("POST", "/v1/sandboxes/{sandbox_id}/pause"): "sandbox.pause",
    ("POST", "/v1/sandboxes/{sandbox_id}/resume"): "sandbox.resume",
    ("POST", "/v1/sandboxes/{sandbox_id}/suspend"): "sandbox.suspend",
    ("POST", "/v1/sandboxes/{sandbox_id}/restore"): "sandbox.restore",
    ("POST", "/v1/sandboxes/{sandbox_id}/rollback"): "sandbox.rollback",
    ("POST", "/v1/sandboxes/{sandbox_id}/fork"): "sandbox.fork",
    ("POST", "/v1/sandboxes/{sandbox_id}/snapshots"): "snapshot.create",
    ("DELETE", "/v1/sandboxes/{sandbox_id}/snapshots/{snapshot_id}"): "snapshot.delete",
    ("POST", "/v1/sandboxes/{sandbox_id}/commands"): "sandbox.exec",
    ("POST", "/v1/sandboxes/{sandbox_id}/commands/{cid}/stdin"): "command.stdin",
    ("POST", "/v1/sandboxes/{sandbox_id}/commands/{cid}/signal"): "command.signal",
    ("POST", "/v1/sandboxes/{sandbox_id}/commands/{cid}/resize"): "command.resize",
    ("PUT", "/v1/sandboxes/{sandbox_id}/files"): "file.write",
    ("DELETE", "/v1/sandboxes/{sandbox_id}/files"): "file.delete",
    ("POST", "/v1/sandboxes/{sandbox_id}/files/mkdir"): "file.mkdir",
    ("POST", "/v1/sandboxes/{sandbox_id}/files/move"): "file.move",
    ("POST", "/v1/templates"): "template.save",
    ("PUT", "/v1/templates/blobs/{sha256}"): "template.blob_put",
    ("POST", "/v1/templates/{name}/build"): "template.build",
    ("POST", "/v1/apikeys"): "apikey.create",
    ("DELETE", "/v1/apikeys/{key_id}"): "apikey.delete",
    ("POST", "/v1/nodes"): "node.register",
    ("PUT", "/v1/pools/{template}"): "pool.set",
    ("DELETE", "/v1/pools/{template}"): "pool.delete",
    ("PUT", "/v1/tenants/{tenant}/quota"): "quota.set",
    ("PUT", "/v1/tenants/{tenant}/egress"): "egress.set",
    ("PUT", "/v1/tenants/{tenant}/egress-ceiling"): "egress.ceiling_set",
    ("PUT", "/v1/tenants/{tenant}/backup"): "backup.set",
    ("PUT", "/v1/tenants/{tenant}/key"): "key.set",
    ("POST", "/v1/sandboxes/{sandbox_id}/ports/{port}"): "port.request",
    ("POST", "/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}"): "port.request",
    ("PUT", "/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}"): "port.request",
    ("PATCH", "/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}"): "port.request",
    ("DELETE", "/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}"): "port.request",
    # E2B's control API (space.e2b.control)
    ("POST", "/v2/sandboxes"): "sandbox.create",
    ("POST", "/sandboxes"): "sandbox.create",
    ("POST", "/v2/sandboxes/{sandbox_id}/connect"): "sandbox.connect",
    ("POST", "/sandboxes/{sandbox_id}/connect"): "sandbox.connect",
    ("POST", "/sandboxes/{sandbox_id}/resume"): "sandbox.connect",
    ("DELETE", "/sandboxes/{sandbox_id}"): "sandbox.delete",
    ("POST", "/sandboxes/{sandbox_id}/timeout"): "sandbox.update",
    ("POST", "/sandboxes/{sandbox_id}/pause"): "sandbox.pause",
    ("POST", "/sandboxes/{sandbox_id}/fork"): "sandbox.fork",
    ("PUT", "/sandboxes/{sandbox_id}/network"): "egress.set",
    ("POST", "/sandboxes/{sandbox_id}/tokens/rotate"): "sandbox.rotate_tokens",
    ("POST", "/sandboxes/{sandbox_id}/snapshots"): "snapshot.create",
    ("DELETE", "/templates/{snapshot_id}"): "snapshot.delete",
    ("POST", "/v3/templates"): "template.build_request",
    ("POST", "/v2/templates/{template_id}/builds/{build_id}"): "template.build",
    ("PUT", "/templates/files/{files_hash}"): "template.blob_put",
    # E2B's envd plane (space.e2b.envd): the calls that change something in the sandbox
    ("POST", "/process.Process/Start"): "sandbox.exec",
    ("POST", "/process.Process/SendSignal"): "command.signal",
    ("POST", "/process.Process/SendInput"): "command.stdin",
    ("POST", "/process.Process/StreamInput"): "command.stdin",
    ("POST", "/process.Process/CloseStdin"): "command.stdin",
    ("POST", "/process.Process/Update"): "command.resize",
    ("POST", "/filesystem.Filesystem/MakeDir"): "file.mkdir",
    ("POST", "/filesystem.Filesystem/Move"): "file.move",
    ("POST", "/filesystem.Filesystem/Remove"): "file.delete",
    ("POST", "/files"): "file.write",
}

#: Path parameters, most specific first: the first one present is the target.
_TARGET_PARAMS = ("snapshot_id", "key_id", "sandbox_id", "name", "template", "tenant", "sha256")
_VERBS = {"POST": "create", "PUT": "set", "PATCH": "update", "DELETE": "delete"}


def route_template(scope: Scope) -> str:
    """The matched route's path template, e.g. ``/v1/sandboxes/{sandbox_id}/pause``; for a route
    without one, rebuilt from the path and its parameters; an unmatched path is its own template."""
    route_path = getattr(scope.get("route"), "path", None)
    if isinstance(route_path, str) and route_path.startswith("/"):
        return route_path
    params: dict[str, Any] = scope.get("path_params") or {}
    path: str = scope.get("path", "")
    if not params:
        return path
    by_value = {str(v): k for k, v in params.items()}
    return "/".join(f"{{{by_value[seg]}}}" if seg in by_value else seg for seg in path.split("/"))


def action_for(method: str, template: str) -> str:
    """:data:`ACTIONS`, else the rule ``<resource>.<verb>``: the resource is the last literal
    segment naming a collection (``/v1/widgets/{id}`` → ``widget``), the verb the last literal
    segment after it (``.../{id}/frobnicate`` → ``frobnicate``) or the method's
    (POST create, PUT set, PATCH update, DELETE delete)."""
    known = ACTIONS.get((method, template))
    if known is not None:
        return known
    segs = [s for s in template.split("/") if s][1:]  # drop "v1"
    resource, verb = "", _VERBS.get(method, method.lower())
    for i, seg in enumerate(segs):
        if seg.startswith("{"):
            continue
        nxt = segs[i + 1] if i + 1 < len(segs) else None
        if not resource or (nxt is not None and nxt.startswith("{")):
            resource = seg.removesuffix("s") or seg
        elif nxt is None:
            verb = seg
    return f"{resource or 'api'}.{verb}"


#: Actions whose successful response names what they made.
_NAMES_CREATED = frozenset({"sandbox.create", "snapshot.create", "apikey.create", "node.register", "template.save",
                            "sandbox.exec", "sandbox.fork"})


def _created(action: str, body: Any) -> tuple[str | None, dict[str, Any]]:
    """The id a response names as created, and what else it names worth keeping."""
    if not isinstance(body, dict):
        return None, {}
    if action == "sandbox.create":
        if isinstance(body.get("sandboxID"), str):  # E2B's answer
            return body["sandboxID"], {}
        return _id(body.get("sandbox")), {}
    if action == "snapshot.create":
        if isinstance(body.get("snapshotID"), str):  # E2B's answer
            return body["snapshotID"], {}
        return _id(body.get("snapshot")), {}
    if action in ("apikey.create", "node.register"):
        return _id(body), {}
    if action == "template.save":
        t = body.get("template")
        return (str(t["name"]) if isinstance(t, dict) and t.get("name") else None), {}
    if action == "sandbox.exec":
        return None, {"command": body.get("id")} if body.get("id") else {}
    if action == "sandbox.fork":
        forks = [_id(s) for s in body.get("sandboxes") or []]
        return None, {"sandboxes": [f for f in forks if f], "snapshot": body.get("snapshot")}
    return None, {}


def _id(obj: Any) -> str | None:
    return str(obj["id"]) if isinstance(obj, dict) and obj.get("id") else None


class AuditMiddleware:
    """A plain ASGI middleware: responses and streams pass through untouched; the record is made
    after the last byte was handed to the server, so the call's latency does not include it."""

    def __init__(self, app: ASGIApp, prefix: str = "/v1/", known_only: bool = False) -> None:
        self.app = app
        #: Paths the middleware audits; with ``known_only``, only the calls named in ACTIONS (E2B's
        #: envd plane, where reads are POSTs too).
        self.prefix = prefix
        self.known_only = known_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] not in MUTATING or not scope["path"].startswith(self.prefix)
                or (self.known_only and (scope["method"], scope["path"]) not in ACTIONS)):
            await self.app(scope, receive, send)
            return
        at = dt.datetime.now(dt.UTC)
        scope.setdefault("state", {})  # shared with the request, so the principal lands here
        status = 0
        capture = False
        chunks: list[bytes] = []
        size = 0

        async def send_wrapper(message: Message) -> None:
            nonlocal status, capture, size
            if message["type"] == "http.response.start":
                status = int(message["status"])
                ctype = next((v for k, v in message.get("headers", ()) if k.lower() == b"content-type"), b"")
                capture = ctype.startswith(b"application/json")
            elif message["type"] == "http.response.body" and capture:
                body = message.get("body", b"")
                size += len(body)
                if size > MAX_CAPTURE:
                    capture, chunks[:] = False, []
                else:
                    chunks.append(body)
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            self._record(scope, at, status or 499, b"", failure="cancelled")
            raise
        except Exception:
            # Left to the outer error handler, which answers 500 internal.
            self._record(scope, at, 500, b"", failure="internal")
            raise
        self._record(scope, at, status, b"".join(chunks) if capture else b"")

    def _record(self, scope: Scope, at: dt.datetime, status: int, body: bytes, failure: str | None = None) -> None:
        try:
            app = scope.get("app")
            writer: AuditWriter | None = getattr(getattr(getattr(app, "state", None), "space", None), "audit", None)
            if writer is None or (scope.get("state") or {}).get("audited"):
                return  # the handler's own record of the call is the audit (space.api.secrets)
            writer.record(build_record(scope, at, status, body, failure))
        except Exception as exc:  # the audit must never break a call
            log.error("audit.record_failed", error=repr(exc), path=scope.get("path"))


def build_record(scope: Scope, at: dt.datetime, status: int, body: bytes, failure: str | None = None) -> dict[str, Any]:
    method: str = scope["method"]
    template = route_template(scope)
    action = action_for(method, template)
    params = {str(k): str(v) for k, v in (scope.get("path_params") or {}).items()}
    ok = failure is None and 0 < status < 400
    parsed: Any = None
    if body and (not ok or action in _NAMES_CREATED):  # only then is the body worth parsing
        with contextlib.suppress(ValueError):
            parsed = json.loads(body)
    if ok:
        result = "ok"
    elif failure is not None:
        result = failure
    else:
        err = parsed.get("error") if isinstance(parsed, dict) else None
        code = err.get("code") if isinstance(err, dict) else None
        if code is None and isinstance(parsed, dict):
            # E2B's bodies: {"code": <int>, "message", "error_code"?} (control) or {"code": "<connect
            # code>", "message"} (envd).
            code = parsed.get("error_code") or (parsed.get("code") if isinstance(parsed.get("code"), str) else None)
        result = str(code) if code else f"http_{status}"
    created, extra = _created(action, parsed) if ok else (None, {})
    e2b_route = scope.get("e2b")
    target = created or next((params[p] for p in _TARGET_PARAMS if params.get(p)), "") or str(
        getattr(e2b_route, "sandbox_id", ""))
    who = _principal(scope)
    details: dict[str, Any] = {"method": method, "path": scope.get("path", "")}
    if params:
        details["params"] = params
    headers = {k.lower(): v for k, v in scope.get("headers", ())}
    for header, key in ((b"x-request-id", "request_id"), (b"idempotency-key", "idempotency_key")):
        if header in headers:
            details[key] = headers[header].decode("latin-1")[:256]
    details.update({k: v for k, v in extra.items() if v})
    return {
        "at": at, "tenant": who[0][:128], "actor": who[1][:128], "action": action[:64], "target": target[:512],
        "result": result[:64], "status": status, "details": details,
    }


def _principal(scope: Scope) -> tuple[str, str]:
    who = (scope.get("state") or {}).get("principal")
    if who is None:
        # Refused before its dependencies ran (e.g. a body that is not JSON): name the caller if its
        # key was seen a moment ago, without a database trip.
        who = _cached_principal(scope)
    if who is None:
        return "", "anonymous"
    return str(who.tenant), str(who.key_id)


def _cached_principal(scope: Scope) -> Any:
    headers = dict(scope.get("headers", ()))
    scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if b"x-api-key" in headers:  # E2B's control API
        scheme, key = "bearer", headers[b"x-api-key"].decode("latin-1")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    state = getattr(getattr(scope.get("app"), "state", None), "space", None)
    keys = getattr(state, "keys", None)
    return keys.get(key.strip()) if keys is not None else None


class AuditWriter:
    """Audit records from memory to the store in batches.

    :meth:`record` never blocks and never raises: it appends to a bounded queue (beyond
    ``max_pending`` records, new ones are dropped and counted in :attr:`dropped`, with an error
    logged) and wakes the writer task, which writes up to ``batch`` records per transaction, at most
    ``interval`` seconds after the first one arrived. A failed write is logged and retried with
    backoff, keeping its records. :meth:`aclose` writes what is left (shutdown).
    """

    def __init__(self, store: Store, *, interval: float = 0.1, batch: int = 200, max_pending: int = 20_000,
                 max_backoff: float = 5.0) -> None:
        self.store = store
        self.interval = interval
        self.batch = batch
        self.max_pending = max_pending
        self.max_backoff = max_backoff
        self.dropped = 0
        self.written = 0
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def record(self, values: dict[str, Any]) -> None:
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("audit.queue_full_dropping", dropped=self.dropped, pending=len(self._pending))
            return
        self._pending.append(values)
        self._idle.clear()
        self._wake.set()
        if len(self._pending) >= self.batch:
            self._full.set()
        self._ensure_task()

    def record_many(self, values: Iterable[dict[str, Any]]) -> None:
        for v in values:
            self.record(v)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop yet: the first record made inside one starts the task
            self._task = loop.create_task(self._run(), name="audit-writer")

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything recorded so far is written, at most ``timeout`` seconds; whether
        it was."""
        if not self._pending:
            return True
        self._ensure_task()
        self._full.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def aclose(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._wake.set()
        self._full.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except TimeoutError:
                log.error("audit.unwritten_at_shutdown", records=len(self._pending))
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task

    async def _run(self) -> None:
        backoff, failures = 0.1, 0
        while True:
            if not self._pending:
                self._idle.set()
                if self._closing:
                    return
                await self._wake.wait()
                self._wake.clear()
                continue
            if not self._closing and len(self._pending) < self.batch and not self._full.is_set():
                # Let a batch gather: one transaction for everything of the next ``interval``.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.interval)
            self._full.clear()
            chunk = [self._pending[i] for i in range(min(self.batch, len(self._pending)))]
            try:
                await self.store.record_audit([AuditRecord(**v) for v in chunk])
            except Exception as exc:
                failures += 1
                transient = isinstance(exc, Unavailable | OSError)
                log.error("audit.write_failed", error=repr(exc), records=len(chunk), attempt=failures,
                          retry_in=backoff)
                if (not transient and failures >= 3) or (self._closing and backoff >= self.max_backoff):
                    # Not the database being away: these records cannot be written as they are.
                    log.error("audit.records_dropped", records=len(chunk),
                              actions=sorted({str(v.get("action")) for v in chunk}))
                    self._drop(len(chunk))
                    failures, backoff = 0, 0.1
                    continue
                await asyncio.sleep(backoff)
                backoff = min(self.max_backoff, backoff * 2)
                continue
            failures, backoff = 0, 0.1
            self._drop(len(chunk))
            self.written += len(chunk)

    def _drop(self, n: int) -> None:
        for _ in range(n):
            self._pending.popleft()
