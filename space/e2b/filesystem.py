"""envd's ``filesystem.Filesystem`` service over SPACE's file operations and directory watchers.

Paths are resolved as envd resolves them (``~`` and relative paths against the acting user's home),
entries are envd's ``EntryInfo`` in proto3 JSON (``E2B_COMPAT.md`` C.3): ``mode`` holds the
permission bits only, ``permissions`` is Go's ``FileMode.String()``, and a symlink reports what it
leads to (type, permission bits, fully resolved path) as envd does. Watchers live in the guest
(``/v1/sandboxes/{id}/watchers`` on the node); WatchDir is a stream polled from one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import posixpath
import time
from collections.abc import AsyncIterator
from typing import Any, Final

import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from space import paths
from space.api.state import AppState
from space.e2b import connect
from space.e2b.connect import ConnectError, end_of_stream, envelope, field, uint
from space.e2b.edge import NOT_FOUND_MESSAGE, Target, edge_error_of, json_body, target
from space.errors import Conflict, InvalidPath, NotFound, SpaceError
from space.lifecycle import State
from space.store import Sandbox

log = structlog.get_logger("space.e2b.filesystem")

#: The deepest listing the node walks (envd has no limit; deeper asks get this much).
MAX_DEPTH: Final = 32
#: How often WatchDir polls its watcher for events.
WATCH_POLL: Final = 0.15
#: envd's keepalive interval when the client names none.
DEFAULT_KEEPALIVE: Final = 90.0
#: Consecutive failed polls after which a WatchDir stream gives up.
MAX_POLL_FAILURES: Final = 20

_FILE_TYPES: Final = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_EVENT_TYPES: Final = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE", "remove": "EVENT_TYPE_REMOVE",
                       "rename": "EVENT_TYPE_RENAME", "chmod": "EVENT_TYPE_CHMOD"}
_RWX: Final = "rwxrwxrwx"


# -- who acts, and where relative paths lead ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Actor:
    """The user an envd call acts as: ``user`` goes to the node (None: the sandbox's own user),
    ``home`` is where relative paths start."""

    user: str | None
    home: str


#: (template, digest) -> (default user, its home): a template's spec never changes under a digest.
_template_users: dict[tuple[str, str | None], tuple[str | None, str | None]] = {}


async def _template_user(st: AppState, sb: Sandbox) -> tuple[str | None, str | None]:
    key = (sb.template, sb.template_digest)
    known = _template_users.get(key)
    if known is not None:
        return known
    try:
        spec = (await st.store.get_template(sb.template)).spec or {}
    except NotFound:  # a template deleted since: its sandboxes keep running as they were made
        spec = {}
    user = spec.get("user") if isinstance(spec.get("user"), str) and spec.get("user") else None
    home = spec.get("home") if isinstance(spec.get("home"), str) and spec.get("home") else None
    if len(_template_users) > 10_000:
        _template_users.clear()
    _template_users[key] = (user, home)
    return user, home


async def actor(st: AppState, sb: Sandbox, user: str | None) -> Actor:
    """``user`` (None: the template's default user) and the home directory relative paths resolve
    against; homes follow SPACE's template convention (``/root``, else ``/home/<user>``)."""
    default, default_home = await _template_user(st, sb)
    name = user or default or "root"
    if name == default and default_home:
        home = default_home
    else:
        home = "/root" if name == "root" else f"/home/{name}"
    return Actor(user, home)


def resolve(path: Any, home: str, what: str = "path") -> str:
    """envd's ExpandAndResolve: ``~`` is the home, a relative path starts there."""
    if path is None:
        path = ""
    if not isinstance(path, str):
        raise ConnectError("invalid_argument", f"{what} must be a string")
    if path.startswith("~"):
        if len(path) > 1 and path[1] != "/":
            raise ConnectError("invalid_argument", f"cannot expand user-specific home dir in {path!r}")
        path = home + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(home, path)
    try:
        return paths.normalize(path)
    except InvalidPath as exc:
        raise ConnectError("invalid_argument", exc.message) from None


# -- EntryInfo --------------------------------------------------------------------------------


def go_mode_string(kind: str, mode: int) -> str:
    """Go's ``os.FileMode.String()`` for an entry of ``kind`` with ``mode`` (permission, setuid,
    setgid and sticky bits): type letters first (``d``, ``L``, ``u``, ``g``, ``t``, ``?``), then rwx."""
    flags = ""
    if kind == "dir":
        flags += "d"
    elif kind == "symlink":
        flags += "L"
    if mode & 0o4000:
        flags += "u"
    if mode & 0o2000:
        flags += "g"
    if mode & 0o1000:
        flags += "t"
    if kind == "other":
        flags += "?"
    rwx = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate(_RWX))
    return (flags or "-") + rwx


def rfc3339(ts: float) -> str:
    t = dt.datetime.fromtimestamp(ts, dt.UTC)
    frac = f".{t.microsecond:06d}" if t.microsecond else ""
    return t.strftime("%Y-%m-%dT%H:%M:%S") + frac + "Z"


def entry_info(e: dict[str, Any]) -> dict[str, Any]:
    """A guest file entry as envd's ``EntryInfo`` (proto3 JSON)."""
    kind = str(e.get("type") or "other")
    mode = int(e.get("mode") or 0)
    path = str(e.get("path") or "")
    out: dict[str, Any] = {
        "name": str(e.get("name") or ""), "path": path, "size": str(int(e.get("size") or 0)),
        "permissions": go_mode_string(kind, mode),
        "owner": str(e.get("owner") or ""), "group": str(e.get("group") or e.get("owner") or ""),
    }
    if kind == "symlink":
        # envd reports what the link leads to; a broken or looping link has no type.
        resolved = e.get("resolved")
        if isinstance(resolved, dict):
            out["type"] = _FILE_TYPES.get(str(resolved.get("type")), "FILE_TYPE_UNSPECIFIED")
            out["mode"] = int(resolved.get("mode") or 0) & 0o777
            out["symlinkTarget"] = str(resolved.get("path") or path)
        else:
            out["type"] = "FILE_TYPE_UNSPECIFIED"
            out["mode"] = 0
            raw = e.get("symlink_target")
            out["symlinkTarget"] = (posixpath.normpath(posixpath.join(posixpath.dirname(path), raw))
                                    if isinstance(raw, str) and raw else path)
    else:
        out["type"] = _FILE_TYPES.get(kind, "FILE_TYPE_UNSPECIFIED")
        out["mode"] = mode & 0o777
    mtime = e.get("mtime")
    if isinstance(mtime, (int, float)) and mtime:
        out["modifiedTime"] = rfc3339(float(mtime))
    return out


def _is_dir(e: dict[str, Any]) -> bool:
    if e.get("type") == "dir":
        return True
    resolved = e.get("resolved")
    return e.get("type") == "symlink" and isinstance(resolved, dict) and resolved.get("type") == "dir"


# -- talking to the node ----------------------------------------------------------------------


async def node_call(t: Target, method: str, path: str, **kw: Any) -> Any:
    """A node call of this sandbox; a sandbox found dead is E2B's edge 502."""
    try:
        return await t.node.call(method, f"/v1/sandboxes/{t.sandbox.id}{path}", **kw)
    except SpaceError as exc:
        edge = edge_error_of(t.sandbox.id, exc)
        if edge is not None:
            raise edge from None
        raise


async def stat(t: Target, path: str) -> dict[str, Any]:
    res: dict[str, Any] = await node_call(t, "GET", "/files/stat", params={"path": path})
    return res


async def make_dirs(t: Target, path: str, user: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"path": path}
    if user is not None:
        body["user"] = user
    res: dict[str, Any] = await node_call(t, "POST", "/files/mkdir", json_body=body)
    return res


async def _request(st: AppState, request: Request) -> tuple[dict[str, Any], Target, Actor]:
    msg = await connect.unary_request(request)
    t = await target(st, request)
    return msg, t, await actor(st, t.sandbox, t.user)


# -- the RPCs -----------------------------------------------------------------------------------


async def stat_(st: AppState, request: Request) -> Response:
    msg, t, who = await _request(st, request)
    path = resolve(field(msg, "path"), who.home)
    try:
        entry = await stat(t, path)
    except NotFound:
        raise ConnectError("not_found", f"file not found: {path}") from None
    return json_body({"entry": entry_info(entry)})


async def list_dir(st: AppState, request: Request) -> Response:
    msg, t, who = await _request(st, request)
    path = resolve(field(msg, "path"), who.home)
    depth = uint(field(msg, "depth", default=0), "depth") or 1
    if depth < 0:
        raise ConnectError("invalid_argument", "depth must not be negative")
    try:
        res = await node_call(t, "GET", "/files/list", params={"path": path, "depth": min(depth, MAX_DEPTH)})
    except NotFound:
        raise ConnectError("not_found", f"directory not found: {path}") from None
    entries = [entry_info(e) for e in res.get("entries", []) if isinstance(e, dict)]
    return json_body({"entries": entries})


async def make_dir(st: AppState, request: Request) -> Response:
    msg, t, who = await _request(st, request)
    path = resolve(field(msg, "path"), who.home)
    try:
        existing: dict[str, Any] | None = await stat(t, path)
    except NotFound:
        existing = None
    if existing is not None:
        if _is_dir(existing):
            raise ConnectError("already_exists", f"directory already exists: {path}")
        raise ConnectError("invalid_argument", f"path already exists but it is not a directory: {path}")
    try:
        entry = await make_dirs(t, path, who.user)
    except Conflict as exc:  # a file somewhere along the way
        raise ConnectError("invalid_argument", exc.message) from None
    return json_body({"entry": entry_info(entry)})


async def move(st: AppState, request: Request) -> Response:
    msg, t, who = await _request(st, request)
    src = resolve(field(msg, "source"), who.home, "source")
    dst = resolve(field(msg, "destination"), who.home, "destination")
    body = {"src": src, "dst": dst}
    try:
        entry = await node_call(t, "POST", "/files/move", json_body=body)
    except NotFound:
        # envd creates the destination's directories; the source is what must exist.
        try:
            await stat(t, src)
        except NotFound:
            raise ConnectError("not_found", f"source file not found: {src}") from None
        parent = posixpath.dirname(dst)
        try:
            await make_dirs(t, parent, who.user)
        except Conflict as exc:
            raise ConnectError("invalid_argument", exc.message) from None
        entry = await node_call(t, "POST", "/files/move", json_body=body)
    return json_body({"entry": entry_info(entry)})


async def remove(st: AppState, request: Request) -> Response:
    msg, t, who = await _request(st, request)
    path = resolve(field(msg, "path"), who.home)
    with contextlib.suppress(NotFound):  # envd's RemoveAll: nothing there is done too
        await node_call(t, "DELETE", "/files", params={"path": path, "recursive": "true"})
    return json_body({})


# -- watchers -----------------------------------------------------------------------------------


def _watch_request(msg: dict[str, Any], home: str) -> dict[str, Any]:
    return {"path": resolve(field(msg, "path"), home), "recursive": bool(field(msg, "recursive", default=False)),
            "entry": bool(field(msg, "includeEntry", "include_entry", default=False))}


async def _create_watcher(t: Target, body: dict[str, Any]) -> str:
    try:
        res = await node_call(t, "POST", "/watchers", json_body=body)
    except NotFound:
        raise ConnectError("not_found", f"path not found: {body['path']}") from None
    return str(res["id"])


def _event(ev: dict[str, Any]) -> dict[str, Any] | None:
    kind = _EVENT_TYPES.get(str(ev.get("type")))
    if kind is None:
        return None
    out: dict[str, Any] = {"name": str(ev.get("name") or ""), "type": kind}
    if isinstance(ev.get("entry"), dict):
        out["entry"] = entry_info(ev["entry"])
    return out


async def _poll(t: Target, wid: str) -> list[dict[str, Any]]:
    try:
        res = await node_call(t, "GET", f"/watchers/{wid}/events")
    except NotFound:
        raise ConnectError("not_found", f"watcher {wid} not found") from None
    if res.get("overflowed"):
        log.warning("e2b.watch.overflowed", sandbox=t.sandbox.id, watcher=wid)
    return [e for e in (_event(ev) for ev in res.get("events", []) if isinstance(ev, dict)) if e is not None]


def _watcher_id(msg: dict[str, Any]) -> str:
    wid = field(msg, "watcherId", "watcher_id")
    if not isinstance(wid, str) or not wid:
        raise ConnectError("invalid_argument", "watcher_id is required")
    return wid


async def create_watcher(st: AppState, request: Request) -> Response:
    msg, t, who = await _request(st, request)
    wid = await _create_watcher(t, _watch_request(msg, who.home))
    return json_body({"watcherId": wid})


async def get_watcher_events(st: AppState, request: Request) -> Response:
    msg, t, _ = await _request(st, request)
    return json_body({"events": await _poll(t, _watcher_id(msg))})


async def remove_watcher(st: AppState, request: Request) -> Response:
    msg, t, _ = await _request(st, request)
    wid = _watcher_id(msg)
    try:
        await node_call(t, "DELETE", f"/watchers/{wid}")
    except NotFound:
        raise ConnectError("not_found", f"watcher {wid} not found") from None
    return json_body({})


#: Watcher removals started by streams that ended (kept referenced until they finish).
_cleanups: set[asyncio.Task[None]] = set()


def _drop_later(t: Target, wid: str) -> None:
    """Remove a stream's watcher in a task of its own: the stream's own task may be cancelled."""

    async def drop() -> None:
        try:
            await t.node.call("DELETE", f"/v1/sandboxes/{t.sandbox.id}/watchers/{wid}")
        except Exception as exc:  # best effort: the guest drops watchers nobody polls
            log.info("e2b.watch.not_removed", sandbox=t.sandbox.id, watcher=wid, error=repr(exc))

    task = asyncio.get_running_loop().create_task(drop())
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)


