"""The format snapshots are shipped in to object storage, and a single-flight for fetching them.

A shipped snapshot is a prefix holding its artifacts (opaque files: a ``btrfs send`` stream, the
runsc checkpoint images...) and ``manifest.json``, sealed with the deployment's manifest key
(:mod:`space.objauth`)::

    {"format": 2, "kind": "snapshot", "mac": {...},
     "body": {"binding": {"tenant", "sandbox_id", "snapshot_id", "prefix"},
              "created_at": "...", "meta": {...},
              "artifacts": [{"name": "rootfs.btrfs.zst", "size": 123, "sha256": "..."}, ...]}}

The manifest is the commit point. It is written only after every artifact was uploaded, and it is
the first thing deleted, both when a snapshot is deleted and when an upload starts over. So a
prefix without a manifest is an upload that never finished and is never restored, and a manifest
never describes data it was not written for. A manifest is opened only with the binding the
reader expects (a valid manifest of another sandbox, tenant, snapshot or place is refused:
:class:`~space.errors.ObjectTampered`), and a download then checks every artifact's size and
sha256 against it before anything uses a byte.

With a :class:`Sealing` (a tenant's key), every artifact is encrypted as it streams up and
decrypted as it streams down (:mod:`space.objcrypt`), under a key that takes two things to make:
the data key the tenant's KMS key wraps (:mod:`space.kms`; the wrapped key is in the manifest) and
the *shred secret* the control plane holds for what the snapshot belongs to, never object storage.
Such a manifest is of kind ``snapshot-encrypted``, which nodes that cannot decrypt refuse::

    "body": {..., "encryption": {"alg": "aes-256-gcm-frames-v1", "frame": 262144,
                                 "key": {"provider": "local", "key_id": "acme", "wrapped": "..."}}}

The sizes and sha256s the manifest records are of the stored (encrypted) bytes, checked before the
last frame is released. A manifest's ``meta.private`` (what a snapshot's metadata holds that is the
tenant's: a sandbox's environment) is encrypted the same way under the name ``manifest.private``
(``{"sealed": "<base64 of one artifact's bytes>"}``) and opened only by a download.

A rotation re-wraps the data key under the tenant's new key (:func:`rewrap_snapshot`): the manifest
is rewritten, the artifacts stay as they are.

This module knows nothing of btrfs or runsc: callers hand it files and byte streams.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import structlog
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from space import failpoints, objcrypt
from space.errors import InvalidRequest, KeyUnavailable, NotFound, ObjectTampered, SnapshotCorrupt
from space.kms import DataKeys, KeyRef, WrappedKey
from space.objauth import ManifestKeys, canonical, check_binding
from space.objstore import IO_CHUNK, ObjectStore, PutResult, check_key

log = structlog.get_logger(__name__)

T = TypeVar("T")

MANIFEST = "manifest.json"
#: The sealed format (:mod:`space.objauth`); format 1 was the same body unsealed.
FORMAT_VERSION = 2
KIND = "snapshot"
KIND_ENCRYPTED = "snapshot-encrypted"
ENCRYPTION_ALG = "aes-256-gcm-frames-v1"
SHRED_BYTES = 32
#: Where a manifest keeps what is the tenant's (encrypted with a sealing), and the name it is encrypted as.
PRIVATE = "private"
_PRIVATE_NAME = "manifest.private"
MAX_PRIVATE_BYTES = 256 * 1024

Progress = Callable[[str], Awaitable[None]]

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Artifact:
    """One file of a snapshot to upload: from a ``path``, or from a ``stream`` factory (called once)."""

    name: str
    path: Path | None = None
    stream: Callable[[], AsyncIterator[bytes]] | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.stream is None):
            raise InvalidRequest(f"artifact {self.name!r} needs exactly one of a path or a stream")


@dataclass(frozen=True)
class Sealing:
    """How a snapshot's artifacts are encrypted: the node's data keys, the tenant's key, and the
    shred secret of what the snapshot belongs to (from the control plane, which alone keeps it)."""

    keys: DataKeys
    ref: KeyRef
    shred: bytes

    def __post_init__(self) -> None:
        if len(self.shred) != SHRED_BYTES:
            raise InvalidRequest(f"a shred secret is {SHRED_BYTES} bytes")


@dataclass(frozen=True)
class SealingSpec:
    """What the control plane sends with a request that ships or fetches a snapshot: the tenant's
    key and the shred secret. A node binds it to its own data keys (:meth:`bind`)."""

    ref: KeyRef
    shred: bytes

    @classmethod
    def from_json(cls, doc: Any) -> SealingSpec:
        """``{"key": {"provider", "key_id"}, "shred": "<base64 of 32 bytes>"}``; InvalidRequest if not."""
        if not isinstance(doc, dict):
            raise InvalidRequest("sealing is an object with a key and a shred secret", field="sealing")
        raw = doc.get("shred")
        try:
            if not isinstance(raw, str) or len(raw) > 64:
                raise ValueError("not a short string")
            shred = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest("shred is base64 of 32 bytes", field="sealing.shred") from None
        if len(shred) != SHRED_BYTES:
            raise InvalidRequest("shred is base64 of 32 bytes", field="sealing.shred")
        return cls(KeyRef.from_json(doc.get("key")), shred)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.ref.to_json(), "shred": base64.b64encode(self.shred).decode()}

    def bind(self, keys: DataKeys | None) -> Sealing:
        if keys is None:
            raise KeyUnavailable(f"this node has no key providers configured, and the snapshot is sealed under "
                                 f"{self.ref.provider} key {self.ref.key_id}", key=self.ref.key_id,
                                 provider=self.ref.provider)
        return Sealing(keys, self.ref, self.shred)


def key_context(binding: dict[str, str]) -> dict[str, str]:
    """What a snapshot's data key is bound to at its KMS (the encryption context)."""
    return {"tenant": binding["tenant"], "sandbox": binding["sandbox_id"], "snapshot": binding["snapshot_id"]}


