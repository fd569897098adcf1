"""Continuous disk backup: the node ships each configured sandbox's root as a chain of incremental
links (:mod:`space.node.storage.backup_chain`) while it runs.

The control plane configures a sandbox (``PUT /v1/sandboxes/<id>/backup``: where its chain lives,
how often to look); from then on this node, on its own:

- every ``every`` seconds asks whether the root changed since the last link: the root's btrfs
  generation (after a ``syncfs``) against the last link's, which is the transaction that took it.
  Unchanged, the backup is as fresh as that look (``disk_at`` moves on, nothing is shipped);
- changed, takes a read-only snapshot of the root (the guest is not frozen: a disk snapshot is an
  atomic btrfs operation, the same one a scheduled disk snapshot is) and ships it as the next link,
  against the previous link, which it then lets go (only the newest link stays on the node);
- every ``chain_links`` links starts a new chain, its link 0 against the template;
- ships one link at a time per node, each at no more than ``bytes_per_s``: a backup never starves
  the node's disk or network of what its sandboxes need.

The state (chain, sequence, generation, times) is written beside the sandbox's own, so an agent
restart continues the chain. A failure is recorded and retried on the next look; nothing here ever
touches the running sandbox beyond the snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from space.errors import InvalidRequest, NotFound, SpaceError
from space.node.storage.artifacts import SealingSpec
from space.node.storage.backup_chain import DEFAULT_CHAIN_LINKS, MAX_CHAIN_LINKS

if TYPE_CHECKING:
    from space.node.sandboxes.manager import SandboxManager

log = structlog.get_logger("space.node.sandboxes.backups")

STATE_FILE = "backup.json"
LINKS_DIR = "backup"
#: The shortest interval a sandbox may ask for (tests use it); the control plane's default is 60 s.
MIN_EVERY = 1.0
#: Default node-wide cap on backup upload bandwidth.
DEFAULT_BYTES_PER_S = 64 << 20


@dataclasses.dataclass
class BackupState:
    tenant: str
    #: The sandbox's backup prefix in object storage (``tenants/<t>/sandboxes/<s>/backup``).
    prefix: str
    every: float
    chain_links: int = DEFAULT_CHAIN_LINKS
    chain: str | None = None
    #: The newest shipped link of ``chain`` (-1: none yet).
    seq: int = -1
    #: The generation of the newest link's snapshot: the root unchanged since has this generation.
    generation: int | None = None
    #: When the newest link was taken; ``disk_at`` also moves on with every look that found no change.
    link_at: float | None = None
    disk_at: float | None = None
    looked_at: float = 0.0
    links_shipped: int = 0
    bytes_shipped: int = 0
    #: The last failure (cleared by the next success), for the control plane and ``space sandbox get``.
    error: str | None = None
    #: How links are encrypted (:meth:`SealingSpec.to_json`: the tenant's key and the sandbox's
    #: shred secret, kept beside the sandbox's own files while it lives here); None: they are not.
    sealing: dict[str, Any] | None = None

    @property
    def sealing_spec(self) -> SealingSpec | None:
        return None if self.sealing is None else SealingSpec.from_json(self.sealing)

    def public(self) -> dict[str, Any]:
        return {"chain": self.chain, "seq": self.seq, "disk_at": self.disk_at, "link_at": self.link_at,
                "links_shipped": self.links_shipped, "bytes_shipped": self.bytes_shipped, "error": self.error,
                "every": self.every, "prefix": self.prefix,
                # The key new links are sealed under (never the shred secret): the control plane
                # reconfigures a sandbox whose tenant changed keys.
                "key": None if self.sealing is None else self.sealing["key"]}


def parse_config(body: dict[str, Any], *, sandbox_id: str) -> tuple[str, str, float, int]:
    """The control plane's configuration: (tenant, prefix, every, chain_links); refused if odd
    (its sealing: :func:`parse_sealing`)."""
    tenant, prefix, every = body.get("tenant"), body.get("prefix"), body.get("every", 60)
    links = body.get("chain_links", DEFAULT_CHAIN_LINKS)
    if not isinstance(tenant, str) or not tenant:
        raise InvalidRequest("a backup needs the sandbox's tenant", field="tenant")
    if not isinstance(prefix, str) or not prefix.rstrip("/").endswith(f"/{sandbox_id}/backup"):
        raise InvalidRequest(f"a backup of {sandbox_id} lives under its own prefix (…/{sandbox_id}/backup)",
                             field="prefix")
    if isinstance(every, bool) or not isinstance(every, int | float) or not MIN_EVERY <= every <= 86400:
        raise InvalidRequest(f"backup interval must be {MIN_EVERY:g} to 86400 seconds", field="every")
    if isinstance(links, bool) or not isinstance(links, int) or not 1 <= links <= MAX_CHAIN_LINKS:
        raise InvalidRequest(f"chain_links must be 1 to {MAX_CHAIN_LINKS}", field="chain_links")
    return tenant, prefix.rstrip("/"), float(every), links


def parse_sealing(body: dict[str, Any]) -> dict[str, Any] | None:
    """The configuration's sealing, checked, as the state keeps it."""
    raw = body.get("sealing")
    return None if raw is None else SealingSpec.from_json(raw).to_json()


