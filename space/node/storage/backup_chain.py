"""A sandbox's continuous disk backup in object storage: a chain of incremental ``btrfs send`` links.

Under the sandbox's backup prefix (``tenants/<t>/sandboxes/<s>/backup``)::

    <chain>/<seq>/rootfs.btrfs.zst   link ``seq``: the root at one moment, sent against link seq-1
                                     (link 0 against the template: the chain's full base)
    <chain>/<seq>/manifest.json      written last, sealed and bound to (tenant, sandbox,
                                     ``backup-<chain>-<seq>``, its prefix), as snapshots are

A link is the format of a shipped snapshot (:mod:`space.node.storage.artifacts`), so everything a
restore checks of a snapshot it checks of each link: the seal, the binding (a link of another
sandbox, chain or position is refused), every artifact's size and sha256. Restoring link ``n``
receives links ``0..n`` in order, each on top of the one before it (``btrfs receive`` finds the
parent by the UUID the sender recorded), so a chain's length bounds a restore's work: the node
starts a new chain (a new full base) every ``chain_links`` links, and the control plane deletes the
old chain once the new one is recorded.

This module moves bytes; :mod:`space.node.sandboxes.backups` decides when.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog

from space.errors import InvalidRequest, SnapshotCorrupt, SpaceError
from space.node.storage import shipping
from space.node.storage.artifacts import (
    Artifact,
    Manifest,
    Sealing,
    download_snapshot,
    read_manifest,
    snapshot_binding,
    upload_snapshot,
)
from space.node.storage.pool import Pool, check_name
from space.objauth import ManifestKeys
from space.objstore import ObjectStore

log = structlog.get_logger("space.node.storage.backup_chain")

#: Links in a chain before the next one starts a new chain: a restore never receives more.
DEFAULT_CHAIN_LINKS = 30
MAX_CHAIN_LINKS = 1000


def link_id(chain: str, seq: int) -> str:
    """The id a link's manifest is bound to (a snapshot id, in the snapshot binding's terms)."""
    return f"backup-{check_name(chain, 'chain id')}-{seq:06d}"


def link_prefix(base: str, chain: str, seq: int) -> str:
    if seq < 0:
        raise InvalidRequest(f"a backup link's sequence number is not negative: {seq}")
    return f"{base.rstrip('/')}/{check_name(chain, 'chain id')}/{seq:06d}"


def chain_prefix(base: str, chain: str) -> str:
    return f"{base.rstrip('/')}/{check_name(chain, 'chain id')}/"


async def throttled(stream: AsyncIterator[bytes], bytes_per_s: float | None) -> AsyncIterator[bytes]:
    """``stream`` at no more than ``bytes_per_s`` on average (None: as fast as it comes). The
    sender behind it (``btrfs send`` into a pipe) is held back by the pipe, not buffered."""
    start = time.monotonic()
    sent = 0
    async for chunk in stream:
        if bytes_per_s:
            ahead = (sent + len(chunk)) / bytes_per_s - (time.monotonic() - start)
            if ahead > 0:
                await asyncio.sleep(ahead)
        sent += len(chunk)
        yield chunk


async def upload_link(store: ObjectStore, base: str, pool: Pool, *, tenant: str, sandbox_id: str, chain: str,
                      seq: int, root: Path, parent: Path, meta: dict[str, Any], keys: ManifestKeys,
                      bytes_per_s: float | None = None, sealing: Sealing | None = None,
                      private: dict[str, Any] | None = None) -> Manifest:
    """Ship link ``seq`` of ``chain``: ``root`` (a read-only snapshot) sent against ``parent``
    (the previous link's snapshot, or the template for link 0), then its manifest."""
    prefix = link_prefix(base, chain, seq)
    binding = snapshot_binding(tenant=tenant, sandbox_id=sandbox_id, snapshot_id=link_id(chain, seq), prefix=prefix)
    art = Artifact(name=shipping.ROOTFS_ARTIFACT,
                   stream=lambda: throttled(shipping.send_delta(parent, root, pool=pool), bytes_per_s))
    return await upload_snapshot(store, prefix, [art], {**meta, "chain": chain, "seq": seq},
                                 keys=keys, binding=binding, sealing=sealing, private=private)


async def read_link(store: ObjectStore, base: str, *, tenant: str, sandbox_id: str, chain: str, seq: int,
                    keys: ManifestKeys) -> Manifest:
    """Link ``seq``'s verified manifest; :class:`SnapshotCorrupt` if it is not the link it says."""
    prefix = link_prefix(base, chain, seq)
    binding = snapshot_binding(tenant=tenant, sandbox_id=sandbox_id, snapshot_id=link_id(chain, seq), prefix=prefix)
    manifest = await read_manifest(store, prefix, keys=keys, binding=binding)
    if manifest.meta.get("chain") != chain or manifest.meta.get("seq") != seq:
        raise SnapshotCorrupt(f"backup link {prefix} describes {manifest.meta.get('chain')!r}/"
                              f"{manifest.meta.get('seq')!r}", snapshot=prefix)
    return manifest


async def receive_chain(store: ObjectStore, base: str, pool: Pool, work: Path, *, tenant: str, sandbox_id: str,
                        chain: str, upto: int, keys: ManifestKeys,
                        first: Manifest | None = None, sealing: Sealing | None = None) -> tuple[Path, Manifest]:
    """Receive links ``0..upto`` of ``chain`` under ``work/<seq>/rootfs``, each verified before it
    is applied; returns the last one's root (read-only) and manifest. The template the chain
    starts from must already be on this node. The earlier links are removed as soon as the next
    one is in; on failure, everything under ``work`` is."""
    if upto < 0 or upto >= MAX_CHAIN_LINKS:
        raise InvalidRequest(f"a backup chain has 1 to {MAX_CHAIN_LINKS} links, not {upto + 1}")
    await pool.delete_subvolume(work)
    await asyncio.to_thread(work.mkdir, parents=True)
    incoming = work / "incoming"
    previous: Path | None = None
    manifest = first
    try:
        for seq in range(upto + 1):
            if manifest is None or seq > 0:
                manifest = await read_link(store, base, tenant=tenant, sandbox_id=sandbox_id, chain=chain, seq=seq,
                                           keys=keys)
            prefix = link_prefix(base, chain, seq)
            manifest = await download_snapshot(store, prefix, incoming, keys=keys, binding=manifest.binding,
                                               manifest=manifest, sealing=sealing)
            dest = work / f"{seq:06d}"
            dest.mkdir()
            try:
                await shipping.receive_compressed(pool, incoming / shipping.ROOTFS_ARTIFACT, dest, "rootfs")
            except SpaceError as exc:
                raise SnapshotCorrupt(f"backup link {prefix} could not be received ({exc.message})",
                                      snapshot=prefix) from None
            await asyncio.to_thread(shutil.rmtree, incoming, True)
            if previous is not None:
                await pool.delete_subvolume(previous)
            previous = dest
    except BaseException:
        await asyncio.shield(pool.delete_subvolume(work))
        raise
    assert previous is not None and manifest is not None
    log.info("backup.chain_received", sandbox=sandbox_id, chain=chain, links=upto + 1)
    return previous / "rootfs", manifest
