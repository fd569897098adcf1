"""Object storage for SPACE: one small async interface over obstore, for a local directory or S3.

``ObjectStore.from_url`` takes a plain path or ``file://`` URL (a directory on this machine: the
all-in-one setup) or ``s3://bucket/prefix?endpoint=...&region=...&allow_http=...`` (any
S3-compatible store; credentials come from the standard ``AWS_*`` variables, never from the URL, so
URLs are safe to log). Those variables are read from the mapping the caller passes (``env``; by
default this process's environment) and handed to the store as its configuration: the node agent of
``space serve`` gets them on a pipe (:mod:`space.nodesup`), not in its environment.

Keys are ``/``-separated paths relative to the store's root; a key that could escape it (a ``..``
or ``.`` segment, a leading ``/``, a backslash) is refused. Large objects stream both ways: an
upload is a multipart upload fed chunk by chunk, hashed on the fly; a download goes to a temporary
file beside its destination, is checked, then renamed into place, so a reader never sees half a
file.

obstore's errors are translated here and nowhere else: a missing object is
:class:`~space.errors.NotFound`, a store that cannot be reached is
:class:`~space.errors.Unavailable` (retryable), a full disk is
:class:`~space.errors.InsufficientStorage`, and data that does not match what was expected is
:class:`~space.errors.SnapshotCorrupt`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import obstore
from obstore.exceptions import (
    BaseError,
    InvalidPathError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from obstore.store import LocalStore, S3Store

from space.errors import (
    InsufficientStorage,
    Internal,
    InvalidPath,
    InvalidRequest,
    NotFound,
    SnapshotCorrupt,
    SpaceError,
    Unavailable,
)

T = TypeVar("T")

#: Multipart part size. S3 allows 10,000 parts, so this caps one object at ~80 GiB; memory held
#: by one upload is about PART_SIZE * UPLOAD_CONCURRENCY.
PART_SIZE = 8 << 20
UPLOAD_CONCURRENCY = 4
#: Read size for files we upload and the minimum chunk of a download stream.
IO_CHUNK = 1 << 20
#: Chunks at least this large are hashed in a thread (hashlib drops the GIL) so a multi-GiB
#: upload does not stall the event loop for milliseconds per chunk.
_HASH_IN_THREAD = 256 << 10

_S3_QUERY_PARAMS = frozenset({"endpoint", "region", "allow_http"})
#: The ``AWS_*`` variables an S3 store is configured from: obstore's S3Config keys, as variables.
S3_ENV = frozenset(f"AWS_{k.upper()}" for k in (
    "access_key_id", "secret_access_key", "session_token", "token", "default_region", "region", "endpoint",
    "endpoint_url", "endpoint_url_s3", "checksum_algorithm", "conditional_put",
    "container_credentials_relative_uri", "container_credentials_full_uri",
    "container_authorization_token_file", "copy_if_not_exists", "disable_tagging", "imdsv1_fallback",
    "metadata_endpoint", "request_payer", "role_arn", "role_session_name", "s3_express", "server_side_encryption",
    "skip_signature", "sse_bucket_key_enabled", "sse_kms_key_id", "unsigned_payload",
    "virtual_hosted_style_request", "web_identity_token_file",
))
#: Of those, the ones a URL's ``endpoint=`` replaces.
_ENDPOINT_ENV = frozenset({"AWS_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _let_tokio_threads_settle() -> None:
    # obstore's tokio threads hand results back to asyncio by taking the GIL. If the interpreter
    # starts finalizing in the instant between a thread's wake-up write and its re-taking the GIL,
    # CPython ends that Rust thread with pthread_exit and the process dies of SIGABRT (measured:
    # 17 of 30 runs of a script that exits right after a streamed download). Releasing the
    # GIL briefly at exit lets such a thread finish first.
    time.sleep(0.02)


atexit.register(_let_tokio_threads_settle)


class Transform(Protocol):
    """What a download's bytes pass through on their way to the file (a decryptor)."""

    def update(self, data: bytes) -> bytes | bytearray: ...

    def finish(self) -> bytes: ...


@dataclass(frozen=True)
class PutResult:
    """What was stored: its size in bytes and the sha256 (hex) of its content."""

    size: int
    sha256: str


