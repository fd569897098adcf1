"""A sandbox's snapshots on its node: read-only btrfs snapshots of its root, with a memory image for
full checkpoints.

Layout, under the sandbox's directory in the pool::

    snapshots/<snap>/rootfs          read-only subvolume: the files at that instant
    snapshots/<snap>/checkpoint/     runsc checkpoint image (full snapshots only)
    snapshots/<snap>/snapshot.json   written last: a snapshot without it does not exist

``snapshot.json`` also records what a fork or a restore elsewhere needs to boot the snapshot (the
template it sits on, resources, env, default user), so a snapshot is usable without its sandbox.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from space.errors import InsufficientStorage, InvalidRequest, NotFound
from space.node.helper import privileged
from space.node.storage.pool import Pool, check_name

META_FILE = "snapshot.json"
KINDS = ("disk", "full")
#: A snapshot is refused when the pool has less free space than this: a full pool must keep
#: running sandboxes running, and every snapshot pins extents that would otherwise be freed.
MIN_FREE_BYTES = 256 << 20


@dataclasses.dataclass
class LocalSnapshot:
    id: str
    sandbox_id: str
    kind: str
    created_at: float
    template: str
    template_digest: str
    cpu: float
    memory_mb: int
    env: dict[str, str]
    user: str | None
    #: The sandbox's disk limit (MiB; None: none of its own): a fork or restore of it keeps it.
    disk_mb: int | None = None
    #: Bytes of the memory image (full snapshots), 0 for disk snapshots.
    image_bytes: int = 0
    #: How long the guest was frozen to take it (full snapshots), in milliseconds.
    freeze_ms: float = 0.0
    took_ms: float = 0.0

    def public(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def snapshot_dir(pool: Pool, sandbox_id: str, snap_id: str) -> Path:
    return pool.sandbox_dir(sandbox_id) / "snapshots" / check_name(snap_id, "snapshot id")


def rootfs_of(pool: Pool, sandbox_id: str, snap_id: str) -> Path:
    return snapshot_dir(pool, sandbox_id, snap_id) / "rootfs"


def image_of(pool: Pool, sandbox_id: str, snap_id: str) -> Path:
    return snapshot_dir(pool, sandbox_id, snap_id) / "checkpoint"


def read(pool: Pool, sandbox_id: str, snap_id: str) -> LocalSnapshot | None:
    try:
        raw = json.loads((snapshot_dir(pool, sandbox_id, snap_id) / META_FILE).read_text())
        fields = {f.name for f in dataclasses.fields(LocalSnapshot)}
        return LocalSnapshot(**{k: v for k, v in raw.items() if k in fields})
    except (OSError, ValueError, TypeError):
        return None


def get(pool: Pool, sandbox_id: str, snap_id: str) -> LocalSnapshot:
    snap = read(pool, sandbox_id, snap_id)
    if snap is None:
        raise NotFound(f"snapshot {snap_id} of sandbox {sandbox_id} is not on this node",
                       snapshot_id=snap_id, sandbox_id=sandbox_id)
    return snap


def list_local(pool: Pool, sandbox_id: str) -> list[LocalSnapshot]:
    root = pool.sandbox_dir(sandbox_id) / "snapshots"
    out = []
    for d in sorted(root.iterdir()) if root.exists() else []:
        snap = read(pool, sandbox_id, d.name)
        if snap is not None:
            out.append(snap)
    return sorted(out, key=lambda s: s.created_at)


def commit(pool: Pool, snap: LocalSnapshot) -> None:
    """Write ``snapshot.json``: from this moment the snapshot exists."""
    d = snapshot_dir(pool, snap.sandbox_id, snap.id)
    tmp = d / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(snap.public()))
    os.replace(tmp, d / META_FILE)


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise InvalidRequest(f"snapshot kind must be one of {', '.join(KINDS)}, not {kind!r}")
    return kind


async def check_room(pool: Pool, what: str) -> None:
    usage = await pool.usage()
    if usage["free_bytes"] < MIN_FREE_BYTES:
        # Space freed by deletions comes back when btrfs commits its transaction: commit, look again.
        await privileged.run("btrfs", "filesystem", "sync", str(pool.root), check=False)
        usage = await pool.usage()
    if usage["free_bytes"] < MIN_FREE_BYTES:
        raise InsufficientStorage(
            f"cannot take {what}: the node's pool has {usage['free_bytes'] >> 20} MiB free "
            f"(at least {MIN_FREE_BYTES >> 20} MiB needed); running sandboxes are unaffected",
            free_bytes=usage["free_bytes"],
        )


async def remove(pool: Pool, sandbox_id: str, snap_id: str) -> None:
    """Delete a snapshot (idempotent). Its metadata goes first, so a crash leaves no half-snapshot."""
    d = snapshot_dir(pool, sandbox_id, snap_id)
    (d / META_FILE).unlink(missing_ok=True)
    await pool.delete_subvolume(d)


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total


def move_files(src: Path, dst: Path) -> None:
    """Move downloaded files into place (same filesystem: a rename each)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        os.replace(f, dst / f.name)
    shutil.rmtree(src, ignore_errors=True)


def now() -> float:
    return time.time()
