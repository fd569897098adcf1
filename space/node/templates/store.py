"""Templates: read-only root filesystems that every sandbox root is a snapshot of.

A template is defined by a *spec* (a dict, see :data:`BASE_SPEC`) and identified by its digest, so
the same spec never builds twice. :meth:`TemplateStore.ensure` materializes one, cheapest way
first:

1. a ready template with that digest is in the pool → returned as is;
2. the node's cache holds its exported stream (``<cache>/templates/<name>-<digest>.btrfs.zst``)
   → ``zstd -d`` here into the root helper's ``stream.receive`` (seconds);
3. object storage holds it (:mod:`space.node.templates.objects`: a stream addressed by the hash of
   its bytes, named by a manifest sealed with the deployment's key) → downloaded into the cache as
   ``<name>-<digest>-<sha256>.btrfs.zst``, verified, then received;
4. else it is built (debootstrap, then user and mount points, then cleanup: the helper's
   ``template.*`` verbs), published atomically
   as a read-only snapshot, and exported to the cache for the next pool on this machine.

A caller that knows which stream it needs (a restore: the snapshot's sealed manifest names the
template stream its delta was taken against) passes it; then only those bytes are received.

Readiness is the manifest ``templates/<name>@<digest16>.json``, written only once the subvolume is
read-only and complete. Materialization is single-flight: one asyncio lock per digest in a process
and one ``flock`` per digest across processes; whatever a crash leaves behind (a tmp build, a
partial receive) is deleted by the next ensure.

A received template keeps the identity (received UUID) of the subvolume that was sent, which is why
it is received and then moved into ``templates/`` instead of being snapshotted there: ``btrfs send
-p <template>`` deltas from any pool that shares the stream then apply on this one. The helper
receives into a staging dir of its own and moves only the one subvolume the store asked for.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import copy
import functools
import hashlib
import json
import os
import re
import stat
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Final

import structlog

from space import objauth
from space.errors import (
    InvalidRequest,
    NotFound,
    ObjectTampered,
    RuntimeFailure,
    SnapshotCorrupt,
    SpaceError,
    Unavailable,
    ValidationFailed,
)
from space.node.helper import build_scripts, verbs_template
from space.node.storage import shipping
from space.node.storage.pool import Pool, check_name, file_lock
from space.node.templates import build as template_build
from space.node.templates import objects as template_objects
from space.node.templates import spec as template_spec
from space.node.templates.logins import Logins
from space.node.templates.objects import Published, StreamRef
from space.objauth import ManifestKeys
from space.objstore import ObjectStore

if TYPE_CHECKING:
    from space.node.network.build_net import BuildNetwork

log = structlog.get_logger(__name__)

DEFAULT_CACHE_DIR: Final = Path("/var/cache/space")
USER_UID: Final = build_scripts.USER_UID

#: The spec of the ``base`` template. Copy it before changing it: every key is part of the digest.
BASE_SPEC: Final[dict[str, Any]] = {
    "name": "base",
    "suite": "bookworm",
    "mirror": "http://deb.debian.org/debian",
    # python-is-python3: `python` too, as E2B's base has it (agent code runs `python x.py`).
    "packages": ["python3", "python-is-python3", "bash", "coreutils", "procps", "git", "curl", "ca-certificates"],
    "user": "user",
    "home": "/home/user",
    # The user may sudo (through the guest daemon: space/guest/guest_sudo.py), as on E2B's base.
    "sudo": True,
}

Progress = Callable[[str], Awaitable[None]]
#: Populates ``target`` (an empty subvolume) from ``spec``; ``cache_dir`` is the node's cache.
Builder = Callable[[dict[str, Any], Path, Path, Progress], Awaitable[None]]

_SUITE = re.compile(r"[a-z][a-z0-9-]{0,31}")
_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.:-]{0,99}")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_MIRROR = verbs_template.MIRROR_RE


def spec_digest(spec: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``spec`` (sorted keys, no whitespace)."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def validate_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Check the fields the builder turns into paths and command arguments; return a private copy.

    Extra keys are allowed (they are part of the digest) so richer specs can grow without
    breaking older nodes' digests.
    """
    if not isinstance(spec, dict):
        raise ValidationFailed("template spec must be an object")
    spec = copy.deepcopy(spec)
    if template_spec.is_derived(spec) or template_spec.is_saved(spec) or template_spec.is_image(spec):
        # The forms of space/node/templates/spec.py: derived from a template, from a container
        # image, saved from a sandbox.
        template_spec.validate_node_spec(spec, validate_spec, digest_of=spec_digest)
        return spec
    missing = [k for k in ("name", "suite", "mirror", "packages", "user", "home") if k not in spec]
    if missing:
        raise ValidationFailed(f"template spec lacks {', '.join(missing)}", fields=missing)

    def bad(key: str, why: str) -> ValidationFailed:
        return ValidationFailed(f"template spec field {key!r} {why}", field=key)

    try:
        check_name(str(spec["name"]), "template name")
    except SpaceError:
        raise bad("name", "must be a simple name ([A-Za-z0-9._-])") from None
    if not isinstance(spec["suite"], str) or not _SUITE.fullmatch(spec["suite"]):
        raise bad("suite", "must be a Debian suite name")
    if not isinstance(spec["mirror"], str) or not _MIRROR.fullmatch(spec["mirror"]):
        raise bad("mirror", "must be an http(s):// or file:// URL")
    pkgs = spec["packages"]
    if not isinstance(pkgs, list) or not all(isinstance(p, str) and _PACKAGE.fullmatch(p) for p in pkgs):
        raise bad("packages", "must be a list of Debian package names")
    if not isinstance(spec["user"], str) or not _USER.fullmatch(spec["user"]):
        raise bad("user", "must be a POSIX user name")
    home = spec["home"]
    if (
        not isinstance(home, str)
        or not home.startswith("/")
        or str(PurePosixPath(home)) != home
        or ".." in PurePosixPath(home).parts
        or not re.fullmatch(r"[A-Za-z0-9._/-]+", home)
    ):
        raise bad("home", "must be a normalized absolute path")
    if not isinstance(spec.get("sudo", False), bool):
        raise bad("sudo", "must be true or false")
    template_spec.check_build_fields(spec)
    return spec


