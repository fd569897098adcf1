"""The root helper's transport: one verb per unix-socket connection (``docs/notes/privilege-split.md``
2.1 and 2.4).

A frame is a 4-byte big-endian length and a UTF-8 JSON object of at most 1 MiB. The client sends one
request frame, ``{"verb", "args", "timeout", "fds": [role, ...]}``, carrying up to 3 fds in the
same ``sendmsg`` (``SCM_RIGHTS``). The server answers with ``{"line"}`` frames while a streaming verb
runs, then exactly one ``{"ok": true, "result"}`` or ``{"ok": false, "error": {"code", "message",
"details"}}``. Closing the connection cancels the call: the server watches it for EOF while the verb
runs and cancels the verb's task, which kills its children's process groups (:mod:`space.node.
privileged`).

The socket is raw rather than an asyncio stream because a stream's transport reads with plain
``recv`` and the kernel would drop the passed fds. Authentication is the kernel's: ``SO_PEERCRED``
on accept must name the agent's uid (or root, with ``allow_root``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from space.errors import Internal, InvalidRequest, SpaceError, Timeout, Unavailable, from_wire
from space.node import unixsock
from space.node.helper.backend import LineCallback, invoke
from space.node.helper.verbs import HelperContext

log = structlog.get_logger(__name__)

MAX_FRAME = 1 << 20
MAX_FDS = 3
#: A connection that has not sent its whole request by then is dropped (it holds a call slot).
REQUEST_DEADLINE = 10.0
#: How long a stop waits for the verbs it cancelled to finish their cleanup (``runsc delete``
#: takes about a second; its own timeout is 60 s).
CLOSE_DEADLINE = 90.0
#: Client side: how long past the requested timeout the client waits for the helper's own reply.
GRACE = 5.0
_HEADER = struct.Struct(">I")
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def _frame(obj: Mapping[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":"), default=str).encode()
    if len(body) > MAX_FRAME:
        raise InvalidRequest(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(body)) + body


def _no_constant(name: str) -> Any:
    # NaN and Infinity are not JSON, and a NaN timeout would never expire.
    raise ValueError(name)


class _Frames:
    """Splits what a socket delivers into frames."""

    def __init__(self, buf: bytes = b"") -> None:
        self.buf = bytearray(buf)

    def next(self) -> dict[str, Any] | None:
        if len(self.buf) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self.buf)
        if size > MAX_FRAME:
            raise InvalidRequest(f"frame of {size} bytes exceeds {MAX_FRAME}")
        if len(self.buf) < _HEADER.size + size:
            return None
        body = bytes(self.buf[_HEADER.size:_HEADER.size + size])
        del self.buf[:_HEADER.size + size]
        try:
            obj = json.loads(body, parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise InvalidRequest("a frame is not JSON") from None
        if not isinstance(obj, dict):
            raise InvalidRequest("a frame must be a JSON object")
        return obj


async def _ready(sock: socket.socket, *, write: bool) -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)
    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await fut
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


# -- server ---------------------------------------------------------------------------------------


class _PeerGone(Exception):
    """The client closed its end while the verb was sending it a line."""


class HelperServer:
    def __init__(self, ctx: HelperContext, listener: socket.socket, path: Path, *, agent_uid: int,
                 allow_root: bool, max_connections: int) -> None:
        self.ctx, self.path, self.agent_uid, self.allow_root = ctx, path, agent_uid, allow_root
        self._listener = listener
        # Connections beyond the limit are not accepted: they wait in the listen backlog.
        self._slots = asyncio.Semaphore(max_connections)
        self._calls: dict[asyncio.Task[None], socket.socket] = {}
        #: The verbs running now, each once: a stop cancels them and then waits for them.
        self._verbs: set[asyncio.Task[dict[str, Any]]] = set()
        self._closing = False
        self._accepting = asyncio.create_task(self._accept_loop())

    def close(self) -> None:
        """Stop accepting and cancel the verbs in flight (their children are killed).

        Each verb is cancelled once and its connection keeps waiting for it, so that what it does
        when cancelled (``runtime.launch`` deletes the instance it was starting) runs to its end
        before :meth:`wait_closed` returns; cancelling the connections would abandon that work
        half-done, and the process exit would then kill it mid-way."""
        self._closing = True
        self._accepting.cancel()
        for task in self._verbs:
            if not task.cancelling():  # one whose client left is cancelled already: not again
                task.cancel()

    async def wait_closed(self, deadline: float = CLOSE_DEADLINE) -> None:
        """Until every connection has ended; after ``deadline`` seconds the stragglers are cancelled."""
        pending = {self._accepting, *self._calls}
        _, late = await asyncio.wait(pending, timeout=deadline)
        if late:
            log.warning("helper.close_overdue", calls=len(late), after_s=deadline)
            for task in late:
                task.cancel()
            await asyncio.wait(late, timeout=5.0)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # out of fds, say: keep serving the calls in flight
                self._slots.release()
                log.error("helper.accept_failed", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            except BaseException:
                self._slots.release()
                raise
            task = asyncio.create_task(self._serve(conn))
            self._calls[task] = conn
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        # Closed here too: a task cancelled before it started never ran its own finally.
        self._calls.pop(task).close()
        self._slots.release()

    async def _serve(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            pid, uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              _PEERCRED.size))
            if uid != self.agent_uid and not (uid == 0 and self.allow_root):
                log.warning("helper.peer_refused", pid=pid, uid=uid)
                return
            try:
                async with asyncio.timeout(REQUEST_DEADLINE):
                    request, fds = await self._read_request(conn)
            except (TimeoutError, OSError, InvalidRequest) as exc:
                log.warning("helper.bad_request", pid=pid, error=str(exc) or type(exc).__name__)
                return
            if self._closing:
                reply: dict[str, Any] | None = _error(Unavailable("the helper is stopping"))
            else:
                reply = await self._run(conn, request, fds, pid)
            if reply is not None:
                try:
                    data = _frame(reply)
                except InvalidRequest as exc:
                    data = _frame(_error(Internal(f"the verb's reply is too large: {exc.message}")))
                with contextlib.suppress(OSError):
                    await asyncio.get_running_loop().sock_sendall(conn, data)
        except Exception:  # a bug here must not go unnoticed in an unretrieved task
            log.exception("helper.connection_failed")
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()

    async def _read_request(self, conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
        loop = asyncio.get_running_loop()
        while True:  # the fds come with the request's first bytes
            try:
                data, fds, flags, _ = socket.recv_fds(conn, 65536, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
                break
            except BlockingIOError:
                await _ready(conn, write=False)
        frames = _Frames(data)
        try:
            if flags & socket.MSG_CTRUNC:
                raise InvalidRequest(f"at most {MAX_FDS} fds may be passed")
            while (request := frames.next()) is None:
                chunk = await loop.sock_recv(conn, 65536)
                if not chunk:
                    raise InvalidRequest("connection closed before a whole request")
                frames.buf += chunk
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return request, fds

    async def _run(self, conn: socket.socket, request: dict[str, Any], fds: list[int],
                   pid: int) -> dict[str, Any] | None:
        """The call's reply, or None when the client went away (the verb was cancelled)."""
        loop = asyncio.get_running_loop()
        verb, args, timeout, roles = (request.get(k) for k in ("verb", "args", "timeout", "fds"))
        if roles is None:
            roles = []
        if not isinstance(verb, str):
            return _error(InvalidRequest("a request names its verb"))
        if not (timeout is None or (isinstance(timeout, int | float) and not isinstance(timeout, bool))):
            return _error(InvalidRequest("timeout must be a number or null"))
        if not (isinstance(roles, list) and all(isinstance(r, str) for r in roles)
                and len(set(roles)) == len(roles) == len(fds)):
            return _error(InvalidRequest(f"fds must name the role of each of the {len(fds)} fds passed"))

        async def send_line(text: str) -> None:
            try:
                await loop.sock_sendall(conn, _frame({"line": text}))
            except OSError as exc:
                raise _PeerGone() from exc

        call = asyncio.create_task(invoke(self.ctx, verb, args, fds=dict(zip(roles, fds, strict=True)),
                                          on_line=send_line, timeout=timeout, peer_pid=pid))
        self._verbs.add(call)
        call.add_done_callback(self._verbs.discard)
        # A request is one frame: anything the client sends afterwards is its EOF (or misbehaviour).
        watch = asyncio.create_task(loop.sock_recv(conn, 1))
        watch.add_done_callback(lambda t: t.cancelled() or t.exception())  # a reset is an EOF too
        try:
            await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not call.done():
                call.cancel()
                log.info("helper.cancelled", verb=verb, pid=pid)
            # Even when this task is itself cancelled: the verb's reaping must finish first.
            await asyncio.wait({call})
        if call.cancelled():
            return None
        exc = call.exception()
        if exc is None:
            return {"ok": True, "result": call.result()}
        if isinstance(exc, _PeerGone):
            log.info("helper.cancelled", verb=verb, pid=pid)
            return None
        if isinstance(exc, SpaceError):
            return _error(exc)
        log.error("helper.internal_error", verb=verb, pid=pid, exc_info=exc)
        return _error(Internal(f"the helper failed: {type(exc).__name__}", exception=type(exc).__name__))


