"""Moving a full snapshot between a node and object storage (suspend, restore on any node).

A shipped snapshot is, under its prefix: ``rootfs.btrfs.zst`` (``btrfs send -p <template>`` of the
snapshot's root: only what the sandbox changed), the memory image files ``checkpoint/<file>`` as
runsc wrote them (already compressed), and ``manifest.json`` written last, sealed with the
deployment's manifest key and bound to the tenant, sandbox, snapshot and prefix
(:mod:`space.node.storage.artifacts`): no manifest, no restore; a manifest that does not open for exactly
this snapshot, no restore either. Templates travel on their own
(:meth:`space.node.templates.store.TemplateStore.publish`) so that a node without one can materialize it;
the manifest names the template stream (by the hash of its bytes) the delta was taken against.
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

from space import childenv
from space.errors import InvalidPath, RuntimeFailure, SnapshotCorrupt, SpaceError
from space.node.storage import snapshots
from space.node.storage.artifacts import PRIVATE, Artifact, Manifest, Sealing, download_snapshot, upload_snapshot
from space.node.storage.pool import Pool
from space.objauth import ManifestKeys
from space.objstore import ObjectStore

log = structlog.get_logger("space.node.storage.shipping")

ROOTFS_ARTIFACT = "rootfs.btrfs.zst"
CHUNK = 1 << 20

Progress = Callable[[str], Awaitable[None]]


def pool_rel(pool: Pool, path: Path) -> str:
    """``path`` as the helper's verbs name it (relative to the pool root)."""
    try:
        return Path(os.path.normpath(path)).relative_to(pool.root).as_posix()
    except ValueError:
        raise InvalidPath(f"path is outside the pool: {path}", path=str(path)) from None


async def _spawn(*argv: str, stdin: int | None, stdout: int | None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=stdin if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=stdout if stdout is not None else asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        env=childenv.tool(),
    )


async def _reap(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        await proc.wait()


def _zstd_failure(argv: list[str], rc: int, err: bytes) -> RuntimeFailure:
    tail = err.decode(errors="replace").strip()[-300:]
    return RuntimeFailure(f"zstd failed (exit {rc}): {tail or 'no output'}", argv=argv, returncode=rc, stderr=tail)


@contextlib.asynccontextmanager
async def compressed_send(pool: Pool, subvol: Path, *, parent: Path | None = None,
                          stdout: int | None = None) -> AsyncIterator[asyncio.subprocess.Process]:
    """``btrfs send [-p parent] subvol | zstd -T0 -3``: the helper's ``stream.send`` writes the raw
    stream into a pipe, and zstd runs here (unprivileged) on its other end.

    Yields the zstd process: with ``stdout`` (an fd) it writes there, else the body reads its
    ``stdout`` to EOF. Leaving the block waits for both and raises if either failed; leaving it
    early (an exception, a cancellation) kills both.
    """
    args: dict[str, Any] = {"rel": pool_rel(pool, subvol),
                            "parent": pool_rel(pool, parent) if parent is not None else None}
    argv = ["zstd", "-T0", "-3", "-q", "-c"]
    read_end, write_end = os.pipe()
    try:
        zstd = await _spawn(*argv, stdin=read_end, stdout=stdout)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)  # zstd has its copy
    # Our copy of the write end goes when the send is over, so zstd then sees EOF.
    send = asyncio.create_task(pool.priv.call("stream.send", args, fds={"stdout": write_end}, timeout=1800))
    send.add_done_callback(lambda _: os.close(write_end))
    assert zstd.stderr is not None
    err_task = asyncio.create_task(zstd.stderr.read())
    try:
        yield zstd
        rc = await zstd.wait()
        await asyncio.wait({send})
        err = await err_task
        if rc != 0:
            # Named first: a zstd that died makes the send fail of a broken pipe.
            raise _zstd_failure(argv, rc, err)
        send.result()
    finally:
        if not send.done():
            send.cancel()
        await asyncio.shield(asyncio.wait({send}))
        if not send.cancelled():
            send.exception()  # retrieved: the error raised (or the one that made us leave) wins
        await asyncio.shield(_reap(zstd))
        err_task.cancel()


async def send_delta(parent: Path, snap_root: Path, *, pool: Pool) -> AsyncIterator[bytes]:
    """``btrfs send -p parent snap | zstd``, as a stream of bytes; raises if either step fails."""
    async with compressed_send(pool, snap_root, parent=parent) as zstd:
        assert zstd.stdout is not None
        while chunk := await zstd.stdout.read(CHUNK):
            yield chunk


