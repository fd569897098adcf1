"""envd's plain HTTP endpoints: ``/files`` (download, upload) and ``/health``.

Both stream through the node and never hold a whole file: a download is relayed chunk by chunk
(gzipped on the way when asked), an upload is handed to the node as it arrives, gunzipped and split
into its multipart parts on the way. Errors are envd's ``{"code": <int>, "message"}`` (the SDK maps
400/401/404/507 to its exceptions), except E2B's edge 502 for a sandbox that is gone.

Auth (``E2B_COMPAT.md`` C.4): ``X-Access-Token``, or a signed URL (``signature`` =
``v1_`` + base64(sha256(``path:read|write:user:token[:expiration]``)), unpadded), checked before
anything is done for the request. A signed URL is checked against the one sandbox it names (by
``E2b-Sandbox-Id``, by host name, or by a ``sandbox_id`` query parameter): one hash. The SDK's
``download_url()`` made with ``E2B_SANDBOX_URL`` names none, and is refused rather than hashed
against every live sandbox's token.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import structlog
from fastapi import APIRouter
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from space.api.state import AppState
from space.e2b import tokens
from space.e2b.connect import ConnectError
from space.e2b.edge import (
    ENVD_PORT,
    EdgeError,
    Route,
    Target,
    access_token_ok,
    edge_error_of,
    http_error,
    json_body,
    route,
    sandbox_row,
    target,
    timed_out,
)
from space.e2b.filesystem import actor, resolve
from space.errors import InsufficientStorage, InvalidRequest, NotFound, PayloadTooLarge, SpaceError
from space.lifecycle import State
from space.store import Sandbox

log = structlog.get_logger("space.e2b.files")

router = APIRouter()

#: Output of one decompression step (bounds what a gzip bomb can make us hold at once).
GUNZIP_STEP: Final = 1 << 20
#: Chunks queued between the request body and one part's upload to the node.
PART_QUEUE: Final = 8
#: A signature's length: ``v1_`` and an unpadded base64 SHA-256. Any other is refused unhashed.
SIGNATURE_LEN: Final = 3 + 43
#: Longest path a signed URL may name (Linux's PATH_MAX): bounds what one check hashes.
MAX_SIGNED_PATH: Final = 4096
NO_SANDBOX: Final = ("this signed URL names no sandbox: send it with the E2b-Sandbox-Id header, add "
                     "sandbox_id=<id> to it, or use the 49983-<id>.<domain> host (space serve --e2b-domain)")


class Refused(Exception):
    """An envd HTTP error answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> Response:
        return http_error(self.status, self.message)


# -- auth ---------------------------------------------------------------------------------------


#: How long a refused upload waits for the guest to drop the file it had begun (see _dropped).
DROP_WAIT: Final = 3.0
#: envd 0.6.2's file metadata (``X-Metadata-<key>: <value>``, kept as ``user.e2b.<key>`` xattrs).
METADATA_HEADER: Final = "x-metadata-"
METADATA_REFUSED: Final = ("file metadata (X-Metadata-* headers) is not supported by SPACE: the sandbox's filesystem "
                           "(gVisor's gofer) refuses extended attributes, so there is nowhere to keep it; nothing "
                           "was written")


def signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{user}:{token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")


def _signed_params(request: Request) -> tuple[str, str, int | None]:
    q = request.query_params
    sig = q.get("signature")
    if sig is None:
        raise Refused(401, "missing signature query parameter")
    raw_exp = q.get("signature_expiration")
    exp = None
    if raw_exp is not None:
        try:
            exp = int(raw_exp)
        except ValueError:
            raise Refused(400, f"invalid signature_expiration {raw_exp!r}") from None
    return sig, q.get("path", ""), exp


def _check_signature(st: AppState, request: Request, sb: Sandbox, operation: str) -> None:
    """A signed URL's signature, made with ``sb``'s envd token: one hash, a constant-time compare."""
    sig, path, exp = _signed_params(request)
    user = request.query_params.get("username", "")
    if len(sig) != SIGNATURE_LEN or len(path) > MAX_SIGNED_PATH or len(user) > 256:
        raise Refused(401, "invalid signature")
    expected = signature(path, operation, user, tokens.envd_token(st.secret, sb), exp)
    if not hmac.compare_digest(expected.encode(), sig.encode("utf-8", "replace")):
        raise Refused(401, "invalid signature")
    if exp is not None and exp < time.time():
        raise Refused(401, "signature is already expired")


async def files_target(st: AppState, request: Request, operation: str) -> Target:
    """The sandbox of a ``/files`` request, its token or signature checked as envd checks them
    before anything is done for it."""
    if request.scope.get("e2b") is None:
        named = request.query_params.get("sandbox_id", "").strip()
        if not named:
            raise Refused(401, NO_SANDBOX)
        request.scope["e2b"] = Route(named, ENVD_PORT)
    sb = await sandbox_row(st, request.scope["e2b"].sandbox_id)
    if request.headers.get("x-access-token"):
        if not access_token_ok(st, request, sb):
            raise Refused(401, "access token present in header but does not match")
    else:
        _check_signature(st, request, sb, operation)
    return await target(st, request, authenticated=sb)


def _user(request: Request, t: Target) -> str | None:
    return request.query_params.get("username") or t.user


def _path(raw: str | None, home: str) -> str:
    try:
        return resolve(raw, home)
    except ConnectError as exc:
        raise Refused(400, exc.message) from None


def _refusal(t: Target, exc: SpaceError, path: str) -> Exception:
    """A node error as envd would answer it (a dead sandbox: the edge's 502)."""
    edge = edge_error_of(t.sandbox.id, exc)
    if edge is not None:
        return edge
    if isinstance(exc, NotFound):
        return Refused(404, f"path '{path}' does not exist")
    if isinstance(exc, InsufficientStorage):
        return Refused(507, f"not enough disk space available: {exc.message}")
    if exc.code == "conflict":
        return Refused(400, f"path is a directory: {path}" if "directory" in exc.message else exc.message)
    if exc.status < 500:
        return Refused(exc.status, exc.message)
    return Refused(500, exc.message)


# -- /health ------------------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> Response:
    """204 when the sandbox runs, E2B's 502 "not found" when not. Only a request with its envd token
    (the SDK sends it) may wake an auto-resuming one; without, the answer is what its row says,
    and nothing is done to it (no wake, no activity)."""
    st: AppState = request.app.state.space
    sb = await sandbox_row(st, route(request).sandbox_id)
    if not access_token_ok(st, request, sb):
        if sb.state != State.RUNNING or timed_out(sb):
            raise EdgeError(sb.id)
        return Response(status_code=204)
    try:
        await target(st, request, authenticated=sb)
    except SpaceError as exc:  # could not wake it, say: reachable it is not
        return http_error(502, exc.message)
    return Response(status_code=204)


# -- download -----------------------------------------------------------------------------------


def _wants_gzip(accept: str | None) -> bool:
    for item in (accept or "").split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() == "gzip":
            q = params.strip()
            return not (q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"))
    return False


@router.get("/files")
async def download(request: Request) -> Response:
    st: AppState = request.app.state.space
    try:
        t = await files_target(st, request, "read")
        who = await actor(st, t.sandbox, _user(request, t))
        path = _path(request.query_params.get("path"), who.home)
        try:
            resp = await t.node.open_stream("GET", f"/v1/sandboxes/{t.sandbox.id}/files", params={"path": path})
        except SpaceError as exc:
            if isinstance(exc, InvalidRequest) and "directory" in exc.message:
                raise Refused(400, f"path '{path}' is a directory") from None
            raise _refusal(t, exc, path) from None
    except Refused as exc:
        return exc.response()
    chunks = resp.aiter_raw()
    first = b""
    gzip = _wants_gzip(request.headers.get("accept-encoding"))
    if gzip:
        # httpx (the SDK's client) accepts gzip by default: compress only what it pays for, as
        # servers do (HTTP lets the answer stay plain). Incompressible data costs ~25 ms/MiB in zlib
        # for nothing.
        try:
            first = await anext(chunks, b"")
        except BaseException:
            await resp.aclose()
            raise
        gzip = _compressible(first)

    async def body() -> AsyncIterator[bytes]:
        comp = zlib.compressobj(6, zlib.DEFLATED, 31) if gzip else None
        try:
            pending = [first] if first else []
            async for chunk in _chain(pending, chunks):
                out = comp.compress(chunk) if comp is not None else chunk
                if out:
                    yield out
            if comp is not None:
                yield comp.flush()
        finally:
            await resp.aclose()

    headers = {"vary": "Accept-Encoding", "cache-control": "no-store"}
    if gzip:
        headers["content-encoding"] = "gzip"
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


#: How much of a download is test-compressed to decide whether gzip pays.
GZIP_SAMPLE: Final = 64 * 1024
#: Gzip only when the sample shrinks below this share of its size.
GZIP_WORTH: Final = 0.9


def _compressible(sample: bytes) -> bool:
    """Whether gzip would shrink data that starts with ``sample`` (an empty file: yes, trivially)."""
    head = sample[:GZIP_SAMPLE]
    if len(head) < 256:
        return True
    return len(zlib.compress(head, 1)) < len(head) * GZIP_WORTH


async def _chain(first: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in first:
        yield chunk
    async for chunk in rest:
        yield chunk


# -- upload -------------------------------------------------------------------------------------


class _Body:
    """The request body as it arrives, gunzipped when it came gzipped; remembers why it failed."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.error: Refused | None = None
        encoding = request.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity", "gzip"):
            raise Refused(400, f"unsupported Content-Encoding {encoding!r} (gzip or none)")
        self.gzip = encoding == "gzip"

    def fail(self, status: int, message: str) -> Refused:
        self.error = Refused(status, message)
        return self.error

    async def chunks(self) -> AsyncIterator[bytes]:
        source = self.request.stream()
        if not self.gzip:
            async for chunk in source:
                if chunk:
                    yield chunk
            return
        d = zlib.decompressobj(31)
        fed = False  # input went into the current gzip member
        async for chunk in source:
            data = chunk
            while data:
                fed = True
                try:
                    out = d.decompress(data, GUNZIP_STEP)
                except zlib.error as exc:
                    raise self.fail(400, f"error decompressing request body: {exc}") from None
                if out:
                    yield out
                if d.eof:  # a member ended; another may follow (Go's reader reads them all)
                    data = d.unused_data
                    d = zlib.decompressobj(31)
                    fed = False
                else:
                    data = d.unconsumed_tail
        if fed and not d.eof:
            raise self.fail(400, "error decompressing request body: unexpected end of gzip data")


async def _write(st: AppState, t: Target, path: str, user: str | None, chunks: AsyncIterator[bytes],
                 body: _Body) -> dict[str, Any]:
    """Stream ``chunks`` to ``path`` through the node; envd's WriteInfo of the file."""
    limit = st.max_upload_bytes

    async def limited() -> AsyncIterator[bytes]:
        total = 0
        async for chunk in chunks:
            total += len(chunk)
            if total > limit:
                # Aborts the upstream request: the guest drops what it wrote.
                raise body.fail(413, f"upload exceeds the limit of {limit} bytes")
            yield chunk

    params = {"path": path, "atomic": "false"}
    if user is not None:
        params["user"] = user
    try:
        await t.node.call("PUT", f"/v1/sandboxes/{t.sandbox.id}/files", params=params, content=limited(),
                          headers={"content-type": "application/octet-stream"}, timeout=3600)
    except PayloadTooLarge as exc:
        raise Refused(413, exc.message) from None
    except SpaceError as exc:
        if body.error is not None:
            await _dropped(t, path)
        raise body.error or _refusal(t, exc, path) from None
    except Exception:
        if body.error is not None:
            await _dropped(t, path)
            raise body.error from None
        raise
    return {"name": path.rsplit("/", 1)[-1], "type": "file", "path": path}


async def _dropped(t: Target, path: str) -> None:
    """After an upload this side aborted (over the limit, a bad gzip body): wait, briefly, for the
    guest to drop the file it had made, so the refusal is not answered while the half-written file
    is still there. (A file that existed before stays, truncated, as envd leaves it: that one the
    deadline ends.) The guest learns of the abort from the node, which this side cannot ask."""
    deadline = time.monotonic() + DROP_WAIT
    pause = 0.01
    while time.monotonic() < deadline:
        try:
            await t.node.call("GET", f"/v1/sandboxes/{t.sandbox.id}/files/stat", params={"path": path})
        except NotFound:
            return
        except SpaceError:
            return  # the sandbox's own trouble: nothing to wait for
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.2)


class _Part:
    """One ``file`` part on its way to the node: its chunks go through a queue to the upload task."""

    def __init__(self, path: str, upload: Callable[[AsyncIterator[bytes]], Any]) -> None:
        self.path = path
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=PART_QUEUE)
        self.task: asyncio.Task[dict[str, Any]] = asyncio.get_running_loop().create_task(upload(self._chunks()))

    async def _chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self.queue.get()) is not None:
            yield chunk

    async def put(self, chunk: bytes | None) -> None:
        """Queue a chunk (None: the end), unless the upload failed already (then raise its error)."""
        put = asyncio.ensure_future(self.queue.put(chunk))
        await asyncio.wait({put, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
            await asyncio.gather(put, return_exceptions=True)
            self.task.result()  # raises the upload's error
            raise Refused(500, f"the upload of {self.path} ended early")

    async def abort(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def _multipart(st: AppState, request: Request, t: Target, who_user: str | None, home: str,
                     body: _Body, boundary: bytes) -> list[dict[str, Any]]:
    """envd's multipart upload: each ``file`` part to ``?path=`` if given, else to its filename."""
    events: list[tuple[str, bytes]] = []

    def note(kind: str) -> Callable[..., None]:
        def cb(data: bytes | None = None, start: int = 0, end: int = 0) -> None:
            events.append((kind, bytes(data[start:end]) if data is not None else b""))
        return cb

    parser = MultipartParser(boundary, {
        "on_part_begin": note("begin"), "on_header_field": note("field"), "on_header_value": note("value"),
        "on_header_end": note("header_end"), "on_headers_finished": note("headers"),
        "on_part_data": note("data"), "on_part_end": note("end"), "on_end": note("finish"),
    })
    written: list[dict[str, Any]] = []
    part: _Part | None = None
    skipping = False
    finished = False
    field, value = bytearray(), bytearray()
    headers: dict[str, bytes] = {}
    given = request.query_params.get("path")
    try:
        async for chunk in body.chunks():
            try:
                parser.write(chunk)
            except MultipartParseError as exc:
                raise Refused(400, f"error reading form: {exc}") from None
            for kind, data in events:
                if kind == "begin":
                    headers, field, value, skipping = {}, bytearray(), bytearray(), False
                elif kind == "field":
                    field += data
                elif kind == "value":
                    value += data
                elif kind == "header_end":
                    headers[field.decode("latin-1").lower()] = bytes(value)
                    field, value = bytearray(), bytearray()
                elif kind == "headers":
                    _, opts = parse_options_header(headers.get("content-disposition", b""))
                    if opts.get(b"name") != b"file":
                        skipping = True
                        continue
                    raw = given if given is not None else opts.get(b"filename", b"").decode("utf-8", "replace")
                    path = _path(raw, home)
                    if any(w["path"] == path for w in written):
                        raise Refused(400, f"you cannot upload multiple files to the same path '{path}' "
                                           "in one upload request, only the first specified file was uploaded")

                    def upload(chunks: AsyncIterator[bytes], path: str = path) -> Any:
                        return _write(st, t, path, who_user, chunks, body)

                    part = _Part(path, upload)
                elif kind == "data" and part is not None and not skipping:
                    await part.put(data)
                elif kind == "end" and part is not None:
                    await part.put(None)
                    written.append(await part.task)
                    part = None
                elif kind == "finish":
                    finished = True
            events.clear()
        if not finished:
            raise Refused(400, "error reading form: the multipart body ended early")
    except BaseException:
        if part is not None:
            await part.abort()
        raise
    return written


@router.post("/files")
async def upload(request: Request) -> Response:
    st: AppState = request.app.state.space
    try:
        t = await files_target(st, request, "write")
        who = await actor(st, t.sandbox, _user(request, t))
        if any(name.startswith(METADATA_HEADER) for name in request.headers):
            raise Refused(400, METADATA_REFUSED)
        body = _Body(request)
        ctype = request.headers.get("content-type", "")
        media, opts = parse_options_header(ctype)
        if media == b"application/octet-stream":
            raw = request.query_params.get("path")
            if raw is None:
                raise Refused(400, "path query parameter is required for raw body upload")
            written = [await _write(st, t, _path(raw, home=who.home), who.user, body.chunks(), body)]
        elif media.startswith(b"multipart/"):
            boundary = opts.get(b"boundary")
            if not boundary:
                raise Refused(400, "multipart body without a boundary")
            written = await _multipart(st, request, t, who.user, who.home, body, boundary)
        else:
            raise Refused(400, f"unsupported content type: {ctype}, expected multipart/form-data or "
                               "application/octet-stream")
    except Refused as exc:
        return exc.response()
    log.info("e2b.files.upload", sandbox=t.sandbox.id, files=len(written))
    return json_body(written)

