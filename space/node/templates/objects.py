"""A template in object storage: its stream, named by the hash of its bytes, and a sealed manifest.

A template is named by its spec digest (what it is made of); its stream is addressed by content::

    templates/<name>-<spec digest>-<stream sha256>.btrfs.zst    the compressed ``btrfs send`` stream
    templates/<name>-<spec digest>.json                        its manifest, sealed (space.objauth)

The manifest binds the name and spec digest to the spec and to the stream's sha256 and size; a
snapshot's manifest binds the same stream hash (the template it was taken on, which its delta
needs). So a node that lacks a template knows, from something sealed with the deployment's key,
exactly which bytes it may receive: a download is hashed as it lands in the cache and refused
(:class:`~space.errors.ObjectTampered`, nothing kept) unless it matches, before ``btrfs receive``
sees a byte. The stream is verified first and received after (not piped into the receive while it
downloads): root never parses a byte nobody vouched for, and a receive of a stream that would turn
out to be wrong cannot leave anything behind (measured cost: docs/notes/object-integrity.md).

Streams written before manifests were sealed (``templates/<name>-<digest>.btrfs.zst``, no
manifest) are never received: ``space objects migrate`` re-authenticates them after checking.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from space import objauth
from space.errors import NotFound, ObjectTampered, RuntimeFailure, SnapshotCorrupt
from space.objauth import ManifestKeys
from space.objstore import IO_CHUNK, ObjectStore

log = structlog.get_logger(__name__)

KIND = "template"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def manifest_key(name: str, digest: str) -> str:
    return f"templates/{name}-{digest}.json"


def stream_key(name: str, digest: str, sha256: str) -> str:
    """Where a template's stream lives: its name carries the hash of its bytes."""
    return f"templates/{name}-{digest}-{sha256}.btrfs.zst"


def legacy_stream_key(name: str, digest: str) -> str:
    """Where streams were written before they were content-addressed (never read now)."""
    return f"templates/{name}-{digest}.btrfs.zst"


def binding(name: str, digest: str) -> dict[str, str]:
    return {"name": name, "spec_digest": digest, "manifest": manifest_key(name, digest)}


@dataclass(frozen=True)
class StreamRef:
    """A template stream, as a sealed manifest names it."""

    sha256: str
    size: int

    def public(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size}

    @classmethod
    def parse(cls, raw: Any, *, where: str) -> StreamRef:
        if (not isinstance(raw, dict) or not isinstance(raw.get("sha256"), str)
                or not _SHA256.fullmatch(raw["sha256"]) or isinstance(raw.get("size"), bool)
                or not isinstance(raw.get("size"), int) or raw["size"] <= 0):
            raise SnapshotCorrupt(f"{where} names a malformed template stream: {raw!r}")
        return cls(sha256=raw["sha256"], size=raw["size"])


@dataclass(frozen=True)
class Published:
    """A template as object storage holds it."""

    name: str
    digest: str
    spec: dict[str, Any]
    stream: StreamRef

    @property
    def stream_key(self) -> str:
        return stream_key(self.name, self.digest, self.stream.sha256)

    def ref(self) -> dict[str, Any]:
        """What a snapshot's manifest records of the template it was taken on."""
        return {"name": self.name, "spec_digest": self.digest, "stream": self.stream.public()}


def parse_ref(raw: Any, *, where: str) -> tuple[str, str, StreamRef]:
    """``(name, spec digest, stream)`` of a snapshot manifest's template reference."""
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(
            raw.get("spec_digest"), str):
        raise SnapshotCorrupt(f"{where} names no template stream")
    return raw["name"], raw["spec_digest"], StreamRef.parse(raw.get("stream"), where=where)


async def read(objects: ObjectStore, keys: ManifestKeys, name: str, digest: str) -> Published | None:
    """The template's sealed manifest: None when there is none, :class:`ObjectTampered` when it
    is not one this deployment sealed for exactly this template."""
    key = manifest_key(name, digest)
    try:
        data = await objects.get_bytes(key)
    except NotFound:
        return None
    what = f"template {name}@{digest[:16]}"
    try:
        opened = keys.open(data, KIND, key=key, what=what)
        objauth.check_binding(opened.body, binding(name, digest), key=key, what=what)
    except ObjectTampered as e:
        log.error("objstore.tampered", key=key, reason=e.details.get("reason"), error=e.message)
        raise
    spec = opened.body.get("spec")
    if not isinstance(spec, dict):
        raise SnapshotCorrupt(f"{what}: its manifest {key} holds no spec")
    return Published(name=name, digest=digest, spec=spec,
                     stream=StreamRef.parse(opened.body.get("stream"), where=f"{what}'s manifest"))


async def has_legacy_stream(objects: ObjectStore, name: str, digest: str) -> bool:
    return await objects.exists(legacy_stream_key(name, digest))


async def fetch(objects: ObjectStore, name: str, digest: str, stream: StreamRef, dest: Path) -> None:
    """Download the stream ``stream`` names to ``dest``, hashed as it lands; a mismatch (or a
    missing object) leaves nothing at ``dest``."""
    key = stream_key(name, digest, stream.sha256)
    try:
        await objects.get_to_file(key, dest, expected_sha256=stream.sha256, expected_size=stream.size)
    except NotFound:
        raise SnapshotCorrupt(f"template {name}@{digest[:16]}: its stream {key} is missing from object "
                              "storage", key=key) from None
    except ObjectTampered:
        raise
    except SnapshotCorrupt as e:
        log.error("objstore.tampered", key=key, reason=objauth.CONTENT_MISMATCH, error=e.message)
        raise objauth.tampered(f"template {name}@{digest[:16]}: its stream {key} is not the one its sealed "
                               f"manifest names ({e.message}); it was not received", key=key,
                               reason=objauth.CONTENT_MISMATCH) from None


async def publish(objects: ObjectStore, keys: ManifestKeys, name: str, digest: str, spec: dict[str, Any],
                  local_stream: Path) -> Published:
    """Upload ``local_stream`` (this node's export of the template) under its content address,
    then its sealed manifest (the commit point). The file is hashed and uploaded through one
    descriptor, so a cache file replaced meanwhile cannot make the name lie."""
    fd = await asyncio.to_thread(os.open, local_stream, os.O_RDONLY | os.O_CLOEXEC)
    try:
        sha, size = await asyncio.to_thread(_hash_fd, fd)
        ref = StreamRef(sha256=sha, size=size)
        key = stream_key(name, digest, sha)
        if await objects.size(key) != size:
            put = await objects.put_stream(key, _read_fd(fd))
            if (put.sha256, put.size) != (sha, size):
                await objects.delete(key)
                raise RuntimeFailure(f"template {name}@{digest[:16]}: its stream changed while it was uploaded",
                                     stream=str(local_stream))
    finally:
        os.close(fd)
    body = {"binding": binding(name, digest), "spec": spec, "stream": ref.public(),
            "created_at": datetime.now(UTC).isoformat()}
    await objects.put_bytes(manifest_key(name, digest), keys.seal(KIND, body))
    log.info("template.stream_published", template=f"{name}@{digest[:16]}", key=key, bytes=size)
    return Published(name=name, digest=digest, spec=spec, stream=ref)


def _hash_fd(fd: int) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, IO_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


async def _read_fd(fd: int) -> AsyncIterator[bytes]:
    offset = 0
    while chunk := await asyncio.to_thread(os.pread, fd, IO_CHUNK, offset):
        offset += len(chunk)
        yield chunk