def _snapshot_key(kms_key: bytes, shred: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=shred, info=b"space-snapshot-key:v1").derive(kms_key)


def _artifact_key(snapshot_key: bytes, binding: dict[str, str], name: str) -> objcrypt.ArtifactKey:
    return objcrypt.ArtifactKey.derive(snapshot_key, objcrypt.identity(canonical(binding), name))


@dataclass(frozen=True)
class ArtifactRecord:
    """An artifact as the manifest records it."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    version: int
    created_at: str
    meta: dict[str, Any]
    artifacts: tuple[ArtifactRecord, ...] = field(default_factory=tuple)
    #: What it was written for (tenant, sandbox, snapshot, its prefix): checked on every read.
    binding: dict[str, str] = field(default_factory=dict)
    #: How its artifacts are encrypted (None: they are not).
    encryption: dict[str, Any] | None = None

    @property
    def total_size(self) -> int:
        return sum(a.size for a in self.artifacts)

    def artifact(self, name: str) -> ArtifactRecord:
        for a in self.artifacts:
            if a.name == name:
                return a
        raise NotFound(f"the snapshot has no artifact {name!r}", artifact=name)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "binding": dict(self.binding),
            "created_at": self.created_at,
            "meta": self.meta,
            "artifacts": [{"name": a.name, "size": a.size, "sha256": a.sha256} for a in self.artifacts],
        }
        if self.encryption is not None:
            body["encryption"] = self.encryption
        return body

    @property
    def wrapped_key(self) -> WrappedKey | None:
        return None if self.encryption is None else WrappedKey.from_json(self.encryption["key"])

    def seal(self, keys: ManifestKeys) -> bytes:
        return keys.seal(KIND if self.encryption is None else KIND_ENCRYPTED, self.body())

    @classmethod
    def open(cls, data: bytes, *, keys: ManifestKeys, prefix: str, binding: dict[str, str]) -> Manifest:
        """Verify and parse the manifest stored at ``prefix``: :class:`ObjectTampered` unless it is
        sealed with this deployment's key for exactly ``binding``; :class:`SnapshotCorrupt` if its
        (authentic) body is malformed."""
        key = f"{prefix}/{MANIFEST}"
        opened = keys.open(data, (KIND, KIND_ENCRYPTED), key=key, what=f"snapshot {prefix}")
        check_binding(opened.body, binding, key=key, what=f"snapshot {prefix}")
        manifest = cls.from_body(opened.body, prefix=prefix)
        if (manifest.encryption is not None) != (opened.kind == KIND_ENCRYPTED):
            raise SnapshotCorrupt(f"snapshot {prefix} has an unreadable manifest: a {opened.kind!r} manifest "
                                  f"{'with' if manifest.encryption else 'without'} an encryption section",
                                  snapshot=prefix)
        return manifest

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str) -> Manifest:
        """Parse a manifest body; anything malformed is :class:`SnapshotCorrupt` naming ``prefix``."""

        def bad(why: str) -> SnapshotCorrupt:
            return SnapshotCorrupt(f"snapshot {prefix} has an unreadable manifest: {why}", snapshot=prefix)

        created_at, meta, raw, binding = body.get("created_at"), body.get("meta"), body.get("artifacts"), \
            body.get("binding", {})
        if not isinstance(created_at, str) or not isinstance(meta, dict) or not isinstance(raw, list):
            raise bad("created_at, meta or artifacts is missing or of the wrong type")
        if not isinstance(binding, dict) or not all(isinstance(v, str) for v in binding.values()):
            raise bad("its binding is not an object of strings")
        records: list[ArtifactRecord] = []
        for item in raw:
            if not isinstance(item, dict):
                raise bad("an artifact entry is not an object")
            name, size, sha = item.get("name"), item.get("size"), item.get("sha256")
            if (not isinstance(name, str) or not _valid_name(name) or isinstance(size, bool)
                    or not isinstance(size, int) or size < 0
                    or not isinstance(sha, str) or not _SHA256_HEX.fullmatch(sha)):
                raise bad(f"artifact entry {item!r} is malformed")
            records.append(ArtifactRecord(name=name, size=size, sha256=sha))
        if len({r.name for r in records}) != len(records):
            raise bad("an artifact is listed twice")
        encryption = body.get("encryption")
        if encryption is not None:
            if (not isinstance(encryption, dict) or encryption.get("alg") != ENCRYPTION_ALG
                    or encryption.get("frame") != objcrypt.FRAME):
                raise bad(f"its encryption section is not {ENCRYPTION_ALG} with {objcrypt.FRAME}-byte frames")
            try:
                WrappedKey.from_json(encryption.get("key"))
            except InvalidRequest as e:
                raise bad(f"its wrapped key is malformed: {e.message}") from None
        return cls(version=FORMAT_VERSION, created_at=created_at, meta=meta, artifacts=tuple(records),
                   binding=dict(binding), encryption=encryption)

    @classmethod
    def parse_legacy(cls, data: bytes, *, prefix: str) -> Manifest:
        """A format-1 (unsealed) manifest, for ``space objects migrate`` only: nothing restores
        from one."""
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SnapshotCorrupt(f"snapshot {prefix} has an unreadable manifest: not JSON ({e})",
                                  snapshot=prefix) from None
        if not isinstance(body, dict) or body.get("format") != 1:
            raise SnapshotCorrupt(f"snapshot {prefix}: its manifest is not a format-1 manifest", snapshot=prefix)
        return cls.from_body({k: v for k, v in body.items() if k != "binding"}, prefix=prefix)


def snapshot_binding(*, tenant: str, sandbox_id: str, snapshot_id: str, prefix: str) -> dict[str, str]:
    """What a snapshot's manifest is bound to: opened anywhere else, it is refused."""
    return {"tenant": tenant, "sandbox_id": sandbox_id, "snapshot_id": snapshot_id, "prefix": _prefix(prefix)}