def _error(exc: SpaceError) -> dict[str, Any]:
    return {"ok": False, "error": {"code": exc.code, "message": exc.message, "details": exc.details}}


async def serve(ctx: HelperContext, socket_path: Path, *, agent_uid: int, allow_root: bool = False,
                socket_gid: int | None = None, max_connections: int = 64) -> HelperServer:
    """Listen on ``socket_path`` (0660, root:``socket_gid``), replacing a stale socket there.

    At most ``max_connections`` calls run at once; further connections wait in the listen backlog.
    """
    listener = _listen(socket_path, socket_gid)
    log.info("helper.listening", socket=str(socket_path), agent_uid=agent_uid, allow_root=allow_root)
    return HelperServer(ctx, listener, socket_path, agent_uid=agent_uid, allow_root=allow_root,
                        max_connections=max_connections)


def _listen(path: Path, gid: int | None) -> socket.socket:
    # Placed once listening, with its final mode and owner (whoever sees the path can connect, and
    # a stale socket is replaced atomically), and never chmodded by a name: space.node.unixsock.
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise InvalidRequest(f"{path} exists and is not a socket", path=str(path))
    return unixsock.bind_listening(path, mode=0o660, gid=gid, flags=socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)


# -- client ---------------------------------------------------------------------------------------


