"""Continuous backup, the control plane's half: configure each sandbox's node to back its disk up,
record what the node reports as durable, and drop chains a newer one replaced.

The node does the work (:mod:`space.node.sandboxes.backups`); the leader, on every heartbeat of a
node, makes the node's configured set match the rows (a sandbox running there whose interval says it
is backed up, and not configured there yet, is configured; a change of interval is pushed: the
interval is the sandbox policy's ``backup_every``, else its tenant's, else the deployment's), and stores each
report on its sandbox's row (``Store.record_backup``: only while the sandbox is on that node). When
the reported chain differs from the recorded one, the recorded one is superseded (the node started a
new full base, or the sandbox moved and its new node started its own) and its objects are deleted,
after the row names the new chain: a restore never finds its chain gone.

The sandbox's memory is durable through its full checkpoints: with backup on, each scheduled full
checkpoint is also uploaded (:meth:`space.controller.lifecycle_ops.LifecycleOps._take`), and
``memory_at`` is the newest uploaded one's time.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import Any

import structlog

from space import retention
from space.controller.sealing import Sealer
from space.errors import SpaceError
from space.lifecycle import State
from space.node.api.client import NodeClient
from space.objstore import ObjectStore
from space.store import Sandbox, Store

log = structlog.get_logger("space.controller.backups")

#: Links per chain before the node starts a new full base (the node's own default too).
DEFAULT_CHAIN_LINKS = 30


def backup_prefix(sb: Sandbox) -> str:
    """Inside the sandbox's prefix: deleting the sandbox deletes its backup."""
    return f"tenants/{sb.tenant}/sandboxes/{sb.id}/backup"


def chain_prefix(prefix: str, chain: str) -> str:
    """Everything of one chain (the node's layout: ``<prefix>/<chain>/<seq>/…``)."""
    if not chain or "/" in chain or chain in (".", ".."):
        raise ValueError(f"not a chain id: {chain!r}")
    return f"{prefix.rstrip('/')}/{chain}/"


def backup_interval(sb: Sandbox, default: float | None) -> float | None:
    """Seconds between the node's looks at the sandbox's disk, or None when it is not backed up."""
    return retention.SnapshotPolicy.from_dict(sb.snapshot_policy or None).backup_interval(default)


def _at(value: Any) -> dt.datetime | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return dt.datetime.fromtimestamp(value, dt.UTC)
    return None


class BackupSync:
    def __init__(self, store: Store, objects: ObjectStore | None, *, every: float | None = None,
                 chain_links: int = DEFAULT_CHAIN_LINKS) -> None:
        self.store = store
        self.objects = objects
        #: The deployment's default interval (None: sandboxes are backed up only if their policy says).
        self.every = every
        self.chain_links = chain_links
        #: How links are encrypted (the controller shares its own with the lifecycle operations).
        self.sealer = Sealer(store)

    def resolve(self, sb: Sandbox, tenant_every: float | None) -> float | None:
        """The sandbox's interval: its own policy's, else its tenant's (``tenant_every``; 0: off),
        else the deployment's; None when it is not backed up."""
        if self.objects is None:
            return None
        try:
            return backup_interval(sb, self.every if tenant_every is None else tenant_every)
        except SpaceError:  # a policy stored before this field existed cannot be wrong, but be sure
            return None

    async def interval(self, sb: Sandbox) -> float | None:
        """:meth:`resolve` with the tenant's setting read now."""
        if self.objects is None:
            return None
        return self.resolve(sb, (await self.store.tenant_backup_every([sb.tenant])).get(sb.tenant))

    async def sync(self, node_id: str, node: NodeClient, info: dict[str, Any]) -> None:
        """One heartbeat's worth: configure what is missing, record what was reported."""
        if self.objects is None:
            return
        reported = info.get("backups") or {}
        if not isinstance(reported, dict):
            return
        rows = await self.store.list_sandboxes(states=[State.RUNNING.value, State.PAUSED.value], node_id=node_id)
        tenants = await self.store.tenant_backup_every(sb.tenant for sb in rows)
        keys: dict[str, dict[str, str] | None] = {}
        for sb in rows:
            every = self.resolve(sb, tenants.get(sb.tenant))
            rep = reported.get(sb.id)
            if every is not None and sb.tenant not in keys:
                keys[sb.tenant] = (await self.sealer.key(sb.tenant)).to_json() if self.sealer.enabled else None
            stale = every is not None and (not isinstance(rep, dict) or rep.get("every") != every
                                           or rep.get("prefix") != backup_prefix(sb))
            # A new key for the tenant (or a node from before keys): new links under it, and what
            # the node reports of its chain still counts.
            rekey = every is not None and not stale and isinstance(rep, dict) and rep.get("key") != keys[sb.tenant]
            if stale or rekey:
                try:
                    await node.call("PUT", f"/v1/sandboxes/{sb.id}/backup", timeout=10,
                                    json_body={"tenant": sb.tenant, "prefix": backup_prefix(sb), "every": every,
                                               "chain_links": self.chain_links,
                                               "sealing": await self.sealer.for_sandbox(sb)})
                except SpaceError as exc:  # the next heartbeat tries again
                    log.warning("backup.configure_failed", sandbox=sb.id, node=node_id, error=exc.message[:200])
                if stale:
                    continue
            if isinstance(rep, dict):
                await self.record(sb, node_id, rep)
                if every is None:
                    # Turned off (its policy or its tenant's): the node stops; the row keeps what is durable.
                    try:
                        await node.call("DELETE", f"/v1/sandboxes/{sb.id}/backup", timeout=10)
                    except SpaceError as exc:
                        log.warning("backup.disable_failed", sandbox=sb.id, node=node_id, error=exc.message[:200])

    async def record(self, sb: Sandbox, node_id: str, rep: dict[str, Any]) -> None:
        chain, seq, disk_at = rep.get("chain"), rep.get("seq"), _at(rep.get("disk_at"))
        if not isinstance(chain, str) or not isinstance(seq, int) or seq < 0 or disk_at is None:
            if rep.get("error") and (sb.backup or {}).get("error") != rep.get("error"):
                await self.store.record_backup(sb.id, node_id, {"error": rep["error"]})
            return
        old = sb.backup or {}
        new = {"node": node_id, "prefix": backup_prefix(sb), "chain": chain, "seq": seq,
               "disk_at": disk_at.isoformat(), "bytes": rep.get("bytes_shipped"), "error": rep.get("error")}
        if {k: old.get(k) for k in new} == new:
            return
        if not await self.store.record_backup(sb.id, node_id, new):
            return
        if old.get("chain") and old.get("chain") != chain and old.get("prefix") and self.objects is not None:
            # Superseded (a new base, or a new node's chain): recorded first, deleted now.
            with contextlib.suppress(SpaceError, ValueError):
                removed = await self.objects.delete_prefix(chain_prefix(str(old["prefix"]), str(old["chain"])))
                log.info("backup.chain_dropped", sandbox=sb.id, chain=old["chain"], objects=removed)