def _valid_name(name: str) -> bool:
    try:
        check_key(name)
    except InvalidRequest:
        return False
    return name != MANIFEST


def _check_names(names: Sequence[str]) -> None:
    seen: set[str] = set()
    for name in names:
        check_key(name)
        if name == MANIFEST:
            raise InvalidRequest(f"{MANIFEST!r} is reserved for the snapshot's manifest")
        if name in seen:
            raise InvalidRequest(f"artifact {name!r} is given twice")
        seen.add(name)
    # "a" and "a/b" cannot both exist in a directory (the local store, a download destination).
    for name in names:
        if any(other.startswith(name + "/") for other in seen):
            raise InvalidRequest(f"artifact {name!r} is both a file and a directory of other artifacts")


def _prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    if not prefix:
        raise InvalidRequest("a snapshot needs a non-empty object store prefix")
    return check_key(prefix)


async def _progress(on_progress: Progress | None, message: str) -> None:
    if on_progress is not None:
        await on_progress(message)


# ---- upload, read, download, delete -------------------------------------------------------------


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    try:
        f = await asyncio.to_thread(open, path, "rb")
    except FileNotFoundError as e:
        raise NotFound(f"cannot upload {path}: the file does not exist", path=str(path)) from e
    try:
        while chunk := await asyncio.to_thread(f.read, IO_CHUNK):
            yield chunk
    finally:
        f.close()


