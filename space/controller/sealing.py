"""Bring your own key, the control plane's half: what it sends a node with every request that
ships a snapshot to object storage or fetches one back (``sealing``: the tenant's key and the shred
secret of what the snapshot belongs to).

The node does the cryptography (:mod:`space.node.storage.artifacts`); the control plane decides
whose key and which secret:

- the key: the tenant's own (``space tenant key set``), else the deployment's, the local
  keyring's key named after the tenant. A fetch opens a snapshot under the key its manifest names,
  so a tenant that changed keys still reads what it stored before (until a rotation re-wraps it);
- the shred secret: the sandbox's, for its own snapshots and backups; a retained snapshot's own
  (it is stored under ``tenants/<t>/snapshots/<id>`` and outlives its sandbox). Deleting the
  sandbox or the retained snapshot destroys it (:mod:`space.store.shreds`).

``enabled=False`` (``--no-object-encryption``) ships snapshots unencrypted, for nodes that have
no key providers yet; what was sealed before still needs its key.
"""

from __future__ import annotations

import base64
from typing import Any

from space.controller.prefixes import retained_prefix
from space.kms import LOCAL, KeyRef
from space.store import Store
from space.store.models import Sandbox, Snapshot


class Sealer:
    def __init__(self, store: Store, *, enabled: bool = True) -> None:
        self.store = store
        self.enabled = enabled

    async def key(self, tenant: str) -> KeyRef:
        """The key what the tenant stores from now on is sealed under."""
        own = await self.store.tenant_key(tenant)
        return KeyRef(*own) if own is not None else deployment_key(tenant)

    async def for_sandbox(self, sb: Sandbox) -> dict[str, Any] | None:
        """For the sandbox's own snapshots and backups (a suspend, a move, a carried snapshot, a
        backup chain, and fetching any of them back)."""
        if not self.enabled:
            return None
        shred = await self.store.shred_secret(sandbox_id=sb.id)
        return _sealing(await self.key(sb.tenant), shred)

    async def for_snapshot(self, snap: Snapshot, prefix: str | None = None) -> dict[str, Any] | None:
        """For ``snap`` stored at ``prefix`` (default: where it is): a retained snapshot's own
        secret, else its sandbox's."""
        if not self.enabled:
            return None
        if (prefix if prefix is not None else snap.object_key) == retained_prefix(snap):
            shred = await self.store.shred_secret(snapshot_id=snap.id)
        else:
            shred = await self.store.shred_secret(sandbox_id=snap.sandbox_id)
        return _sealing(await self.key(snap.tenant), shred)


def deployment_key(tenant: str) -> KeyRef:
    """A tenant without a key of its own: the deployment's local keyring's key named after it."""
    return KeyRef(LOCAL, tenant)


def _sealing(key: KeyRef, shred: bytes) -> dict[str, Any]:
    return {"key": key.to_json(), "shred": base64.b64encode(shred).decode()}
