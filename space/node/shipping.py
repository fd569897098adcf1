"""Moving a full snapshot between a node and object storage (suspend, restore on any node).

A shipped snapshot is, under its prefix: ``rootfs.btrfs.zst`` (``btrfs send -p <template>`` of the
snapshot's root: only what the sandbox changed), the memory image files ``checkpoint/<file>`` as
runsc wrote them (already compressed), and ``manifest.json`` written last
(:mod:`space.node.artifacts`): no manifest, no restore. Templates travel on their own
(:meth:`space.node.templates.TemplateStore.publish`) so that a node without one can materialize it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from space.errors import RuntimeFailure, SnapshotCorrupt, SpaceError
from space.node import privileged, snapshots
from space.node.artifacts import Artifact, download_snapshot, upload_snapshot
from space.node.pool import Pool
from space.objstore import ObjectStore

log = structlog.get_logger("space.node.shipping")

ROOTFS_ARTIFACT = "rootfs.btrfs.zst"
CHUNK = 1 << 20

Progress = Callable[[str], Awaitable[None]]


async def send_delta(parent: Path, snap_root: Path) -> AsyncIterator[bytes]:
    """``btrfs send -p parent snap | zstd``, as a stream of bytes; raises if either step fails."""
    proc = await asyncio.create_subprocess_exec(
        "bash", "-o", "pipefail", "-c", 'btrfs send -q -p "$1" "$2" | zstd -T0 -3 -q -c', "send",
        str(parent), str(snap_root),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    err_task = asyncio.create_task(proc.stderr.read())
    try:
        while chunk := await proc.stdout.read(CHUNK):
            yield chunk
        rc = await proc.wait()
        err = await err_task
        if rc != 0:
            raise RuntimeFailure(f"btrfs send of {snap_root.name} failed (exit {rc}): "
                                 f"{err.decode(errors='replace').strip()[-300:]}")
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        err_task.cancel()


async def upload(
    store: ObjectStore,
    prefix: str,
    pool: Pool,
    snap: snapshots.LocalSnapshot,
    template_root: Path,
    meta: dict[str, Any],
    on_progress: Progress | None = None,
) -> dict[str, Any]:
    """Ship a snapshot: its files as a delta against the template, its memory image (full ones),
    then the manifest (the commit point)."""
    root = snapshots.rootfs_of(pool, snap.sandbox_id, snap.id)
    image = snapshots.image_of(pool, snap.sandbox_id, snap.id)
    arts = [Artifact(name=ROOTFS_ARTIFACT, stream=lambda: send_delta(template_root, root))]
    for f in sorted(image.iterdir()) if snap.kind == "full" else []:
        arts.append(Artifact(name=f"checkpoint/{f.name}", path=f))
    manifest = await upload_snapshot(store, prefix, arts, {**meta, "snapshot": snap.public()},
                                     on_progress=on_progress)
    total = sum(a.size for a in manifest.artifacts)
    log.info("snapshot.uploaded", snapshot=snap.id, prefix=prefix, bytes=total)
    return {"prefix": prefix, "bytes": total,
            "artifacts": [{"name": a.name, "size": a.size} for a in manifest.artifacts]}


async def download(
    store: ObjectStore,
    prefix: str,
    pool: Pool,
    sandbox_id: str,
    snap_id: str,
    on_progress: Progress | None = None,
) -> snapshots.LocalSnapshot:
    """Bring a shipped snapshot into ``sandboxes/<sandbox_id>/snapshots/<snap_id>`` on this node.

    Everything is downloaded and verified against the manifest before anything is applied; the
    template must already be on the node (the delta is received on top of it). On any failure
    nothing of the snapshot is left behind.
    """
    done = snapshots.read(pool, sandbox_id, snap_id)
    if done is not None:
        return done
    d = snapshots.snapshot_dir(pool, sandbox_id, snap_id)
    incoming = pool.sandbox_dir(sandbox_id) / "incoming"
    await pool.delete_subvolume(d)
    await asyncio.to_thread(shutil.rmtree, incoming, True)
    try:
        manifest = await download_snapshot(store, prefix, incoming, on_progress=on_progress)
        raw = dict(manifest.meta.get("snapshot") or {})
        if raw.get("id") != snap_id:
            raise SnapshotCorrupt(f"snapshot {snap_id}: the manifest at {prefix} describes "
                                  f"{raw.get('id')!r}", snapshot_id=snap_id)
        d.mkdir(parents=True)
        try:
            await privileged.pipeline(
                ["zstd", "-d", "-q", "-c", "--", str(incoming / ROOTFS_ARTIFACT)],
                ["btrfs", "receive", "-q", str(d)],
                timeout=1800,
            )
        except SpaceError as exc:
            raise SnapshotCorrupt(f"snapshot {snap_id}: its root filesystem could not be received "
                                  f"({exc.message})", snapshot_id=snap_id) from None
        if not await pool.is_subvolume(d / "rootfs"):
            raise SnapshotCorrupt(f"snapshot {snap_id}: its stream did not contain the root filesystem",
                                  snapshot_id=snap_id)
        if raw.get("kind") == "full":
            if not (incoming / "checkpoint").is_dir():
                raise SnapshotCorrupt(f"snapshot {snap_id}: its memory image is missing", snapshot_id=snap_id)
            await asyncio.to_thread(snapshots.move_files, incoming / "checkpoint", d / "checkpoint")
        fields = {k: v for k, v in raw.items() if k in snapshots.LocalSnapshot.__dataclass_fields__}
        snap = snapshots.LocalSnapshot(**{**fields, "sandbox_id": sandbox_id})
        snapshots.commit(pool, snap)
    except BaseException:
        await asyncio.shield(pool.delete_subvolume(d))
        raise
    finally:
        await asyncio.to_thread(shutil.rmtree, incoming, True)
    log.info("snapshot.downloaded", snapshot=snap_id, sandbox=sandbox_id, prefix=prefix)
    return snap