async def upload_snapshot(store: ObjectStore, prefix: str, artifacts: Sequence[Artifact], meta: dict[str, Any],
                          *, keys: ManifestKeys, binding: dict[str, str], sealing: Sealing | None = None,
                          private: dict[str, Any] | None = None, on_progress: Progress | None = None) -> Manifest:
    """Upload ``artifacts`` under ``prefix``, then commit them by writing the manifest, sealed
    with ``keys`` for ``binding`` (:func:`snapshot_binding`). ``private`` is kept as
    ``meta["private"]``: encrypted with ``sealing``, and returned by :func:`download_snapshot` opened.

    Whatever was under ``prefix`` before (an older manifest first, then the partial data of an
    upload that crashed) is deleted first, so a retry starts clean. If any artifact fails, the
    error propagates and no manifest is written: the snapshot stays unrestorable.
    """
    prefix = _prefix(prefix)
    _check_names([a.name for a in artifacts])
    if binding.get("prefix") != prefix:
        raise InvalidRequest(f"a snapshot manifest at {prefix} must be bound to it, not {binding.get('prefix')!r}")
    await store.delete(f"{prefix}/{MANIFEST}")
    stale = await store.delete_prefix(prefix)
    if stale:
        log.info("snapshot upload: removed stale objects", prefix=prefix, count=stale, store=store.describe())
    encryption: dict[str, Any] | None = None
    snapshot_key: bytes | None = None
    if sealing is not None:
        # A fresh data key per upload (a retry makes another): the KMS wraps it for this snapshot.
        kms_key, wrapped = await sealing.keys.new(sealing.ref, key_context(binding))
        snapshot_key = _snapshot_key(kms_key, sealing.shred)
        encryption = {"alg": ENCRYPTION_ALG, "frame": objcrypt.FRAME, "key": wrapped.to_json()}
    records: list[ArtifactRecord] = []
    for i, art in enumerate(artifacts, 1):
        await _progress(on_progress, f"uploading {art.name} ({i}/{len(artifacts)})")
        key = f"{prefix}/{art.name}"
        result: PutResult
        if snapshot_key is not None:
            if art.path is not None:
                source = _file_chunks(art.path)
            else:
                assert art.stream is not None  # __post_init__ guarantees one of the two
                source = art.stream()
            result = await store.put_stream(
                key, objcrypt.encrypt_stream(_artifact_key(snapshot_key, binding, art.name), source))
        elif art.path is not None:
            result = await store.put_file(key, art.path)
        else:
            assert art.stream is not None  # __post_init__ guarantees one of the two
            result = await store.put_stream(key, art.stream())
        records.append(ArtifactRecord(name=art.name, size=result.size, sha256=result.sha256))
        await _progress(on_progress, f"uploaded {art.name}: {result.size} bytes")
    meta = dict(meta)
    if private is not None:
        meta[PRIVATE] = private if snapshot_key is None else _seal_private(snapshot_key, binding, private)
    manifest = Manifest(version=FORMAT_VERSION, created_at=datetime.now(UTC).isoformat(), meta=meta,
                        artifacts=tuple(records), binding=dict(binding), encryption=encryption)
    await failpoints.hit("artifacts.before_manifest")
    await store.put_bytes(f"{prefix}/{MANIFEST}", manifest.seal(keys))
    log.info("snapshot uploaded", prefix=prefix, artifacts=len(records), bytes=manifest.total_size,
             store=store.describe())
    return manifest


