"""Save a sandbox's snapshot as a template (the *saved* form of space/node/templates/spec.py).

The snapshot's ``rootfs`` (already a read-only subvolume) is snapshotted read-only into
``templates/<name>@<digest16>`` -- a metadata operation, no copy -- and recorded with a manifest like
any template; its send stream then goes to object storage, the only way another node can get it
(a saved template cannot be rebuilt). Its spec names where it came from and carries the parent
template's sandbox defaults (user, env, workdir, start command).
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from space.node.storage import snapshots
from space.node.storage.pool import check_name, file_lock
from space.node.templates import spec as template_spec
from space.node.templates.store import (
    Progress,
    TemplateInfo,
    TemplateStore,
    _manifest_path,
    _read_manifest,
    spec_digest,
    validate_spec,
)

log = structlog.get_logger(__name__)


def saved_spec(store: TemplateStore, name: str, sandbox_id: str, snap_id: str) -> dict[str, Any]:
    snap = snapshots.get(store.pool, sandbox_id, snap_id)
    parent = _read_manifest(_manifest_path(store.pool.template_path(snap.template, snap.template_digest)))
    spec: dict[str, Any] = {
        "name": check_name(name, "template name"),
        "from_snapshot": snap_id,
        "sandbox": sandbox_id,
        "parent_template_digest": snap.template_digest,
        **template_spec.defaults_of(parent.spec if parent is not None else {}),
    }
    if "user" not in spec and snap.user:
        spec["user"] = snap.user
    return validate_spec(spec)


async def save_snapshot(store: TemplateStore, name: str, sandbox_id: str, snap_id: str, *,
                        on_progress: Progress | None = None) -> TemplateInfo:
    """Make template ``name`` of snapshot ``snap_id`` of ``sandbox_id`` (idempotent: the same
    snapshot saved again under the same name is the same template) and publish it."""
    spec = saved_spec(store, name, sandbox_id, snap_id)
    digest = spec_digest(spec)
    final = store.pool.template_path(name, digest)
    rootfs = snapshots.rootfs_of(store.pool, sandbox_id, snap_id)
    async with file_lock(store.cache_dir / "locks" / f"{digest}.lock"):
        info = _read_manifest(_manifest_path(final))
        if info is None:
            started = time.monotonic()
            if await store.pool.is_subvolume(final) and not await store.pool.is_readonly(final):
                await store.pool.delete_subvolume(final)  # never happens with snapshot -r; be safe
            if not await store.pool.is_subvolume(final):
                await store.pool.snapshot(rootfs, final, readonly=True)
            info = await store._publish_manifest(spec, digest, source="saved", seconds=time.monotonic() - started)
            log.info("template.saved", template=info.label, sandbox=sandbox_id, snapshot=snap_id)
    if store.objects is not None:
        await store.publish(store.objects, name, digest, on_progress=on_progress)
    return info