def _keepalive(request: Request) -> float:
    try:
        value = float(request.headers.get("keepalive-ping-interval", ""))
    except ValueError:
        return DEFAULT_KEEPALIVE
    return min(max(value, 1.0), 3600.0)


async def _sandbox_running(st: AppState, sandbox_id: str) -> bool:
    try:
        sb = await st.store.get_sandbox(sandbox_id)
    except NotFound:
        return False
    return sb.state == State.RUNNING


async def watch_dir(st: AppState, request: Request) -> Response:
    msg = await connect.first_stream_request(request)
    t = await target(st, request)
    who = await actor(st, t.sandbox, t.user)
    wid = await _create_watcher(t, _watch_request(msg, who.home))
    keepalive = _keepalive(request)
    timeout = connect.timeout_seconds(request)
    deadline = None if timeout is None else time.monotonic() + timeout
    log.info("e2b.watch.start", sandbox=t.sandbox.id, watcher=wid)

    async def envelopes() -> AsyncIterator[bytes]:
        try:
            yield envelope({"start": {}})
            quiet_since = time.monotonic()
            failures = 0
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    yield end_of_stream(ConnectError("deadline_exceeded", "the watch ran out of its time"))
                    return
                if await request.is_disconnected():
                    return
                try:
                    events = await _poll(t, wid)
                    failures = 0
                except ConnectError as exc:  # the watcher is gone (the guest dropped it)
                    yield end_of_stream(exc)
                    return
                except Exception as exc:  # any failure: the sandbox may be gone
                    failures += 1
                    if not await _sandbox_running(st, t.sandbox.id):
                        yield end_of_stream(ConnectError(
                            "unavailable", f"{NOT_FOUND_MESSAGE}: sandbox {t.sandbox.id} stopped"))
                        return
                    if failures >= MAX_POLL_FAILURES:
                        yield end_of_stream(ConnectError("unavailable", f"watching failed: {exc}"))
                        return
                    events = []
                for ev in events:
                    yield envelope({"filesystem": ev})
                now = time.monotonic()
                if events:
                    quiet_since = now
                elif now - quiet_since >= keepalive:
                    yield envelope({"keepalive": {}})
                    quiet_since = now
                await asyncio.sleep(WATCH_POLL)
        finally:
            _drop_later(t, wid)
            log.info("e2b.watch.end", sandbox=t.sandbox.id, watcher=wid)

    return StreamingResponse(envelopes(), media_type=connect.STREAM_TYPE,
                             headers={"cache-control": "no-store", "x-accel-buffering": "no"})


RPCS: Final[dict[str, Any]] = {
    "Stat": stat_, "ListDir": list_dir, "MakeDir": make_dir, "Move": move, "Remove": remove,
    "CreateWatcher": create_watcher, "GetWatcherEvents": get_watcher_events, "RemoveWatcher": remove_watcher,
    "WatchDir": watch_dir,
}