async def read_manifest(store: ObjectStore, prefix: str, *, keys: ManifestKeys,
                        binding: dict[str, str]) -> Manifest:
    """The verified manifest of the snapshot at ``prefix``: :class:`SnapshotCorrupt` if absent or
    unreadable, :class:`ObjectTampered` unless sealed with ``keys`` for exactly ``binding``."""
    prefix = _prefix(prefix)
    key = f"{prefix}/{MANIFEST}"
    try:
        data = await store.get_bytes(key)
    except NotFound:
        raise SnapshotCorrupt(f"snapshot {prefix} has no manifest: its upload never finished",
                              snapshot=prefix) from None
    try:
        return Manifest.open(data, keys=keys, prefix=prefix, binding=binding)
    except ObjectTampered as e:
        log.error("objstore.tampered", key=key, reason=e.details.get("reason"), error=e.message,
                  store=store.describe())
        raise


async def download_snapshot(store: ObjectStore, prefix: str, dest: Path, *, keys: ManifestKeys,
                            binding: dict[str, str], manifest: Manifest | None = None,
                            names: Sequence[str] | None = None, on_progress: Progress | None = None,
                            sealing: Sealing | None = None) -> Manifest:
    """Download the snapshot's artifacts (all, or ``names``) to ``dest/<name>``, each verified
    against its manifest (read and verified here unless the caller passes the one it verified).

    A missing or mismatching artifact is :class:`SnapshotCorrupt` naming the snapshot and the
    artifact; on any failure the files this call wrote are removed.
    """
    prefix = _prefix(prefix)
    if manifest is None:
        manifest = await read_manifest(store, prefix, keys=keys, binding=binding)
    elif manifest.binding != binding:
        raise InvalidRequest(f"the manifest given for {prefix} is bound to {manifest.binding}, not {binding}")
    if names is None:
        wanted = list(manifest.artifacts)
    else:
        wanted = []
        for name in names:
            try:
                wanted.append(manifest.artifact(name))
            except NotFound:
                raise NotFound(f"snapshot {prefix} has no artifact {name!r}", snapshot=prefix,
                               artifact=name) from None
    snapshot_key: bytes | None = None
    wrapped = manifest.wrapped_key
    if wrapped is not None:
        if sealing is None:
            raise KeyUnavailable(f"snapshot {prefix} is encrypted under {wrapped.ref.provider} key "
                                 f"{wrapped.ref.key_id}, and no key for it came with the request",
                                 key=wrapped.ref.key_id, provider=wrapped.ref.provider, snapshot=prefix)
        # Before any byte is fetched: a refused key fails the restore at once, nothing written.
        # The key the manifest names (a tenant that changed keys since reads old snapshots under
        # their own), opened with this request's data keys and shred secret.
        snapshot_key = _snapshot_key(await sealing.keys.open(wrapped, key_context(manifest.binding)), sealing.shred)
        if isinstance(manifest.meta.get(PRIVATE), dict):
            opened = _open_private(snapshot_key, manifest.binding, manifest.meta[PRIVATE], prefix=prefix)
            manifest = dataclasses.replace(manifest, meta={**manifest.meta, PRIVATE: opened})
    written: list[Path] = []
    try:
        for i, rec in enumerate(wanted, 1):
            await _progress(on_progress, f"downloading {rec.name} ({i}/{len(wanted)}, {rec.size} bytes)")
            target = dest / rec.name
            await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
            key = f"{prefix}/{rec.name}"
            try:
                transform = None if snapshot_key is None else objcrypt.Decryptor(
                    _artifact_key(snapshot_key, manifest.binding, rec.name), what=key)
                await store.get_to_file(key, target, expected_sha256=rec.sha256, expected_size=rec.size,
                                        transform=transform)
            except NotFound:
                raise SnapshotCorrupt(f"snapshot {prefix} is corrupt: its artifact {rec.name} is missing",
                                      snapshot=prefix, artifact=rec.name) from None
            except SnapshotCorrupt as e:
                log.error("objstore.artifact_mismatch", key=key, error=e.message, store=store.describe())
                raise SnapshotCorrupt(f"snapshot {prefix} is corrupt: artifact {rec.name}: {e.message}",
                                      snapshot=prefix, artifact=rec.name) from None
            written.append(target)
    except BaseException:
        for path in written:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        raise
    await _progress(on_progress, f"downloaded {len(wanted)} artifacts")
    return manifest