class HelperClient:
    """The :class:`~space.node.helper.backend.Privileged` backend of an unprivileged node agent."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path

    async def call(self, verb: str, args: Mapping[str, Any] | None = None, *,
                   fds: Mapping[str, int] | None = None, on_line: LineCallback | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        passed = dict(fds or {})
        if len(passed) > MAX_FDS:
            raise InvalidRequest(f"at most {MAX_FDS} fds may be passed to {verb}")
        request = _frame({"verb": verb, "args": dict(args or {}), "timeout": timeout, "fds": list(passed)})
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        # Closing the socket, whatever the way out, is what cancels the verb in the helper.
        with sock:
            try:
                async with asyncio.timeout(None if timeout is None else timeout + GRACE):
                    return await self._exchange(sock, request, list(passed.values()), on_line)
            except TimeoutError:
                raise Timeout(f"privileged {verb}: no reply from the helper within {timeout:g}s",
                              verb=verb) from None

    async def _exchange(self, sock: socket.socket, request: bytes, fds: list[int],
                        on_line: LineCallback | None) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(sock, str(self.socket_path))
        except OSError as exc:
            raise Unavailable(f"the root helper is not reachable at {self.socket_path}: {exc.strerror}",
                              socket=str(self.socket_path)) from None
        try:
            while True:  # the fds ride with the first bytes; the rest of a large request follows
                try:
                    sent = socket.send_fds(sock, [request], fds)
                    break
                except BlockingIOError:
                    await _ready(sock, write=True)
            if sent < len(request):
                await loop.sock_sendall(sock, request[sent:])
        except (BrokenPipeError, ConnectionResetError):
            pass  # a helper that refuses us closes at once: what it sent, if anything, is still to read
        frames = _Frames()
        try:
            while True:
                while (frame := frames.next()) is not None:
                    if "line" in frame:
                        maybe = on_line(str(frame["line"])) if on_line is not None else None
                        if maybe is not None:
                            await maybe
                    elif frame.get("ok") is True:
                        return dict(frame.get("result") or {})
                    else:
                        raise _rebuild(frame.get("error"))
                chunk = await loop.sock_recv(sock, 65536)
                if not chunk:
                    break
                frames.buf += chunk
        except ConnectionResetError:
            pass
        raise Unavailable(f"the root helper at {self.socket_path} closed the connection without a reply",
                          socket=str(self.socket_path))


def _rebuild(err: Any) -> SpaceError:
    if not isinstance(err, dict):
        return Internal(f"the helper sent a malformed reply: {str(err)[:200]}")
    details = err.get("details")
    body = {**(details if isinstance(details, dict) else {}), "code": err.get("code"),
            "message": err.get("message", "")}
    return from_wire(500, {"error": body})
