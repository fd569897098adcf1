"""Secret rows (sealed values or vault references; never a value in clear)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select, update

from space import ids
from space.errors import Conflict, NotFound
from space.store.base import StoreBase, _rowcount
from space.store.models import Secret, utcnow

#: Secret columns a replace (``put_secret`` on an existing name) takes from the new row.
_SECRET_COPY = ("backend", "ciphertext", "ref", "key_id", "hosts", "header", "format", "expires_at",
                "rate_limit")


class SecretStore(StoreBase):
    """Secret rows only: validation, encryption and auditing are space.credentials' business. A
    row never holds a value in clear (``ciphertext`` or a vault ``ref``)."""

    async def put_secret(self, row: Secret) -> tuple[Secret, bool]:
        """Create a secret, or replace the tenant's secret of the same scope and name (its id,
        ``created_at`` and ``created_by`` stay). Returns the stored row and whether it is new."""
        for attempt in range(2):
            now = utcnow()
            try:
                async with self._tx() as s:
                    found = await s.scalar(
                        select(Secret).where(Secret.tenant == row.tenant, Secret.scope == row.scope,
                                             Secret.name == row.name).with_for_update()
                    )
                    if found is None:
                        fresh = Secret(**{f: getattr(row, f) for f in _SECRET_COPY},
                                       id=row.id or ids.secret_id(), tenant=row.tenant, scope=row.scope,
                                       name=row.name, created_by=row.created_by or "",
                                       created_at=now, updated_at=now)
                        s.add(fresh)
                        return fresh, True
                    for f in _SECRET_COPY:
                        setattr(found, f, getattr(row, f))
                    found.updated_at = now
                    return found, False
            except Conflict:
                # A concurrent create of the same name committed first: replace that one.
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def get_secret(self, tenant: str, scope: str, name: str) -> Secret:
        async with self._tx(write=False) as s:
            row = await s.scalar(select(Secret).where(Secret.tenant == tenant, Secret.scope == scope,
                                                      Secret.name == name))
        if row is None:
            raise NotFound(f"secret {name} not found in scope {scope}", secret=name, scope=scope)
        return row

    async def list_secrets(
        self,
        tenant: str | None,
        *,
        scopes: Sequence[str] | None = None,
        names: Sequence[str] | None = None,
        backend: str | None = None,
    ) -> list[Secret]:
        """Secrets by name then scope; ``tenant=None`` is every tenant (key rotation)."""
        q = select(Secret).order_by(Secret.name, Secret.scope)
        if tenant is not None:
            q = q.where(Secret.tenant == tenant)
        if scopes is not None:
            q = q.where(Secret.scope.in_(list(scopes)))
        if names is not None:
            q = q.where(Secret.name.in_(list(names)))
        if backend is not None:
            q = q.where(Secret.backend == backend)
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def delete_secret(self, tenant: str, scope: str, name: str) -> Secret:
        """Delete the row and return it (its backend may still hold the value to forget)."""
        async with self._tx() as s:
            row = await s.scalar(select(Secret).where(Secret.tenant == tenant, Secret.scope == scope,
                                                      Secret.name == name).with_for_update())
            if row is None:
                raise NotFound(f"secret {name} not found in scope {scope}", secret=name, scope=scope)
            await s.delete(row)
            return row

    async def reseal_secret(self, secret_id: str, *, old_key_id: str | None, ciphertext: bytes,
                            key_id: str) -> bool:
        """Swap in a value re-encrypted under another key, unless the row changed meanwhile
        (then False: a concurrent set already sealed it anew)."""
        async with self._tx() as s:
            res = await s.execute(
                update(Secret)
                .where(Secret.id == secret_id, Secret.backend == "builtin",
                       Secret.key_id == old_key_id if old_key_id is not None else Secret.key_id.is_(None))
                .values(ciphertext=ciphertext, key_id=key_id)
                .execution_options(synchronize_session=False)
            )
            return _rowcount(res) == 1
