"""An in-process fake of the SPACE HTTP API (docs/api.md) behind an ``httpx.MockTransport``.

It is the seam the SDK and CLI tests run against: it speaks the contract's shapes and error
bodies, and keeps its state in dicts. Deliberately small:

- operations finish after ``polls_to_finish`` reads (so the long-poll loop is exercised);
- the template ``broken`` makes sandbox creation and builds fail with ``runtime_error``;
- commands are scripted programs (see ``_run``) whose output is known when they start, except
  ``cat``, which answers once its stdin is closed;
- ``drop_events_after = n`` cuts the first event stream of each command after ``n`` events, in the
  middle of the next one, as a dropped connection would;
- command event streams are frames when the request asks for them (``answer_frames = False``: a
  server that speaks only SSE), else SSE;
- ``requests`` records every request (headers, query, body and the chunks it arrived in).
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import posixpath
import re
import shlex
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio.lowlevel
import httpx

from space import errors, event_frames
from space.lifecycle import Action, State, allowed_actions, require

API_KEY = "sk-test"
URL = "http://space.test"
NOW = "2025-01-01T00:00:00Z"
#: How long a fake event stream waits for a live command (``cat``) before failing the test.
LIVE_DEADLINE = 10.0

JSON = dict[str, Any]


@dataclasses.dataclass
class Seen:
    method: str
    path: str
    params: dict[str, str]
    headers: httpx.Headers
    body: bytes
    chunks: list[bytes]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclasses.dataclass
class FakeCommand:
    info: JSON
    events: list[tuple[str, JSON]] = dataclasses.field(default_factory=list)
    stdin: bytearray = dataclasses.field(default_factory=bytearray)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)
    streams_opened: int = 0

    def emit(self, kind: str, **payload: Any) -> None:
        seq = len(self.events) + 1
        self.events.append((kind, {"seq": seq, **payload}))
        if kind == "exit":
            self.info.update(state="exited", exit_code=payload["exit_code"], signal=payload["signal"],
                             ended_at=NOW)
            self.finished.set()


def encode_event(frames: bool, kind: str, payload: dict[str, Any], event_id: int | None) -> bytes:
    """One event as the server writes it: SSE, or a frame (output unencoded) when asked for frames."""
    if not frames:
        head = f"id: {event_id}\n" if event_id is not None else ""
        return f"{head}event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()
    if kind in ("stdout", "stderr"):
        return event_frames.output(kind, payload["seq"], base64.b64decode(payload["data"]))
    return event_frames.encode(kind, payload)


class EventStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """An event stream body (SSE or frames) serving a command's events after ``after``; may drop
    mid-event."""

    def __init__(self, cmd: FakeCommand, after: int, drop_after: int | None, lead: bytes = b"",
                 frames: bool = False) -> None:
        self.cmd, self.after, self.drop_after, self.lead, self.frames = cmd, after, drop_after, lead, frames

    def _frames(self) -> Iterator[bytes | None]:
        """Frames to send; None means "nothing new yet" (the command is still running)."""
        if self.lead:
            yield self.lead
        sent, pos = 0, self.after
        while True:
            if pos < len(self.cmd.events):
                kind, payload = self.cmd.events[pos]
                pos += 1
                frame = encode_event(self.frames, kind, payload, payload["seq"])
                if self.drop_after is not None and sent == self.drop_after:
                    yield frame[: len(frame) // 2]
                    raise httpx.ReadError("connection reset by peer")
                sent += 1
                yield frame
                if kind == "exit":
                    return
            else:
                yield None

    def __iter__(self) -> Iterator[bytes]:
        for frame in self._frames():
            if frame is None:
                if not self.cmd.finished.wait(LIVE_DEADLINE):
                    raise AssertionError("fake command never finished")
            else:
                yield frame

    async def __aiter__(self) -> AsyncIterator[bytes]:
        deadline = time.monotonic() + LIVE_DEADLINE
        for frame in self._frames():
            if frame is None:
                # The async tests write stdin on the same event loop: yield to it until they did.
                if time.monotonic() > deadline:
                    raise AssertionError("fake command never finished")
                await anyio.lowlevel.checkpoint()
            else:
                yield frame


class ListStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames

    def __iter__(self) -> Iterator[bytes]:
        yield from self.frames

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for frame in self.frames:
            yield frame


class FakeTransport(httpx.MockTransport):
    """A MockTransport that also records the chunks a streamed request body arrived in."""

    def __init__(self, api: FakeAPI) -> None:
        super().__init__(api.handle)
        self.api = api

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        return self.api.serve(request, [bytes(c) for c in request.stream])

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        return self.api.serve(request, [bytes(c) async for c in request.stream])


Route = tuple[str, re.Pattern[str], Callable[..., httpx.Response]]


class FakeAPI:
    def __init__(self) -> None:
        self.requests: list[Seen] = []
        self.sandboxes: dict[str, JSON] = {}
        self.operations: dict[str, JSON] = {}
        self.commands: dict[str, FakeCommand] = {}
        self.files: dict[str, dict[str, bytes]] = {}
        self.dirs: dict[str, set[str]] = {}
        self.tags: dict[str, dict[str, JSON]] = {}
        self.templates: dict[str, JSON] = {
            name: {"name": name, "digest": f"sha256:{name}0", "status": "ready", "size_bytes": 1 << 20,
                   "created_at": NOW, "updated_at": NOW}
            for name in ("base", "broken")
        }
        self.apikeys: dict[str, JSON] = {}
        self.idempotency: dict[str, tuple[str, str]] = {}
        self.polls_to_finish = 1
        self.drop_events_after: int | None = None
        self.answer_frames = True
        self._ids = itertools.count(1)
        self._pending: dict[str, tuple[int, Callable[[JSON], None]]] = {}
        self._routes: list[Route] = []
        r = self._route
        r("GET", r"/healthz", lambda rq: _ok({"status": "ok", "nodes": 1}))
        r("POST", r"/v1/sandboxes", self.create_sandbox)
        r("GET", r"/v1/sandboxes", self.list_sandboxes)
        r("GET", r"/v1/sandboxes/(?P<sid>[^/]+)", lambda rq, sid: _ok(self._sandbox(sid)))
        r("DELETE", r"/v1/sandboxes/(?P<sid>[^/]+)", self.delete_sandbox)
        r("GET", r"/v1/operations/(?P<oid>[^/]+)", self.get_operation)
        r("GET", r"/v1/operations/(?P<oid>[^/]+)/logs", self.operation_logs)
        r("POST", r"/v1/sandboxes/(?P<sid>[^/]+)/commands", self.start_command)
        r("GET", r"/v1/sandboxes/(?P<sid>[^/]+)/commands", self.list_commands)
        r("GET", r"/v1/sandboxes/(?P<sid>[^/]+)/commands/(?P<cid>[^/]+)",
          lambda rq, sid, cid: _ok(self._command(sid, cid).info))
        r("GET", r"/v1/sandboxes/(?P<sid>[^/]+)/commands/(?P<cid>[^/]+)/events", self.command_events)
        r("POST", r"/v1/sandboxes/(?P<sid>[^/]+)/commands/(?P<cid>[^/]+)/stdin", self.command_stdin)
        r("POST", r"/v1/sandboxes/(?P<sid>[^/]+)/commands/(?P<cid>[^/]+)/signal", self.command_signal)
        r("POST", r"/v1/sandboxes/(?P<sid>[^/]+)/commands/(?P<cid>[^/]+)/resize",
          lambda rq, sid, cid: _no_content(self._command(sid, cid)))
        r("GET", r"/v1/sandboxes/(?P<sid>[^/]+)/files", self.read_file)
        r("PUT", r"/v1/sandboxes/(?P<sid>[^/]+)/files", self.write_file)
        r("DELETE", r"/v1/sandboxes/(?P<sid>[^/]+)/files", self.remove_file)
        r("GET", r"/v1/sandboxes/(?P<sid>[^/]+)/files/list", self.list_files)
        r("GET", r"/v1/sandboxes/(?P<sid>[^/]+)/files/stat",
          lambda rq, sid: _ok(self._entry(sid, _path(rq.params["path"]))))
        r("POST", r"/v1/sandboxes/(?P<sid>[^/]+)/files/mkdir", self.mkdir)
        r("POST", r"/v1/sandboxes/(?P<sid>[^/]+)/files/move", self.move)
        r("GET", r"/v1/templates", lambda rq: _ok({"templates": list(self.templates.values())}))
        r("GET", r"/v1/templates/(?P<name>[^/]+)", lambda rq, name: _ok(self._template(name)))
        r("POST", r"/v1/templates/(?P<name>[^/]+)/build", self.build_template)
        r("GET", r"/v1/templates/(?P<name>[^/]+)/tags", lambda rq, name: _ok({"tags": self._template_tags(name)}))
        r("POST", r"/v1/apikeys", self.create_apikey)
        r("GET", r"/v1/apikeys", lambda rq: _ok({"apikeys": [
            {k: v for k, v in key.items() if k != "key"} for key in self.apikeys.values()]}))
        r("DELETE", r"/v1/apikeys/(?P<kid>[^/]+)", self.delete_apikey)

    # ---- plumbing ------------------------------------------------------------------------------

    @property
    def transport(self) -> FakeTransport:
        return FakeTransport(self)

    def _route(self, method: str, pattern: str, fn: Callable[..., httpx.Response]) -> None:
        self._routes.append((method, re.compile(pattern + "$"), fn))

    def _id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids):04d}"

    def handle(self, request: httpx.Request) -> httpx.Response:
        return self.serve(request, [request.read()])

    def serve(self, request: httpx.Request, chunks: list[bytes]) -> httpx.Response:
        seen = Seen(request.method, request.url.path, dict(request.url.params), request.headers,
                    b"".join(chunks), chunks)
        self.requests.append(seen)
        try:
            if seen.path != "/healthz" and request.headers.get("authorization") != f"Bearer {API_KEY}":
                raise errors.Unauthorized("missing or unknown API key")
            for method, pattern, fn in self._routes:
                m = pattern.match(seen.path)
                if m and method == seen.method:
                    return fn(seen, **m.groupdict())
            raise errors.NotFound(f"no route for {seen.method} {seen.path}")
        except errors.SpaceError as exc:
            return httpx.Response(exc.status, json=exc.to_wire())

    def seen(self, method: str, path_suffix: str) -> list[Seen]:
        return [s for s in self.requests if s.method == method and s.path.endswith(path_suffix)]

    # ---- sandboxes and operations --------------------------------------------------------------

    def _sandbox(self, sid: str) -> JSON:
        if sid not in self.sandboxes:
            raise errors.NotFound(f"sandbox {sid} not found")
        return self.sandboxes[sid]

    def _set_state(self, sandbox: JSON, state: State) -> None:
        sandbox.update(state=state.value, allowed_actions=allowed_actions(state), updated_at=NOW)

    def _operation(self, kind: str, target: str, finish: Callable[[JSON], None]) -> JSON:
        op: JSON = {"id": self._id("op"), "kind": kind, "target": target, "status": "running", "error": None,
              "progress": None, "result": None, "created_at": NOW, "updated_at": NOW, "finished_at": None}
        self.operations[op["id"]] = op
        self._pending[op["id"]] = (self.polls_to_finish, finish)
        return op

    def _advance(self, op: JSON, polls: int = 1) -> None:
        if op["id"] not in self._pending:
            return
        left, finish = self._pending.pop(op["id"])
        if left - polls > 0:
            self._pending[op["id"]] = (left - polls, finish)
            return
        finish(op)
        op.update(status="failed" if op["error"] else "succeeded", finished_at=NOW)

    def create_sandbox(self, rq: Seen) -> httpx.Response:
        key = rq.headers.get("idempotency-key")
        if key and key in self.idempotency:
            sid, oid = self.idempotency[key]
            return _ok({"sandbox": self.sandboxes[sid], "operation": self.operations[oid]}, 202)
        body = rq.json()
        template = self._template(body.get("template", "base"))
        sid = self._id("sb")
        sandbox = {"id": sid, "tenant": "acme", "template": template["name"], "cpu": body.get("cpu", 1.0),
                   "memory_mb": body.get("memory_mb", 512), "env": body.get("env", {}),
                   "metadata": body.get("metadata", {}), "node_id": "node-1", "created_at": NOW,
                   "error": None}
        self._set_state(sandbox, State.CREATING)
        self.sandboxes[sid] = sandbox
        self.files[sid], self.dirs[sid] = {}, {"/", "/home", "/home/user"}

        def finish(op: JSON) -> None:
            if template["name"] == "broken":
                error = {"code": "runtime_error", "message": "the guest did not start"}
                op["error"] = sandbox["error"] = error
                self._set_state(sandbox, State.FAILED)
            else:
                self._set_state(sandbox, State.RUNNING)

        op = self._operation("sandbox.create", sid, finish)
        if key:
            self.idempotency[key] = (sid, op["id"])
        return _ok({"sandbox": sandbox, "operation": op}, 202)

    def list_sandboxes(self, rq: Seen) -> httpx.Response:
        state = rq.params.get("state")
        found = [s for s in self.sandboxes.values()
                 if s["state"] == state or (state is None and s["state"] != "terminated")]
        return _ok({"sandboxes": found})

    def delete_sandbox(self, rq: Seen, sid: str) -> httpx.Response:
        sandbox = self._sandbox(sid)
        require(sandbox["state"], Action.DELETE)
        self._set_state(sandbox, State.TERMINATING)
        op = self._operation("sandbox.delete", sid, lambda op: self._set_state(sandbox, State.TERMINATED))
        return _ok({"sandbox": sandbox, "operation": op}, 202)

    def get_operation(self, rq: Seen, oid: str) -> httpx.Response:
        if oid not in self.operations:
            raise errors.NotFound(f"operation {oid} not found")
        self._advance(self.operations[oid])
        return _ok(self.operations[oid])

    def operation_logs(self, rq: Seen, oid: str) -> httpx.Response:
        op = self.operations[oid]
        self._advance(op, polls=1 << 30)
        lines = ["step 1/2: unpacking rootfs", "step 2/2: snapshotting"]
        frames = [f"id: {i}\nevent: log\ndata: {json.dumps({'seq': i, 'line': line})}\n\n".encode()
                  for i, line in enumerate(lines, 1)]
        frames.append(f"event: end\ndata: {json.dumps(op)}\n\n".encode())
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=ListStream(frames))

    # ---- commands ------------------------------------------------------------------------------

    def _command(self, sid: str, cid: str) -> FakeCommand:
        self._sandbox(sid)
        if cid not in self.commands:
            raise errors.NotFound(f"command {cid} not found")
        return self.commands[cid]

    def start_command(self, rq: Seen, sid: str) -> httpx.Response:
        sandbox = self._sandbox(sid)
        require(sandbox["state"], Action.EXEC)
        body = rq.json()
        argv = body["cmd"] if "cmd" in body else shlex.split(body["shell"])
        cid = self._id("cmd")
        info = {"id": cid, "sandbox_id": sid, "pid": 100 + len(self.commands), "attach_token": f"tok-{cid}",
                "state": "running", "argv": argv, "started_at": NOW, "exit_code": None, "signal": None,
                "ended_at": None, "pty": body.get("pty"), "request": body}
        cmd = self.commands[cid] = FakeCommand(info)
        self._run(cmd, argv)
        if "text/event-stream" in rq.headers.get("accept", "") or self._frames(rq):
            # Run in one request: the command's events, led by the command (may drop like a GET).
            cmd.streams_opened += 1
            drop = self.drop_events_after if cmd.streams_opened == 1 else None
            frames = self._frames(rq)
            return httpx.Response(201, headers={"content-type": self._media(frames)},
                                  stream=EventStream(cmd, 0, drop, encode_event(frames, "started", info, None), frames))
        return _ok(info, 201)

    def _run(self, cmd: FakeCommand, argv: list[str]) -> None:
        """The fake's programs: echo, emit OUT ERR CODE, count N, killed SIG, env NAME, cat."""
        prog, args = argv[0], argv[1:]
        if prog == "cat":
            return  # answers when stdin is closed
        if prog == "echo":
            _out(cmd, "stdout", " ".join(args) + "\n")
        elif prog == "emit":
            _out(cmd, "stdout", args[0])
            _out(cmd, "stderr", args[1])
            cmd.emit("exit", exit_code=int(args[2]), signal=None)
            return
        elif prog == "count":
            for i in range(1, int(args[0]) + 1):
                _out(cmd, "stdout", f"line {i}\n")
        elif prog == "killed":
            cmd.emit("exit", exit_code=-int(args[0]), signal=int(args[0]))
            return
        elif prog == "env":
            _out(cmd, "stdout", cmd.info["request"].get("env", {}).get(args[0], ""))
        else:
            _out(cmd, "stderr", f"sh: {prog}: not found\n")
            cmd.emit("exit", exit_code=127, signal=None)
            return
        cmd.emit("exit", exit_code=0, signal=None)

    def list_commands(self, rq: Seen, sid: str) -> httpx.Response:
        self._sandbox(sid)
        return _ok({"commands": [c.info for c in self.commands.values() if c.info["sandbox_id"] == sid]})

    def command_events(self, rq: Seen, sid: str, cid: str) -> httpx.Response:
        cmd = self._command(sid, cid)
        after = int(rq.headers.get("last-event-id") or rq.params.get("after") or 0)
        cmd.streams_opened += 1
        drop = self.drop_events_after if cmd.streams_opened == 1 else None
        frames = self._frames(rq)
        return httpx.Response(200, headers={"content-type": self._media(frames)},
                              stream=EventStream(cmd, after, drop, frames=frames))

    def _frames(self, rq: Seen) -> bool:
        return self.answer_frames and event_frames.wants_frames(rq.headers.get("accept"))

    @staticmethod
    def _media(frames: bool) -> str:
        return event_frames.MEDIA_TYPE if frames else event_frames.SSE_MEDIA_TYPE

    def command_stdin(self, rq: Seen, sid: str, cid: str) -> httpx.Response:
        cmd = self._command(sid, cid)
        if not cmd.info["request"].get("stdin"):
            raise errors.Conflict("stdin of this command is not open")
        cmd.stdin += rq.body
        if rq.params.get("eof") == "true" and not cmd.finished.is_set():
            if cmd.stdin:
                _out(cmd, "stdout", cmd.stdin.decode())
            cmd.emit("exit", exit_code=0, signal=None)
        return httpx.Response(204)

    def command_signal(self, rq: Seen, sid: str, cid: str) -> httpx.Response:
        cmd = self._command(sid, cid)
        if not cmd.finished.is_set():
            cmd.emit("exit", exit_code=-15, signal=15)
        return httpx.Response(204)

    # ---- files ---------------------------------------------------------------------------------

    def _entry(self, sid: str, path: str) -> JSON:
        self._sandbox(sid)
        name = posixpath.basename(path) or "/"
        if path in self.files[sid]:
            kind, size, mode = "file", len(self.files[sid][path]), 0o100644
        elif path in self.dirs[sid]:
            kind, size, mode = "dir", 4096, 0o40755
        else:
            raise errors.NotFound(f"{path}: no such file or directory")
        return {"name": name, "path": path, "type": kind, "size": size, "mode": mode, "mtime": 1735689600.0,
                "owner": "user", "symlink_target": None}

    def read_file(self, rq: Seen, sid: str) -> httpx.Response:
        path = _path(rq.params["path"])
        if self._entry(sid, path)["type"] != "file":
            raise errors.InvalidRequest(f"{path} is a directory")
        data = self.files[sid][path]
        return httpx.Response(200, headers={"content-type": "application/octet-stream"},
                              stream=ListStream([data[i:i + 4096] for i in range(0, len(data), 4096)]))

    def write_file(self, rq: Seen, sid: str) -> httpx.Response:
        path = _path(rq.params["path"])
        self._sandbox(sid)
        parent = posixpath.dirname(path)
        while parent not in self.dirs[sid]:
            self.dirs[sid].add(parent)
            parent = posixpath.dirname(parent)
        self.files[sid][path] = rq.body
        return _ok(self._entry(sid, path))

    def remove_file(self, rq: Seen, sid: str) -> httpx.Response:
        path = _path(rq.params["path"])
        if self._entry(sid, path)["type"] == "dir":
            inside = [p for p in (*self.files[sid], *self.dirs[sid]) if p.startswith(path.rstrip("/") + "/")]
            if inside and rq.params.get("recursive") != "true":
                raise errors.Conflict(f"{path} is not empty")
            for p in inside:
                self.files[sid].pop(p, None)
                self.dirs[sid].discard(p)
            self.dirs[sid].discard(path)
        else:
            del self.files[sid][path]
        return httpx.Response(204)

    def list_files(self, rq: Seen, sid: str) -> httpx.Response:
        root = _path(rq.params["path"])
        depth = int(rq.params.get("depth", 1))
        self._entry(sid, root)
        prefix = root.rstrip("/") + "/"
        found = sorted(p for p in (*self.files[sid], *self.dirs[sid])
                       if p.startswith(prefix) and p[len(prefix):].count("/") < depth)
        return _ok({"entries": [self._entry(sid, p) for p in found]})

    def mkdir(self, rq: Seen, sid: str) -> httpx.Response:
        path = _path(rq.json()["path"])
        self._sandbox(sid)
        self.dirs[sid].add(path)
        return _ok(self._entry(sid, path))

    def move(self, rq: Seen, sid: str) -> httpx.Response:
        body = rq.json()
        src, dst = _path(body["src"]), _path(body["dst"])
        self._entry(sid, src)
        self.files[sid][dst] = self.files[sid].pop(src)
        return _ok(self._entry(sid, dst))

    # ---- templates and API keys ----------------------------------------------------------------

    def _template(self, name: str) -> JSON:
        if name not in self.templates:
            raise errors.NotFound(f"template {name} not found")
        return self.templates[name]

    def build_template(self, rq: Seen, name: str) -> httpx.Response:
        template = self._template(name)
        template["status"] = "building"

        def finish(op: JSON) -> None:
            if name == "broken":
                op["error"] = {"code": "runtime_error", "message": "debootstrap failed"}
                template["status"] = "failed"
            else:
                template.update(status="ready", digest=f"sha256:{name}1")
                op["result"] = {"digest": template["digest"]}

        op = self._operation("template.build", name, finish)
        for tag in rq.json().get("tags") or []:
            self.tags.setdefault(name, {})[tag] = {"tag": tag, "digest": f"sha256:{name}1", "build_id": op["id"],
                                                   "created_at": NOW}
        return _ok({"template": template, "operation": op}, 202)

    def _template_tags(self, name: str) -> list[JSON]:
        self._template(name)
        return list(self.tags.get(name, {}).values())

    def create_apikey(self, rq: Seen) -> httpx.Response:
        body = rq.json()
        if body.get("role", "member") not in ("admin", "member", "readonly"):
            raise errors.ValidationFailed(f"unknown role {body['role']!r}")
        kid = self._id("key")
        key = {"id": kid, "tenant": body["tenant"], "role": body.get("role", "member"),
               "name": body.get("name", ""), "prefix": "sk-abcd", "key": f"sk-abcd{kid}", "created_at": NOW}
        self.apikeys[kid] = key
        return _ok(key, 201)

    def delete_apikey(self, rq: Seen, kid: str) -> httpx.Response:
        if self.apikeys.pop(kid, None) is None:
            raise errors.NotFound(f"API key {kid} not found")
        return httpx.Response(204)


def _ok(body: Any, status: int = 200) -> httpx.Response:
    return httpx.Response(status, json=body)


def _no_content(_: object) -> httpx.Response:
    return httpx.Response(204)


def _out(cmd: FakeCommand, stream: str, text: str) -> None:
    cmd.emit(stream, data=base64.b64encode(text.encode()).decode())


def _path(path: str) -> str:
    if not path.startswith("/") or ".." in path.split("/"):
        raise errors.InvalidPath(f"{path}: not an absolute path inside the sandbox")
    return posixpath.normpath(path)