@dataclass(frozen=True)
class TemplateInfo:
    name: str
    digest: str
    path: Path
    size_bytes: int
    created_at: datetime
    spec: dict[str, Any] = field(default_factory=dict)
    #: How it got here: "build", "receive" or "recovered" (complete but unrecorded after a crash).
    source: str = "build"
    seconds: float | None = None

    @property
    def label(self) -> str:
        return f"{self.name}@{self.digest[:16]}"


@dataclass
class _Flight:
    """One digest being materialized in this process: the lock, and whoever waits for it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    listeners: list[Progress] = field(default_factory=list)
    users: int = 0
    completed: int = 0

    async def emit(self, line: str) -> None:
        log.debug("template.progress", line=line)
        for listener in list(self.listeners):
            try:
                await listener(line)
            except Exception:
                # A listener that broke (a client hung up) must not fail the build others wait on.
                log.warning("template.progress_listener_failed", exc_info=True)
                with contextlib.suppress(ValueError):
                    self.listeners.remove(listener)


class TemplateStore:
    def __init__(self, pool: Pool, cache_dir: Path = DEFAULT_CACHE_DIR, *, builder: Builder | None = None,
                 objects: ObjectStore | None = None, keys: ManifestKeys | None = None):
        if objects is not None and keys is None:
            raise objauth.ManifestKeyError("a template store with an object store needs the manifest key")
        self.pool = pool
        self.cache_dir = cache_dir
        self.objects = objects
        self.keys = keys
        self._builder: Builder = builder or functools.partial(debootstrap_builder, pool=pool)
        self._flights: dict[str, _Flight] = {}
        #: Templates this node made (built, or received from the host cache) and has yet to publish.
        self._unshared: dict[str, bool] = {}
        #: Template streams this process fetched from object storage (single-flight shows here).
        self.downloads = 0
        #: The network of build steps (their only way out: the node's egress gateway); None: the
        #: steps run without network.
        self.build_net: BuildNetwork | None = None

    # -- queries -------------------------------------------------------------------------------

    async def list(self) -> builtins.list[TemplateInfo]:
        """Ready templates on this node (those with a manifest and their subvolume)."""
        return await asyncio.to_thread(self._scan)

    async def get(self, name: str) -> TemplateInfo | None:
        """The newest ready template called ``name``."""
        found = [t for t in await self.list() if t.name == name]
        return max(found, key=lambda t: t.created_at) if found else None

    def _scan(self) -> builtins.list[TemplateInfo]:
        out = []
        for manifest in (self.pool.root / "templates").glob("*@*.json"):
            info = _read_manifest(manifest)
            if info is not None:
                out.append(info)
        return sorted(out, key=lambda t: (t.name, t.created_at))

    def stream_path(self, name: str, digest: str) -> Path:
        """This node's own export of the template (what a build leaves for the next pool here)."""
        return self.cache_dir / "templates" / f"{name}-{digest}.btrfs.zst"

    def verified_path(self, name: str, digest: str, sha256: str) -> Path:
        """A stream downloaded from object storage, kept under the hash it was verified against."""
        return self.cache_dir / "templates" / f"{name}-{digest}-{sha256}.btrfs.zst"

    # -- ensure --------------------------------------------------------------------------------

    async def ensure(
        self, spec: dict[str, Any], *, on_progress: Progress | None = None, force: bool = False,
        stream: StreamRef | None = None, registry_auth: Logins | None = None,
    ) -> TemplateInfo:
        """Materialize the template of ``spec``; with ``stream`` (what a sealed snapshot manifest
        names), a node that lacks it receives exactly that stream or fails. ``registry_auth``: the
        logins a build pulls the spec's images with (:mod:`space.node.templates.logins`)."""
        spec = validate_spec(spec)
        digest = spec_digest(spec)
        label = f"{spec['name']}@{digest[:16]}"
        flight = self._flights.setdefault(digest, _Flight())
        flight.users += 1
        if on_progress is not None:
            flight.listeners.append(on_progress)
        try:
            seen = flight.completed
            if flight.lock.locked() and on_progress is not None:
                await on_progress(f"template {label}: waiting for the materialization already running")
            async with flight.lock:
                # A force that waited for someone else's fresh build is satisfied by it.
                force = force and flight.completed == seen

                async def contended() -> None:
                    await flight.emit(f"template {label}: waiting for another process materializing it")

                lock = self.cache_dir / "locks" / f"{digest}.lock"
                async with file_lock(lock, on_contended=contended):
                    info = await self._ensure_locked(spec, digest, flight.emit, on_progress, force, stream,
                                                     registry_auth)
                if self._unshared.pop(digest, False):
                    await self._share(spec["name"], digest, flight.emit)  # takes the file lock itself
                flight.completed += 1
                return info
        finally:
            with contextlib.suppress(ValueError):
                if on_progress is not None:
                    flight.listeners.remove(on_progress)
            flight.users -= 1
            if flight.users == 0:
                self._flights.pop(digest, None)

    async def _ensure_locked(
        self, spec: dict[str, Any], digest: str, emit: Progress, own: Progress | None, force: bool,
        want: StreamRef | None, registry_auth: Logins | None = None,
    ) -> TemplateInfo:
        """``emit`` reaches every caller waiting on this digest; ``own`` only this one (a waiter
        that watched the build need not tell the others it found the result)."""
        name = spec["name"]
        final = self.pool.template_path(name, digest)
        manifest = _manifest_path(final)
        label = f"{name}@{digest[:16]}"
        if force and template_spec.is_saved(spec):
            raise InvalidRequest(f"template {label} was saved from a sandbox: it cannot be rebuilt")
        if force:
            await emit(f"template {label}: forced rebuild")
            await self._delete(final)
        else:
            info = _read_manifest(manifest)
            if info is not None:
                if own is not None:
                    await own(f"template {label}: ready (cached, no rebuild)")
                log.info("template.ready", template=label, source="cached")
                return info
            if await self.pool.is_subvolume(final):
                if await self.pool.is_readonly(final):
                    # Published (snapshot -r or a finished receive) but the manifest was not written.
                    await emit(f"template {label}: adopting a complete template left by an interruption")
                    return await self._publish_manifest(spec, digest, source="recovered", seconds=None)
                await self.pool.delete_subvolume(final)  # a partial receive

        stream = self.stream_path(name, digest)
        fetched_from_objects: Path | None = None
        if not force and self.objects is not None:
            # What object storage holds comes first, even with a stream of this node's own in the
            # cache (the host's, from another pool): every node must receive the same stream, since
            # a sandbox's disk ships as a delta against its template, which the receiving node finds
            # by the template's identity. Raises when object storage holds something unauthentic:
            # that is never received, nor papered over by a build.
            try:
                fetched_from_objects = await self._fetch(spec, digest, want, emit)
            except Unavailable as exc:
                if want is not None or not stream.exists():
                    raise
                log.warning("template.objects_unavailable", template=label, error=exc.message,
                            hint="received from this node's cache: its sandboxes may not move to other nodes")
            if fetched_from_objects is not None:
                stream = fetched_from_objects
        elif want is not None and not force:
            raise SnapshotCorrupt(f"template {label} is not on this node and there is no object store to fetch "
                                  "the stream the snapshot needs from", template=name)
        if stream.exists() and not force:
            try:
                received = await self._receive(spec, digest, stream, emit)
                if fetched_from_objects is None:
                    self._unshared[digest] = True
                return received
            except SpaceError as exc:
                log.warning("template.receive_failed", template=label, error=str(exc))
                await emit(f"template {label}: cached stream unusable ({exc.message}); rebuilding")
                await self._delete(final)
                stream.unlink(missing_ok=True)
        if want is not None:
            raise SnapshotCorrupt(f"template {label}: the stream the snapshot was taken on (sha256 "
                                  f"{want.sha256[:16]}) could not be received; a rebuild would not match it",
                                  template=name)
        if template_spec.is_saved(spec):
            raise NotFound(f"template {label} was saved from sandbox {spec['sandbox']} and cannot be rebuilt; "
                           "its stream is not in object storage (nor in this node's cache)", template=name)
        built = await self._build(spec, digest, emit, registry_auth)
        self._unshared[digest] = True
        return built

    async def _share(self, name: str, digest: str, emit: Progress) -> None:
        """Publish a template this node made (built, or received from the host cache) to object
        storage, so the other nodes of the deployment download it instead of building it again.
        A failure is logged, not raised: this node has the template either way."""
        if self.objects is None or self.keys is None:
            return
        try:
            await self.publish(self.objects, name, digest, on_progress=emit)
        except SpaceError as exc:
            log.warning("template.share_failed", template=f"{name}@{digest[:16]}", error=exc.message)

    async def _fetch(self, spec: dict[str, Any], digest: str, want: StreamRef | None,
                     emit: Progress) -> Path | None:
        """The verified stream of the template in this node's cache, downloading it from object
        storage if need be; None when object storage does not have it (and nobody needs exactly it)."""
        assert self.objects is not None and self.keys is not None
        name = spec["name"]
        label = f"{name}@{digest[:16]}"
        if want is None:
            published = await template_objects.read(self.objects, self.keys, name, digest)
            if published is None:
                if await template_objects.has_legacy_stream(self.objects, name, digest):
                    log.warning("objstore.unauthenticated_ignored", template=label,
                                key=template_objects.legacy_stream_key(name, digest))
                    if template_spec.is_saved(spec):
                        key = template_objects.legacy_stream_key(name, digest)
                        raise objauth.tampered(
                            f"template {label}: object storage holds only an unauthenticated stream ({key}); "
                            f"it is not received: {objauth.MIGRATE_HINT}", key=key, reason=objauth.UNAUTHENTICATED)
                    await emit(f"template {label}: object storage holds only an unauthenticated stream from "
                               "before streams were sealed; ignored (`space objects migrate` re-authenticates it)")
                return None
            if spec_digest(published.spec) != digest:
                key = template_objects.manifest_key(name, digest)
                raise objauth.tampered(f"template {label}: its sealed manifest {key} holds another spec",
                                       key=key, reason=objauth.BOUND_ELSEWHERE)
            want = published.stream
        dest = self.verified_path(name, digest, want.sha256)
        if dest.exists():
            return dest
        key = template_objects.stream_key(name, digest, want.sha256)
        await emit(f"template {label}: downloading from object storage ({want.size / 1e6:.0f} MB)")
        started = time.monotonic()
        dest.parent.mkdir(parents=True, exist_ok=True)
        await template_objects.fetch(self.objects, name, digest, want, dest)
        self.downloads += 1
        log.info("template.downloaded", template=label, key=key, bytes=want.size,
                 seconds=round(time.monotonic() - started, 2))
        return dest

    async def publish(self, objects: ObjectStore, name: str, digest: str, *,
                      on_progress: Progress | None = None) -> Published:
        """Make sure object storage holds this template (its stream and sealed manifest), so any
        node can materialize it; what it holds, as a snapshot's manifest names it."""
        assert self.keys is not None
        info = _read_manifest(_manifest_path(self.pool.template_path(name, digest)))
        if info is None or info.digest != digest:
            raise NotFound(f"template {name}@{digest[:16]} is not on this node", template=name)
        try:
            published = await template_objects.read(objects, self.keys, name, digest)
        except ObjectTampered as exc:
            # This node has the real template: what it publishes replaces what was planted.
            log.warning("objstore.tampered_replaced", template=f"{name}@{digest[:16]}", key=exc.details.get("key"),
                        reason=exc.details.get("reason"))
            published = None
        if published is not None and spec_digest(published.spec) == digest \
                and await objects.size(published.stream_key) == published.stream.size:
            return published
        stream = self.stream_path(name, digest)
        lock = self.cache_dir / "locks" / f"{digest}.lock"
        async with file_lock(lock):
            if not stream.exists():
                await self._export(info.path, stream, on_progress or _quiet)
            if not stream.exists():
                raise RuntimeFailure(f"template {name}@{digest[:16]} could not be exported for upload")
            if on_progress is not None:
                await on_progress(f"template {name}@{digest[:16]}: uploading to object storage")
            published = await template_objects.publish(objects, self.keys, name, digest, info.spec, stream)
        log.info("template.published", template=f"{name}@{digest[:16]}", key=published.stream_key)
        return published

    async def _receive(self, spec: dict[str, Any], digest: str, stream: Path, emit: Progress) -> TemplateInfo:
        final = self.pool.template_path(spec["name"], digest)
        label = final.name
        size_mb = _file_bytes(stream) / 1e6
        await emit(f"[1/2] receive {label} from the cache stream ({size_mb:.0f} MB compressed)")
        started = time.monotonic()
        # The stream must hold exactly this template (it could name any subvolume otherwise).
        await shipping.receive_compressed(self.pool, stream, final.parent, final.name)
        if not await self.pool.is_subvolume(final) or not await self.pool.is_readonly(final):
            raise RuntimeFailure(f"the cache stream did not produce a read-only {label}", stream=str(stream))
        seconds = time.monotonic() - started
        info = await self._publish_manifest(spec, digest, source="receive", seconds=seconds)
        await emit(f"[2/2] template {label} ready (received in {seconds:.1f}s)")
        log.info("template.received", template=label, seconds=round(seconds, 2))
        return info

    async def _build(self, spec: dict[str, Any], digest: str, emit: Progress,
                     registry_auth: Logins | None = None) -> TemplateInfo:
        final = self.pool.template_path(spec["name"], digest)
        label = final.name
        work = self.pool.tmp_dir / f"build-{label}"
        await self.pool.delete_subvolume(work)  # an interrupted build's leftovers
        started = time.monotonic()
        log.info("template.build_started", template=label)
        try:
            if template_spec.is_derived(spec) or template_spec.is_image(spec) or template_spec.has_build_steps(spec):
                await template_build.build_custom(self, spec, work, emit, registry_auth=registry_auth)
            else:
                await self.pool.begin_build(work)
                await self._builder(spec, work, self.cache_dir, emit)
                await emit(f"[4/4] publish {label}")
            # A read-only snapshot is the atomic publish: the final path only ever appears complete.
            await self.pool.finish_build(work, final)
        except BaseException as exc:
            log.warning("template.build_failed", template=label, error=str(exc) or type(exc).__name__)
            raise
        finally:
            await asyncio.shield(self.pool.delete_subvolume(work))
        seconds = time.monotonic() - started
        info = await self._publish_manifest(spec, digest, source="build", seconds=seconds)
        await emit(f"template {label} built in {seconds:.0f}s ({info.size_bytes / 1e6:.0f} MB)")
        log.info("template.built", template=label, seconds=round(seconds, 1), size_bytes=info.size_bytes)
        await self._export(final, self.stream_path(spec["name"], digest), emit)
        return info

    async def _export(self, final: Path, stream: Path, emit: Progress) -> None:
        """Write the template's send stream to the cache; a failure only costs the next pool a build."""
        stream.parent.mkdir(parents=True, exist_ok=True)
        partial = stream.with_name(stream.name + ".tmp")
        started = time.monotonic()
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                async with shipping.compressed_send(self.pool, final, stdout=fd):
                    pass
            finally:
                os.close(fd)
            os.replace(partial, stream)
        except SpaceError as exc:
            partial.unlink(missing_ok=True)
            log.warning("template.export_failed", template=final.name, error=str(exc))
            await emit(f"template {final.name}: exporting to the cache failed ({exc.message})")
            return
        seconds = time.monotonic() - started
        await emit(f"template {final.name}: exported to {stream} ({_file_bytes(stream) / 1e6:.0f} MB)")
        log.info("template.exported", template=final.name, stream=str(stream), seconds=round(seconds, 2))

    async def _publish_manifest(
        self, spec: dict[str, Any], digest: str, *, source: str, seconds: float | None
    ) -> TemplateInfo:
        final = self.pool.template_path(spec["name"], digest)
        info = TemplateInfo(
            name=spec["name"],
            digest=digest,
            path=final,
            size_bytes=(await self.pool.priv.call("tree.size", {"rel": shipping.pool_rel(self.pool, final)}))["bytes"],
            created_at=datetime.now(UTC),
            spec=spec,
            source=source,
            seconds=round(seconds, 3) if seconds is not None else None,
        )
        await asyncio.to_thread(_write_manifest, info)
        return info

    # -- removal -------------------------------------------------------------------------------

    async def remove(self, name: str, digest: str) -> None:
        """Delete a template from the pool (idempotent). The cached stream stays: it is a cache.

        Sandboxes made from it keep working: their roots are independent snapshots.
        """
        final = self.pool.template_path(name, digest)
        recorded = _read_manifest(_manifest_path(final))
        lock_digest = recorded.digest if recorded is not None else digest
        async with file_lock(self.cache_dir / "locks" / f"{lock_digest}.lock"):
            await self._delete(final)
        log.info("template.removed", template=final.name)

    async def _delete(self, final: Path) -> None:
        # The manifest goes first: from then on nobody treats the template as ready.
        _manifest_path(final).unlink(missing_ok=True)
        await self.pool.delete_subvolume(final)