async def receive_compressed(pool: Pool, stream: Path, dest: Path, name: str, *, timeout: float = 1800) -> None:
    """``zstd -d < stream | btrfs receive``: zstd runs here, the helper's ``stream.receive`` takes the
    raw stream from a pipe and must find exactly the subvolume ``name`` in it, which it moves to
    ``dest/name``. Raises RuntimeFailure (zstd) or the verb's error; leaves nothing on failure."""
    argv = ["zstd", "-d", "-q", "-c", "--", str(stream)]
    read_end, write_end = os.pipe()
    try:
        zstd = await _spawn(*argv, stdin=None, stdout=write_end)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)  # zstd has its copy: btrfs receive sees EOF when zstd is done
    assert zstd.stderr is not None
    err_task = asyncio.create_task(zstd.stderr.read())
    try:
        failed: SpaceError | None = None
        try:
            await pool.priv.call("stream.receive", {"dest": pool_rel(pool, dest), "name": name},
                                 fds={"stdin": read_end}, timeout=timeout)
        except SpaceError as exc:
            failed = exc
        finally:
            os.close(read_end)  # a zstd still writing (the verb refused early) now gets EPIPE
        rc = await zstd.wait()
        err = await err_task
        if rc not in (0, -signal.SIGPIPE) and failed is not None:
            # The stream could not be decompressed: that is the cause, the receive only saw its end.
            # (Killed by SIGPIPE, zstd only saw the receive refuse or fail first.)
            raise _zstd_failure(argv, rc, err) from failed
        if failed is not None:
            raise failed
        if rc != 0:
            # The receive took a truncated stream as complete: what it made is not to be trusted.
            await asyncio.shield(pool.delete_subvolume(dest / name))
            raise _zstd_failure(argv, rc, err)
    finally:
        await asyncio.shield(_reap(zstd))
        err_task.cancel()


def snapshot_meta(snap: snapshots.LocalSnapshot) -> tuple[dict[str, Any], dict[str, Any]]:
    """A snapshot's description for its manifest: the public part, and the tenant's own (its
    environment), which a sealed manifest keeps encrypted."""
    public = snap.public()
    return public, {"env": public.pop("env", {})}


def described_snapshot(manifest: Manifest) -> dict[str, Any]:
    """The snapshot a downloaded manifest describes (its private part opened by the download;
    manifests from before the split keep the environment in the public part)."""
    raw = dict(manifest.meta.get("snapshot") or {})
    private = manifest.meta.get(PRIVATE)
    if isinstance(private, dict) and "env" in private:
        raw["env"] = private["env"]
    raw.setdefault("env", {})
    return raw


async def upload(
    store: ObjectStore,
    prefix: str,
    pool: Pool,
    snap: snapshots.LocalSnapshot,
    template_root: Path,
    meta: dict[str, Any],
    on_progress: Progress | None = None,
    *,
    keys: ManifestKeys,
    binding: dict[str, str],
    sealing: Sealing | None = None,
) -> dict[str, Any]:
    """Ship a snapshot: its files as a delta against the template, its memory image (full ones),
    then the manifest (the commit point), sealed for ``binding``."""
    root = snapshots.rootfs_of(pool, snap.sandbox_id, snap.id)
    image = snapshots.image_of(pool, snap.sandbox_id, snap.id)
    arts = [Artifact(name=ROOTFS_ARTIFACT, stream=lambda: send_delta(template_root, root, pool=pool))]
    for f in sorted(image.iterdir()) if snap.kind == "full" else []:
        arts.append(Artifact(name=f"checkpoint/{f.name}", path=f))
    public, private = snapshot_meta(snap)
    manifest = await upload_snapshot(store, prefix, arts, {**meta, "snapshot": public}, private=private,
                                     keys=keys, binding=binding, on_progress=on_progress, sealing=sealing)
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
    *,
    keys: ManifestKeys,
    binding: dict[str, str],
    manifest: Manifest | None = None,
    sealing: Sealing | None = None,
) -> snapshots.LocalSnapshot:
    """Bring a shipped snapshot into ``sandboxes/<sandbox_id>/snapshots/<snap_id>`` on this node.

    The manifest must open for ``binding`` (or be the one the caller verified for it); everything
    is downloaded and verified against it before anything is applied; the template must already
    be on the node (the delta is received on top of it). On any failure nothing of the snapshot
    is left behind.
    """
    done = snapshots.read(pool, sandbox_id, snap_id)
    if done is not None:
        return done
    d = snapshots.snapshot_dir(pool, sandbox_id, snap_id)
    incoming = pool.sandbox_dir(sandbox_id) / "incoming"
    await pool.delete_subvolume(d)
    await asyncio.to_thread(shutil.rmtree, incoming, True)
    try:
        manifest = await download_snapshot(store, prefix, incoming, keys=keys, binding=binding,
                                           manifest=manifest, on_progress=on_progress, sealing=sealing)
        raw = described_snapshot(manifest)
        if raw.get("id") != snap_id:
            raise SnapshotCorrupt(f"snapshot {snap_id}: the manifest at {prefix} describes "
                                  f"{raw.get('id')!r}", snapshot_id=snap_id)
        d.mkdir(parents=True)
        try:
            await receive_compressed(pool, incoming / ROOTFS_ARTIFACT, d, "rootfs")
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
