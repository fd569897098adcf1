"""``space objects migrate``: re-authenticate, once and after checking, what object storage holds
from before its manifests were sealed; and re-seal under a rotated manifest key.

Before sealing, a shipped snapshot's ``manifest.json`` was plain JSON (format 1) and a template's
stream lived at ``templates/<name>-<spec digest>.btrfs.zst`` with no manifest. Nodes refuse both
(``object_tampered``, reason ``unauthenticated``): the embedded ``space serve`` keeps working on an
upgraded data dir (new suspends are sealed, buildable templates are rebuilt rather than received),
but a sandbox suspended before the upgrade stays suspended until its objects are migrated.

What this checks before sealing anything, against the database (which the bucket cannot write):

- a template: its spec (from the database, or a legacy snapshot manifest that names it) must hash
  to the digest in the stream's name; the stream must be a complete zstd stream (``zstd -t``); if
  this host's template cache holds its own export of it, the two must be the same bytes. It is then
  published as a sealed, content-addressed template (the legacy object is left in place, unused);
- a snapshot (every restorable row with an object key): its manifest must describe that row's
  snapshot id, kind, sandbox and template; its artifacts must be what the row recorded when they
  were uploaded (names and sizes, total bytes) and what the manifest lists (each is read and
  hashed); its template must be published and sealed. It is then sealed for the row's tenant,
  sandbox, snapshot and prefix, naming that template stream.

What it cannot check is a legacy object that was altered consistently with everything the database
recorded (an artifact replaced by another of the same size, its hash rewritten): nothing outside
the bucket ever knew those hashes. Run it once, right after upgrading: the operator vouches that the
bucket was not written by anyone else until then. It is idempotent; ``--dry-run`` only reports.
Manifests already sealed under an older key of the ring are re-sealed under the current one.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from space import childenv
from space.errors import NotFound, ObjectTampered, SnapshotCorrupt
from space.node.storage import artifacts
from space.node.storage.artifacts import MANIFEST, Manifest, snapshot_binding
from space.node.templates import objects as template_objects
from space.node.templates.objects import Published
from space.node.templates.store import spec_digest
from space.objauth import UNAUTHENTICATED, ManifestKeys, check_binding
from space.objstore import ObjectStore
from space.store import Snapshot, Store

Say = Callable[[str], None]


@dataclass
class Report:
    """What a run did (or, dry, would do): object keys by outcome."""

    sealed: list[str] = field(default_factory=list)
    resealed: list[str] = field(default_factory=list)
    current: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refused


class Refused(Exception):
    """A legacy object failed a check: it is not sealed, and stays refused."""


async def migrate(store: Store, objects: ObjectStore, keys: ManifestKeys, *, cache_dir: Path | None = None,
                  dry_run: bool = False, say: Say = print) -> Report:
    """Check and seal what needs it (module doc); ``say`` gets one line per object and a summary."""
    report = Report()
    rows = [s for s in await store.list_snapshots(statuses=["ready"]) if s.restorable and s.object_key]
    specs: dict[tuple[str, str], dict[str, Any]] = {}
    for t in await store.list_templates():
        if t.digest and t.spec and spec_digest(t.spec) == t.digest:
            specs[(t.name, t.digest)] = dict(t.spec)
    legacy = await _scan_snapshots(objects, keys, rows, specs, dry_run, report)

    published: dict[tuple[str, str], Published] = {}
    for (name, digest), spec in sorted(specs.items()):
        try:
            got = await _template(objects, keys, name, digest, spec, cache_dir, dry_run, report)
        except Refused as e:
            report.refused.append((template_objects.legacy_stream_key(name, digest), str(e)))
            continue
        if got is not None:
            published[(name, digest)] = got

    for row in rows:
        old = legacy.get(row.id)
        if old is None:
            continue
        assert row.object_key is not None
        key = f"{row.object_key}/{MANIFEST}"
        try:
            sealed = await _snapshot(objects, row, old, published)
        except Refused as e:
            report.refused.append((key, str(e)))
            continue
        if not dry_run:
            await objects.put_bytes(key, sealed.seal(keys))
        report.sealed.append(key)
    _say(report, dry_run, say)
    return report


async def _scan_snapshots(objects: ObjectStore, keys: ManifestKeys, rows: list[Snapshot],
                          specs: dict[tuple[str, str], dict[str, Any]], dry_run: bool,
                          report: Report) -> dict[str, Manifest]:
    """The legacy manifests of ``rows`` (by snapshot id), adding the templates they name to
    ``specs``; sealed ones are current, re-sealed (older key) or refused (tampered)."""
    legacy: dict[str, Manifest] = {}
    for row in rows:
        assert row.object_key is not None
        key = f"{row.object_key}/{MANIFEST}"
        try:
            data = await objects.get_bytes(key)
        except NotFound:
            report.skipped.append((key, "no manifest: its upload never finished"))
            continue
        try:
            opened = keys.open(data, artifacts.KIND, key=key, what=f"snapshot {row.id}")
            check_binding(opened.body, _binding(row), key=key, what=f"snapshot {row.id}")
        except ObjectTampered as e:
            if e.details.get("reason") != UNAUTHENTICATED:
                report.refused.append((key, e.message))
                continue
            try:
                old = Manifest.parse_legacy(data, prefix=row.object_key)
            except SnapshotCorrupt as bad:
                report.refused.append((key, bad.message))
                continue
            legacy[row.id] = old
            spec = old.meta.get("template_spec")
            if isinstance(spec, dict) and isinstance(spec.get("name"), str):
                specs.setdefault((spec["name"], spec_digest(spec)), spec)
            continue
        if opened.key_id == keys.current_id:
            report.current.append(key)
        else:
            if not dry_run:
                await objects.put_bytes(key, keys.seal(artifacts.KIND, opened.body))
            report.resealed.append(key)
    return legacy


def _say(report: Report, dry_run: bool, say: Say) -> None:
    for what, keys_ in (("sealed", report.sealed), ("re-sealed under the current key", report.resealed),
                        ("already sealed", report.current)):
        for k in keys_:
            say(f"{'would be ' if dry_run else ''}{what}: {k}")
    for k, why in report.skipped:
        say(f"skipped: {k}: {why}")
    for k, why in report.refused:
        say(f"REFUSED: {k}: {why}")
    dry = " (dry run: nothing written)" if dry_run else ""
    say(f"{len(report.sealed)} sealed, {len(report.resealed)} re-sealed, {len(report.current)} already sealed, "
        f"{len(report.skipped)} skipped, {len(report.refused)} refused{dry}")


def _binding(row: Snapshot) -> dict[str, str]:
    assert row.object_key is not None
    return snapshot_binding(tenant=row.tenant, sandbox_id=row.sandbox_id, snapshot_id=row.id, prefix=row.object_key)


async def _template(objects: ObjectStore, keys: ManifestKeys, name: str, digest: str, spec: dict[str, Any],
                    cache_dir: Path | None, dry_run: bool, report: Report) -> Published | None:
    """The sealed template, sealing a legacy stream after checking it; None when storage has neither."""
    mkey = template_objects.manifest_key(name, digest)
    try:
        data = await objects.get_bytes(mkey)
    except NotFound:
        data = None
    if data is not None:
        try:
            opened = keys.open(data, template_objects.KIND, key=mkey, what=f"template {name}@{digest[:16]}")
            check_binding(opened.body, template_objects.binding(name, digest), key=mkey, what=mkey)
        except ObjectTampered as e:
            raise Refused(e.message) from None
        if opened.key_id != keys.current_id:
            if not dry_run:
                await objects.put_bytes(mkey, keys.seal(template_objects.KIND, opened.body))
            report.resealed.append(mkey)
        else:
            report.current.append(mkey)
        sealed_spec = opened.body.get("spec")
        return Published(name=name, digest=digest, spec=sealed_spec if isinstance(sealed_spec, dict) else spec,
                         stream=template_objects.StreamRef.parse(opened.body.get("stream"), where=mkey))
    legacy = template_objects.legacy_stream_key(name, digest)
    if not await objects.exists(legacy):
        return None
    if spec_digest(spec) != digest or spec.get("name") != name:
        raise Refused(f"no spec of template {name} hashes to {digest}")
    with tempfile.TemporaryDirectory(prefix="space-migrate-") as tmp:
        local = Path(tmp) / "stream.btrfs.zst"
        await objects.get_to_file(legacy, local)
        proc = await asyncio.create_subprocess_exec("zstd", "-t", "-q", "--", str(local), env=childenv.tool(),
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise Refused(f"{legacy} is not a complete zstd stream ({err.decode(errors='replace').strip()[-200:]})")
        if cache_dir is not None:
            own = cache_dir / "templates" / f"{name}-{digest}.btrfs.zst"
            if own.exists() and not await _same_bytes(own, local):
                raise Refused(f"{legacy} is not the stream this host exported ({own})")
        if dry_run:
            report.sealed.append(mkey)
            sha, size = await asyncio.to_thread(_hash_file, local)
            return Published(name=name, digest=digest, spec=spec,
                             stream=template_objects.StreamRef(sha256=sha, size=size))
        published = await template_objects.publish(objects, keys, name, digest, spec, local)
    report.sealed.append(mkey)
    return published


async def _snapshot(objects: ObjectStore, row: Snapshot, m: Manifest,
                    published: dict[tuple[str, str], Published]) -> Manifest:
    """The sealed manifest of a legacy one, once it agrees with its row and its bytes."""
    assert row.object_key is not None
    snap = m.meta.get("snapshot")
    if not isinstance(snap, dict):
        raise Refused("its manifest describes no snapshot")
    for what, got, want in (("snapshot id", snap.get("id"), row.id), ("kind", snap.get("kind"), row.kind),
                            ("sandbox", m.meta.get("sandbox_id", row.sandbox_id), row.sandbox_id),
                            ("sandbox", snap.get("sandbox_id", row.sandbox_id), row.sandbox_id)):
        if got != want:
            raise Refused(f"its manifest names {what} {got!r}, the database {want!r}")
    spec = m.meta.get("template_spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise Refused("its manifest names no template")
    digest = spec_digest(spec)
    if (row.template_digest and digest != row.template_digest) or spec["name"] != row.template:
        raise Refused(f"its manifest's template {spec['name']}@{digest[:16]} is not the database's "
                      f"{row.template}@{(row.template_digest or '')[:16]}")
    template = published.get((spec["name"], digest))
    if template is None:
        raise Refused(f"its template {spec['name']}@{digest[:16]} is not in object storage")
    recorded = (row.meta or {}).get("artifacts")
    if isinstance(recorded, list):
        want_list = sorted((str(a.get("name")), a.get("size")) for a in recorded if isinstance(a, dict))
        got_list = sorted((a.name, a.size) for a in m.artifacts)
        if want_list != got_list:
            raise Refused(f"its artifacts {got_list} are not the ones uploaded ({want_list})")
    uploaded = (row.meta or {}).get("uploaded_bytes")
    if isinstance(uploaded, int) and uploaded != m.total_size:
        raise Refused(f"its artifacts total {m.total_size} bytes, {uploaded} were uploaded")
    for a in m.artifacts:
        key = f"{row.object_key}/{a.name}"
        try:
            got = await objects.digest(key)
        except NotFound:
            raise Refused(f"its artifact {a.name} is missing") from None
        if (got.size, got.sha256) != (a.size, a.sha256):
            raise Refused(f"its artifact {a.name} does not match its manifest")
    return Manifest(version=m.version, created_at=m.created_at, meta={**m.meta, "template": template.ref()},
                    artifacts=m.artifacts, binding=_binding(row))


async def _same_bytes(a: Path, b: Path) -> bool:
    ha, hb = await asyncio.gather(asyncio.to_thread(_hash_file, a), asyncio.to_thread(_hash_file, b))
    return ha == hb


def _hash_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


async def run(*, database_url: str, object_store_url: str, keys: ManifestKeys, cache_dir: Path | None,
              dry_run: bool, say: Say = print) -> Report:
    store = await Store.open(database_url)
    try:
        objects = ObjectStore.from_url(object_store_url)
        return await migrate(store, objects, keys, cache_dir=cache_dir, dry_run=dry_run, say=say)
    finally:
        await store.close()

