"""Shred secrets: the second half of every key a tenant's stored snapshots are encrypted under
(the first is the data key its KMS wraps, kept in the snapshot's manifest). A sandbox's own
snapshots and backups use the sandbox's; a retained snapshot, which outlives its sandbox, has its
own. Only this database holds them: destroying one (``""``) makes every object made with it
unreadable, even to whoever holds a copy of the bucket and the tenant's key (crypto-shredding)."""

from __future__ import annotations

import base64
import os

from sqlalchemy import select, update

from space.errors import KeyUnavailable, NotFound
from space.store.base import StoreBase
from space.store.models import Sandbox, Snapshot

SHRED_BYTES = 32
#: A destroyed secret: never made again, so nothing sealed under it opens again.
DESTROYED = ""


class ShredStore(StoreBase):
    async def shred_secret(self, *, sandbox_id: str | None = None, snapshot_id: str | None = None) -> bytes:
        """The sandbox's (or retained snapshot's) shred secret, made on first use; KeyUnavailable
        once destroyed, NotFound without the row."""
        model, key = _row(sandbox_id, snapshot_id)
        async with self._tx(write=False) as s:
            stored = (await s.execute(select(model.shred).where(model.id == key))).first()
        if stored is not None and stored[0] is None:
            fresh = base64.b64encode(os.urandom(SHRED_BYTES)).decode()
            async with self._tx() as s:
                # Conditional: two first uses at once agree on the first one stored.
                await s.execute(update(model).where(model.id == key, model.shred.is_(None)).values(shred=fresh)
                                .execution_options(synchronize_session=False))
                stored = (await s.execute(select(model.shred).where(model.id == key))).first()
        if stored is None or stored[0] is None:
            raise NotFound(f"{_what(sandbox_id)} {key} not found", id=key)
        if stored[0] == DESTROYED:
            raise KeyUnavailable(f"the keys of {_what(sandbox_id)} {key} were destroyed with it: its stored "
                                 f"objects cannot be decrypted", key=key, provider="shred")
        return base64.b64decode(stored[0])

    async def destroy_shred(self, *, sandbox_id: str | None = None, snapshot_id: str | None = None) -> None:
        """Destroy the secret (the sandbox or retained snapshot is being deleted): from this commit
        on, nothing sealed with it can be decrypted."""
        model, key = _row(sandbox_id, snapshot_id)
        async with self._tx() as s:
            await s.execute(update(model).where(model.id == key).values(shred=DESTROYED)
                            .execution_options(synchronize_session=False))


def _row(sandbox_id: str | None, snapshot_id: str | None) -> tuple[type[Sandbox] | type[Snapshot], str]:
    if (sandbox_id is None) == (snapshot_id is None):
        raise ValueError("exactly one of sandbox_id and snapshot_id")
    return (Sandbox, sandbox_id) if sandbox_id is not None else (Snapshot, snapshot_id)  # type: ignore[return-value]


def _what(sandbox_id: str | None) -> str:
    return "sandbox" if sandbox_id is not None else "snapshot"