def _seal_private(snapshot_key: bytes, binding: dict[str, str], private: dict[str, Any]) -> dict[str, str]:
    enc = objcrypt.Encryptor(_artifact_key(snapshot_key, binding, _PRIVATE_NAME))
    sealed = enc.update(canonical(private)) + enc.finish()
    return {"sealed": base64.b64encode(sealed).decode()}


def _open_private(snapshot_key: bytes, binding: dict[str, str], stored: dict[str, Any], *,
                  prefix: str) -> dict[str, Any]:
    raw = stored.get("sealed")
    try:
        if not isinstance(raw, str) or len(raw) > MAX_PRIVATE_BYTES * 2:
            raise ValueError("not a bounded string")
        sealed = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise SnapshotCorrupt(f"snapshot {prefix} has an unreadable manifest: its private part is not sealed",
                              snapshot=prefix) from None
    dec = objcrypt.Decryptor(_artifact_key(snapshot_key, binding, _PRIVATE_NAME), what=f"{prefix}/{MANIFEST}")
    plain = dec.update(sealed) + dec.finish()
    try:
        doc = json.loads(plain)
    except (UnicodeDecodeError, json.JSONDecodeError):
        doc = None
    if not isinstance(doc, dict):
        raise SnapshotCorrupt(f"snapshot {prefix} has an unreadable manifest: its private part is not an object",
                              snapshot=prefix)
    return doc


async def rewrap_snapshot(store: ObjectStore, prefix: str, *, keys: ManifestKeys, binding: dict[str, str],
                          data_keys: DataKeys, to: KeyRef) -> KeyRef | None:
    """Wrap the snapshot's data key under ``to`` (a tenant's new key) and rewrite its manifest; its
    artifacts are untouched. Returns the key it was wrapped under before (None: it is not encrypted,
    or is under ``to`` already). The old manifest and the new one each open on their own, so a
    restore that reads either while this runs succeeds."""
    manifest = await read_manifest(store, prefix, keys=keys, binding=binding)
    wrapped = manifest.wrapped_key
    if wrapped is None or wrapped.ref == to:
        return None
    assert manifest.encryption is not None
    new = await data_keys.rewrap(wrapped, to, key_context(manifest.binding))
    rewritten = dataclasses.replace(manifest, encryption={**manifest.encryption, "key": new.to_json()})
    await store.put_bytes(f"{_prefix(prefix)}/{MANIFEST}", rewritten.seal(keys))
    log.info("snapshot.rewrapped", prefix=prefix, key_from=wrapped.ref.key_id, key_to=to.key_id,
             store=store.describe())
    return wrapped.ref