class Backups:
    def __init__(self, manager: SandboxManager, *, bytes_per_s: float | None = DEFAULT_BYTES_PER_S) -> None:
        self.manager = manager
        self.bytes_per_s = bytes_per_s
        self._states: dict[str, BackupState] = {}
        #: One link ships at a time on this node.
        self._shipping = asyncio.Lock()
        self._per_sandbox: dict[str, asyncio.Lock] = {}
        self._inflight: dict[str, asyncio.Task[dict[str, Any]]] = {}

    # -- state ----------------------------------------------------------------------------------

    def _dir(self, sandbox_id: str) -> Path:
        return self.manager.pool.sandbox_dir(sandbox_id)

    def _save(self, sandbox_id: str, st: BackupState) -> None:
        d = self._dir(sandbox_id)
        if not d.is_dir():
            return  # the sandbox went meanwhile
        tmp = d / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(st)))
        os.replace(tmp, d / STATE_FILE)

    def recover(self) -> None:
        """Pick up the configured sandboxes' chains after an agent restart."""
        for sb in self.manager.list():
            try:
                raw = json.loads((self._dir(sb.id) / STATE_FILE).read_text())
                fields = {f.name for f in dataclasses.fields(BackupState)}
                self._states[sb.id] = BackupState(**{k: v for k, v in raw.items() if k in fields})
            except FileNotFoundError:
                continue
            except (OSError, ValueError, TypeError):
                log.warning("backup.unreadable_state", sandbox=sb.id)

    def configure(self, sandbox_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """Start (or retune) backing up ``sandbox_id``. A new prefix or tenant starts a new chain."""
        self.manager.get(sandbox_id)
        tenant, prefix, every, links = parse_config(body, sandbox_id=sandbox_id)
        sealing = parse_sealing(body)
        st = self._states.get(sandbox_id)
        if st is None or (st.tenant, st.prefix) != (tenant, prefix):
            st = BackupState(tenant=tenant, prefix=prefix, every=every, chain_links=links, sealing=sealing)
        else:
            # A new key (a rotation) seals the next link; the links before keep theirs, each
            # link's manifest naming its own.
            st.every, st.chain_links, st.sealing = every, links, sealing
        self._states[sandbox_id] = st
        self._save(sandbox_id, st)
        return st.public()

    def forget(self, sandbox_id: str) -> None:
        """The sandbox left this node (deleted, suspended, moved): its chain is not continued here."""
        self._states.pop(sandbox_id, None)
        self._per_sandbox.pop(sandbox_id, None)

    async def stop(self, sandbox_id: str) -> None:
        """Before the sandbox's directory goes: cancel a link in flight (a subvolume being sent
        cannot be deleted) and forget the chain."""
        self.forget(sandbox_id)
        task = self._inflight.get(sandbox_id)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def disable(self, sandbox_id: str) -> None:
        """Stop backing ``sandbox_id`` up (its interval became off): what was shipped stays shipped,
        and an agent restart does not pick the chain up again."""
        await self.stop(sandbox_id)
        with contextlib.suppress(FileNotFoundError):
            (self._dir(sandbox_id) / STATE_FILE).unlink()

    def status(self) -> dict[str, dict[str, Any]]:
        """Every configured sandbox's backup, for the heartbeat: what is durable and how old."""
        live = {sb.id for sb in self.manager.list()}
        for gone in [sid for sid in self._states if sid not in live]:
            self.forget(gone)
        return {sid: st.public() for sid, st in self._states.items()}

    # -- shipping -------------------------------------------------------------------------------

    def _due(self, now: float) -> list[str]:
        # A fenced copy is not shipped: it may be running elsewhere already, from this chain.
        running = {sb.id for sb in self.manager.list() if sb.status in ("running", "paused") and not sb.fenced}
        return [sid for sid, st in self._states.items() if sid in running and now - st.looked_at >= st.every]

    async def run(self, every: float = 1.0) -> None:
        """Look at every configured sandbox whose interval passed, one after another, forever."""
        while True:
            for sid in self._due(time.time()):
                task = self._inflight[sid] = asyncio.create_task(self.back_up(sid))
                try:
                    await asyncio.shield(task)
                except NotFound:
                    self.forget(sid)
                except SpaceError as exc:  # recorded on its state by back_up; retried next time
                    log.warning("backup.failed", sandbox=sid, error=exc.message[:300])
                except asyncio.CancelledError:
                    if not task.cancelled():  # this loop is being stopped, not that one link
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
                        raise
                except Exception:  # a bug must not stop every other sandbox's backup
                    log.exception("backup.crashed", sandbox=sid)
                finally:
                    if self._inflight.get(sid) is task:
                        del self._inflight[sid]
            await asyncio.sleep(every)

    async def back_up(self, sandbox_id: str) -> dict[str, Any]:
        """One look: ship the next link if the root changed since the last one. Returns the state."""
        lock = self._per_sandbox.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            st = self._states.get(sandbox_id)
            if st is None:
                raise NotFound(f"sandbox {sandbox_id} has no backup configured on this node", sandbox_id=sandbox_id)
            looked = time.time()
            try:
                shipped = await self._look(sandbox_id, st)
            except SpaceError as exc:
                st.error = exc.message[:500]
                st.looked_at = looked
                self._save(sandbox_id, st)
                raise
            st.looked_at = looked
            st.error = None
            if not shipped:
                st.disk_at = looked
            self._save(sandbox_id, st)
            return st.public()

    async def _look(self, sandbox_id: str, st: BackupState) -> bool:
        pool = self.manager.pool
        links = self._dir(sandbox_id) / LINKS_DIR
        newest = links / _link_name(st.chain, st.seq) / "rootfs" if st.chain is not None and st.seq >= 0 else None
        if newest is not None and not await pool.is_subvolume(newest):
            # The node lost its copy of the last link (a restore over the directory, a crash
            # between the ship and the save): the next delta has nothing to start from.
            newest, st.chain, st.seq = None, None, -1
        if (newest is not None and st.generation is not None
                and await self.manager.root_generation(sandbox_id) == st.generation):
            return False
        new_chain = st.chain is None or st.seq + 1 >= st.chain_links
        chain = _new_chain_id() if new_chain else st.chain
        assert chain is not None
        seq = 0 if new_chain else st.seq + 1
        dest = links / _link_name(chain, seq)
        await pool.delete_subvolume(dest)  # an interrupted attempt's leftover
        await asyncio.to_thread(dest.mkdir, parents=True)
        try:
            sb = await self.manager.backup_snapshot(sandbox_id, dest / "rootfs")
            taken = time.time()
            generation = await pool.generation(dest / "rootfs")
            parent = pool.template_path(sb.template, sb.template_digest) if new_chain else newest
            assert parent is not None
            async with self._shipping:
                manifest = await self.manager.ship_backup_link(
                    sandbox_id, prefix=st.prefix, tenant=st.tenant, chain=chain, seq=seq, root=dest / "rootfs",
                    parent=parent, bytes_per_s=self.bytes_per_s, sealing=st.sealing_spec)
        except BaseException:
            await asyncio.shield(pool.delete_subvolume(dest))
            raise
        if newest is not None:
            with contextlib.suppress(SpaceError):
                await pool.delete_subvolume(newest.parent)
        st.chain, st.seq, st.generation = chain, seq, generation
        st.link_at = st.disk_at = taken
        st.links_shipped += 1
        st.bytes_shipped += manifest.total_size
        log.info("backup.link_shipped", sandbox=sandbox_id, chain=chain, seq=seq, bytes=manifest.total_size,
                 new_chain=new_chain)
        return True


def _link_name(chain: str | None, seq: int) -> str:
    return f"{chain}-{seq:06d}"


def _new_chain_id() -> str:
    """Sortable by time, unique without coordination (two nodes may both start one)."""
    return f"c{int(time.time() * 1000):013d}{secrets.token_hex(3)}"