async def _quiet(line: str) -> None:
    return None


def _manifest_path(final: Path) -> Path:
    return final.with_name(final.name + ".json")


def _write_manifest(info: TemplateInfo) -> None:
    body = {
        "name": info.name,
        "digest": info.digest,
        "spec": info.spec,
        "size_bytes": info.size_bytes,
        "created_at": info.created_at.isoformat(),
        "source": info.source,
        "seconds": info.seconds,
    }
    path = _manifest_path(info.path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _read_manifest(path: Path) -> TemplateInfo | None:
    try:
        body = json.loads(path.read_text())
        final = path.with_name(path.name.removesuffix(".json"))
        st = final.lstat()
        if not stat.S_ISDIR(st.st_mode):
            return None
        return TemplateInfo(
            name=str(body["name"]),
            digest=str(body["digest"]),
            path=final,
            size_bytes=int(body["size_bytes"]),
            created_at=datetime.fromisoformat(body["created_at"]),
            spec=dict(body.get("spec") or {}),
            source=str(body.get("source", "build")),
            seconds=body.get("seconds"),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _file_bytes(path: Path) -> int:
    return path.stat().st_size


# -- the default builder: debootstrap ------------------------------------------------------------

class _DebootstrapProgress:
    """Turns debootstrap's ``I:`` lines into progress lines with a percentage where one is known.

    Every package is validated (downloaded or found in the cache) before anything is installed, so
    the package count is known by the time unpacking starts; unpack + configure are the percentage.
    """

    def __init__(self, emit: Progress) -> None:
        self.emit = emit
        self.packages: set[str] = set()
        self.steps = 0
        self.tail: deque[str] = deque(maxlen=30)

    async def feed(self, line: str) -> None:
        self.tail.append(line)
        if not line.strip():
            return
        words = line.split()
        if line.startswith(("I: Retrieving ", "I: Validating ")) and len(words) >= 4:
            self.packages.add(words[2])  # "I: Validating <package> <version>"
        elif (
            line.startswith(("I: Unpacking ", "I: Configuring "))
            and line.endswith("...")
            and words[2] not in ("required", "the", "base")  # phase headers, not packages
        ):
            self.steps += 1
        if self.packages and self.steps:
            pct = min(99, 100 * self.steps // (2 * len(self.packages)))
            await self.emit(f"  [{pct:>2}%] {line}")
        else:
            await self.emit(f"  {line}")


async def debootstrap_builder(spec: dict[str, Any], target: Path, cache_dir: Path, emit: Progress, *,
                              pool: Pool) -> None:
    """The default :data:`Builder` (bound to its pool by the store): a minbase Debian with the
    spec's packages and user, made by the helper's ``template.*`` verbs in ``target`` (the work
    subvolume). debootstrap's package cache is the helper's (``<its cache>/debootstrap``), not
    ``cache_dir``."""
    work = shipping.pool_rel(pool, target)
    await emit(f"[1/4] debootstrap {spec['suite']} (minbase + {len(spec['packages'])} packages)")
    progress = _DebootstrapProgress(emit)
    res = await pool.priv.call(
        "template.debootstrap",
        {"work": work, "suite": spec["suite"], "mirror": spec["mirror"], "packages": list(spec["packages"])},
        on_line=progress.feed, timeout=3600,
    )
    rc = int(res["returncode"])
    if rc != 0:
        tail = "\n".join(progress.tail)
        raise RuntimeFailure(f"debootstrap failed (exit {rc})", work=work, suite=spec["suite"], returncode=rc,
                             output=tail)

    sudo = spec.get("sudo") is True
    await emit(f"[2/4] configure: user {spec['user']} (uid {USER_UID}{', sudo' if sudo else ''}), {spec['home']}, "
               "/opt/space/guest")
    await pool.priv.call("template.script", {"work": work, "script": "base_configure",
                                             "args": [spec["user"], spec["home"], "sudo" if sudo else ""]})
    await emit("[3/4] clean apt lists and caches")
    await pool.priv.call("template.script", {"work": work, "script": "base_clean"}, timeout=300)