async def delete_snapshot(store: ObjectStore, prefix: str) -> None:
    """Delete a shipped snapshot: the manifest first (it stops being restorable), then the rest."""
    prefix = _prefix(prefix)
    await store.delete(f"{prefix}/{MANIFEST}")
    await store.delete_prefix(prefix)


# ---- single-flight ------------------------------------------------------------------------------


@dataclass
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class SingleFlight:
    """One holder per key: across the tasks of this process and across the processes of this node.

    Inside a process an :class:`asyncio.Lock` per key orders the tasks; between processes an
    ``flock`` on ``<lock_dir>/<key>.lock`` does. A contended ``flock`` is waited for in a thread of
    its own, so neither the event loop nor the shared executor is blocked. Lock files stay (removing
    one while another process waits on it would split the lock in two).
    """

    def __init__(self, lock_dir: Path) -> None:
        self.lock_dir = lock_dir
        self._keys: dict[str, _KeyLock] = {}

    def lock_path(self, key: str) -> Path:
        readable = re.sub(r"[^A-Za-z0-9._-]", "_", key)[:80]
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        return self.lock_dir / f"{readable}-{digest}.lock"

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        entry = self._keys.setdefault(key, _KeyLock())
        entry.users += 1
        try:
            async with entry.lock:
                fd = await _flock(self.lock_path(key))
                try:
                    yield
                finally:
                    # Closing the descriptor releases the flock.
                    os.close(fd)
        finally:
            entry.users -= 1
            if entry.users == 0:
                self._keys.pop(key, None)

    async def once(self, key: str, is_done: Callable[[], Awaitable[bool]],
                   do: Callable[[], Awaitable[T]]) -> T | None:
        """Run ``do`` unless ``is_done``; concurrent callers share one run.

        Returns what ``do`` returned, or None when it was already done (by an earlier call, another
        task or another process). ``is_done`` is asked again once the lock is held.
        """
        if await is_done():
            return None
        async with self.hold(key):
            if await is_done():
                return None
            return await do()


async def _flock(path: Path) -> int:
    """Open ``path`` and take an exclusive flock on it; returns the descriptor that holds it."""
    await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        pass
    except BaseException:
        os.close(fd)
        raise
    waiter = _FlockWaiter(fd, asyncio.get_running_loop())
    await waiter.wait()
    return fd


class _FlockWaiter:
    """A blocking flock in a daemon thread, handed back to the loop; safe against cancellation.

    If the waiting task is cancelled, the thread still gets the lock eventually; whoever comes
    second (the thread finishing, or the task giving up) closes the descriptor, which releases it.
    """

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = fd
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()
        self.mu = threading.Lock()
        self.finished = False
        self.abandoned = False

    async def wait(self) -> None:
        threading.Thread(target=self._run, name=f"flock-{self.fd}", daemon=True).start()
        try:
            await self.future
        except BaseException:
            with self.mu:
                self.abandoned = True
                close_here = self.finished
            if close_here:
                os.close(self.fd)
            raise

    def _run(self) -> None:
        error: OSError | None = None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as e:
            error = e
        with self.mu:
            self.finished = True
            abandoned = self.abandoned
        if abandoned:
            os.close(self.fd)
            return
        try:
            self.loop.call_soon_threadsafe(self._settle, error)
        except RuntimeError:  # the loop is closed: nobody will take this lock
            with self.mu:
                self.abandoned = True
            os.close(self.fd)

    def _settle(self, error: OSError | None) -> None:
        if self.future.done():
            return
        if error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(error)