def s3_env(env: Mapping[str, str]) -> dict[str, str]:
    """The ``AWS_*`` settings of an S3 store in ``env`` (credentials among them)."""
    return {k: v for k, v in env.items() if k in S3_ENV}


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """Return ``key`` if it is a safe relative key, else raise :class:`InvalidPath`."""
    if not key:
        if allow_empty:
            return key
        raise InvalidPath("an object key must not be empty")
    if key.startswith("/"):
        raise InvalidPath(f"object key {key!r} must be relative (it starts with '/')")
    if "\\" in key or "#" in key or any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise InvalidPath(f"object key {key!r} contains a character keys may not hold")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidPath(f"object key {key!r} has an empty, '.' or '..' segment")
    return key


def _check_prefix(prefix: str) -> str:
    return check_key(prefix.rstrip("/"), allow_empty=True)


class ObjectStore:
    """An object store (local directory or S3 bucket + prefix) with async, streaming methods."""

    def __init__(self, store: LocalStore | S3Store, *, url: str, description: str) -> None:
        self._store = store
        #: The URL this store was opened from (no credentials: they never go in the URL).
        self.url = url
        self._description = description

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, *, max_retries: int = 5, retry_timeout: float = 60.0,
                 env: Mapping[str, str] | None = None) -> ObjectStore:
        """Open the store a URL names: a path, ``file:///dir`` or ``s3://bucket/prefix?...``.

        ``max_retries`` / ``retry_timeout`` bound how long one S3 request keeps retrying transient
        failures before it fails with :class:`Unavailable`. ``env``: where the ``AWS_*`` settings
        of an S3 store come from (default: this process's environment).
        """
        if not url:
            raise InvalidRequest("the object store URL is empty")
        if "://" not in url:
            return cls._local(Path(url), url)
        parts = urlsplit(url)
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
                raise InvalidRequest(f"a file:// object store URL names a local directory, not {url!r}")
            return cls._local(Path(unquote(parts.path)), url)
        if parts.scheme == "s3":
            return cls._s3(url, max_retries=max_retries, retry_timeout=retry_timeout,
                           env=os.environ if env is None else env)
        raise InvalidRequest(f"unsupported object store URL {url!r}: use a directory path, file:// or s3://")

    @classmethod
    def _local(cls, directory: Path, url: str) -> ObjectStore:
        root = directory.expanduser().absolute()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidRequest(f"cannot create the object store directory {root}: {e.strerror}") from e
        # automatic_cleanup removes directories emptied by deletes, so a deleted snapshot leaves no
        # empty folders behind (the root itself is kept).
        store = LocalStore(root, automatic_cleanup=True)
        return cls(store, url=url, description=f"local directory {root}")

    @classmethod
    def _s3(cls, url: str, *, max_retries: int, retry_timeout: float, env: Mapping[str, str]) -> ObjectStore:
        parts = urlsplit(url)
        if "@" in parts.netloc:
            raise InvalidRequest("credentials do not belong in the object store URL: "
                                 "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead")
        bucket = parts.netloc
        if not bucket:
            raise InvalidRequest(f"the s3:// URL {url!r} names no bucket")
        if parts.fragment:
            raise InvalidRequest(f"the s3:// URL {url!r} has a fragment")
        prefix = _check_prefix(unquote(parts.path).strip("/"))
        query: dict[str, str] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in _S3_QUERY_PARAMS:
                raise InvalidRequest(f"unknown parameter {name!r} in the object store URL; "
                                     f"known: {', '.join(sorted(_S3_QUERY_PARAMS))}")
            query[name] = value
        endpoint = query.get("endpoint")
        if "allow_http" in query:
            flag = query["allow_http"].lower()
            if flag not in _TRUE | _FALSE:
                raise InvalidRequest(f"allow_http must be true or false, not {query['allow_http']!r}")
            allow_http = flag in _TRUE
        else:
            # An explicit http:// endpoint (MinIO, a test server) is consent enough.
            allow_http = bool(endpoint and endpoint.startswith("http://"))
        config: dict[str, Any] = {k.lower(): v for k, v in s3_env(env).items()
                                  if not (endpoint and k in _ENDPOINT_ENV)}
        if endpoint:
            config["endpoint"] = endpoint
        if query.get("region"):
            config.pop("aws_region", None)
            config.pop("aws_default_region", None)
            config["region"] = query["region"]
        try:
            store = S3Store(
                bucket,
                prefix=prefix or None,
                config=config,  # type: ignore[arg-type]  # a plain dict of S3Config keys
                client_options={"allow_http": allow_http},
                retry_config={"max_retries": max_retries, "retry_timeout": timedelta(seconds=retry_timeout)},
            )
        except BaseError as e:
            raise InvalidRequest(f"cannot configure the S3 store {url!r}: {_first_line(e)}") from e
        where = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        extra = ", ".join(f"{k} {v}" for k, v in (("endpoint", endpoint), ("region", query.get("region"))) if v)
        return cls(store, url=url, description=f"{where} ({extra})" if extra else where)

    def describe(self) -> str:
        """A short human description for logs (never contains credentials)."""
        return self._description

    def __repr__(self) -> str:
        return f"ObjectStore({self._description})"

    # ---- small objects --------------------------------------------------------------------------

    async def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` atomically (readers see the old object or the new one)."""
        check_key(key)
        await self._call(key, obstore.put_async(self._store, key, data, use_multipart=False))

    async def get_bytes(self, key: str) -> bytes:
        """The whole content of ``key`` (for small objects such as manifests)."""
        check_key(key)
        result = await self._call(key, obstore.get_async(self._store, key))
        data = await self._call(key, result.bytes_async())
        return bytes(data)

    # ---- streaming ------------------------------------------------------------------------------

    async def put_stream(self, key: str, chunks: AsyncIterator[bytes | bytearray]) -> PutResult:
        """Upload what ``chunks`` yields as one object, holding at most a few parts in memory.

        The object appears only once the whole stream was uploaded; if ``chunks`` raises, the
        upload is abandoned and that exception propagates unchanged. ``chunks`` is consumed and
        closed.
        """
        check_key(key)
        digest = hashlib.sha256()
        size = 0
        source_error: BaseException | None = None

        async def hashed() -> AsyncIterator[bytes | bytearray]:
            nonlocal size, source_error
            try:
                async for chunk in chunks:
                    if not chunk:
                        continue
                    size += len(chunk)
                    if len(chunk) >= _HASH_IN_THREAD:
                        await asyncio.to_thread(digest.update, chunk)
                    else:
                        digest.update(chunk)
                    yield chunk
            except Exception as e:
                source_error = e
                raise

        body = hashed()
        try:
            await self._call(key, obstore.put_async(self._store, key, body, chunk_size=PART_SIZE,
                                                    max_concurrency=UPLOAD_CONCURRENCY))
        except BaseException:
            # The producer's own failure (btrfs send died, a file vanished) is the real cause; do not
            # dress it up as an object store error about ``key``.
            if source_error is not None:
                raise source_error from None
            raise
        finally:
            # obstore may stop pulling midway (a failed part); close both generators so a producer
            # (a subprocess pipe) is torn down now, not whenever the garbage collector runs. One
            # that is still being pulled refuses with RuntimeError: it ends with its puller.
            for gen in (body, chunks):
                aclose = getattr(gen, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(RuntimeError):
                        await aclose()
        return PutResult(size=size, sha256=digest.hexdigest())

    async def put_file(self, key: str, path: Path) -> PutResult:
        """Upload the file at ``path``, streaming it (hashed as it is read)."""
        check_key(key)
        try:
            f = await asyncio.to_thread(open, path, "rb")
        except FileNotFoundError as e:
            raise NotFound(f"cannot upload {path} to {key}: the file does not exist", path=str(path)) from e

        async def read() -> AsyncIterator[bytes]:
            try:
                while chunk := await asyncio.to_thread(f.read, IO_CHUNK):
                    yield chunk
            finally:
                f.close()

        return await self.put_stream(key, read())

    async def get_to_file(self, key: str, path: Path, *, expected_sha256: str | None = None,
                          expected_size: int | None = None, transform: Transform | None = None) -> int:
        """Download ``key`` to ``path``; returns its size.

        The bytes go to a temporary file beside ``path``, are fsynced and checked against
        ``expected_size`` / ``expected_sha256`` (a mismatch is :class:`SnapshotCorrupt`), and only
        then renamed onto ``path``. On any failure nothing is left behind. With ``transform`` (a
        decryptor), what is written is what it makes of the stored bytes, which are what is sized
        and hashed; it may refuse (raise) at any chunk or at the end.
        """
        check_key(key)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
        digest = hashlib.sha256()
        size = 0
        f: IO[bytes] | None = None
        try:
            result = await self._call(key, obstore.get_async(self._store, key))
            out: IO[bytes] = await asyncio.to_thread(open, tmp, "xb")
            f = out

            def write(chunk: bytes) -> None:
                digest.update(chunk)
                out.write(chunk if transform is None else transform.update(chunk))

            stream = result.stream(min_chunk_size=IO_CHUNK)
            while True:
                chunk = await self._call(key, _next_chunk(stream))
                if chunk is None:
                    break
                size += len(chunk)
                if expected_size is not None and size > expected_size:
                    raise SnapshotCorrupt(f"object {key} is larger than the {expected_size} bytes expected",
                                          key=key, expected_size=expected_size)
                await asyncio.to_thread(write, chunk)
            if expected_size is not None and size != expected_size:
                raise SnapshotCorrupt(f"object {key} has {size} bytes, {expected_size} were expected",
                                      key=key, size=size, expected_size=expected_size)
            actual = digest.hexdigest()
            if expected_sha256 is not None and actual != expected_sha256.lower():
                raise SnapshotCorrupt(f"object {key} does not match its checksum: sha256 {actual}, "
                                      f"{expected_sha256} was expected",
                                      key=key, sha256=actual, expected_sha256=expected_sha256)
            if transform is not None:  # the stored bytes are the ones written: now the last of them
                last = transform.finish()
                await asyncio.to_thread(out.write, last)
            await asyncio.to_thread(_flush_and_sync, out)
            await asyncio.to_thread(out.close)
            f = None
            await asyncio.to_thread(os.replace, tmp, path)
            await asyncio.to_thread(_fsync_dir, path.parent)
        except BaseException:
            if f is not None:
                f.close()
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        return size

    async def digest(self, key: str) -> PutResult:
        """The size and sha256 of the object at ``key``, streamed through and hashed (nothing kept)."""
        check_key(key)
        digest = hashlib.sha256()
        size = 0
        result = await self._call(key, obstore.get_async(self._store, key))
        stream = result.stream(min_chunk_size=IO_CHUNK)
        while (chunk := await self._call(key, _next_chunk(stream))) is not None:
            size += len(chunk)
            if len(chunk) >= _HASH_IN_THREAD:
                await asyncio.to_thread(digest.update, chunk)
            else:
                digest.update(chunk)
        return PutResult(size=size, sha256=digest.hexdigest())

    # ---- metadata, listing, deletion ------------------------------------------------------------

    async def exists(self, key: str) -> bool:
        return await self.size(key) is not None

    async def size(self, key: str) -> int | None:
        """The object's size in bytes, or None when there is no object at ``key``."""
        check_key(key)
        try:
            meta = await self._call(key, obstore.head_async(self._store, key))
        except NotFound:
            return None
        return int(meta["size"])

    async def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing object is not an error."""
        check_key(key)
        with contextlib.suppress(NotFound):
            await self._call(key, obstore.delete_async(self._store, key))

    async def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (whole segments: ``a/b`` covers ``a/b/c``, not ``a/bc``), sorted."""
        prefix = _check_prefix(prefix)
        keys: list[str] = []
        stream = obstore.list(self._store, prefix or None, chunk_size=1000)
        while True:
            batch = await self._call(prefix or "/", _next_chunk(stream))
            if batch is None:
                break
            keys.extend(str(meta["path"]) for meta in batch)
        return sorted(keys)

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many there were."""
        prefix = _check_prefix(prefix)
        if not prefix:
            raise InvalidPath("refusing to delete the whole object store: give a prefix")
        keys = await self.list(prefix)
        if not keys:
            return 0
        try:
            await self._call(prefix, obstore.delete_async(self._store, keys))
        except NotFound:
            # A local directory fails a batch when one object already went (a concurrent delete);
            # fall back to one idempotent delete at a time.
            for key in keys:
                await self.delete(key)
        return len(keys)

    # ---- error translation ----------------------------------------------------------------------

    async def _call(self, key: str, op: Awaitable[T]) -> T:
        try:
            return await op
        except SpaceError:
            raise
        except (NotFoundError, FileNotFoundError) as e:
            raise NotFound(f"no object {key} in {self._description}", key=key) from e
        except InvalidPathError as e:
            raise InvalidPath(f"object key {key!r} is not valid: {_first_line(e)}", key=key) from e
        except (PermissionDeniedError, UnauthenticatedError, PermissionError) as e:
            # Credentials or permissions: an operator must act; retrying will not help.
            raise Internal(f"{self._description} refused access to {key}: {_first_line(e)}", key=key) from e
        except (BaseError, OSError) as e:
            text = str(e)
            if "No space left on device" in text or "Disk quota exceeded" in text:
                raise InsufficientStorage(f"{self._description} is full writing {key}", key=key) from e
            raise Unavailable(f"{self._description} failed on {key}: {_first_line(e)}", key=key) from e


async def _next_chunk(stream: Any) -> Any:
    """The next item of an obstore async stream, or None at its end."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _flush_and_sync(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
