"""API keys: created with a plaintext the store never keeps (only its SHA-256), authenticated,
listed and revoked."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import func, select

from space import ids
from space.errors import Conflict, InvalidRequest
from space.keyforms import API_KEY_PREFIX, canonical
from space.store.base import StoreBase
from space.store.models import API_KEY_ROLES, ApiKey, utcnow

__all__ = ["API_KEY_PREFIX", "ApiKeyStore", "hash_key"]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyStore(StoreBase):
    """API keys."""

    async def create_api_key(self, tenant: str, role: str, name: str = "") -> tuple[ApiKey, str]:
        """Create a key; returns the row and the plaintext key, which is never stored."""
        if role not in API_KEY_ROLES:
            raise InvalidRequest(f"invalid role {role!r}: must be one of {', '.join(API_KEY_ROLES)}")
        if not tenant:
            raise InvalidRequest("tenant must not be empty")
        key = API_KEY_PREFIX + secrets.token_urlsafe(30)  # 30 bytes -> 40 urlsafe characters
        row = ApiKey(
            id=ids.apikey_id(), tenant=tenant, role=role, name=name, prefix=key[:8],
            key_hash=hash_key(key), created_at=utcnow(), revoked_at=None,
        )
        async with self._tx() as s:
            s.add(row)
        return row, key

    async def authenticate(self, key: str) -> ApiKey | None:
        """The active key with this plaintext, in either spelling (:mod:`space.keyforms`), or None
        (unknown or revoked)."""
        async with self._tx(write=False) as s:
            row = await s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(canonical(key))))
        if row is None or row.revoked_at is not None:
            return None
        return row

    async def list_api_keys(
        self, tenant: str | None = None, *, include_revoked: bool = False
    ) -> list[ApiKey]:
        q = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
        if tenant is not None:
            q = q.where(ApiKey.tenant == tenant)
        if not include_revoked:
            q = q.where(ApiKey.revoked_at.is_(None))
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def revoke_api_key(self, key_id: str) -> None:
        """Revoke a key (idempotent: a revoked key keeps its first revocation time)."""
        async with self._tx() as s:
            row = await self._get(s, ApiKey, key_id, "api key", lock=True)
            if row.revoked_at is None:
                row.revoked_at = utcnow()

    async def seed_admin_key(self, tenant: str, key: str) -> bool:
        """Store ``key`` (given by the operator) as an admin key of ``tenant`` if no key exists at
        all. Several replicas may race to: the key's hash is unique, so one row results. Returns
        whether this call stored it."""
        try:
            async with self._tx() as s:
                if await s.scalar(select(func.count()).select_from(ApiKey)):
                    return False
                s.add(ApiKey(id=ids.apikey_id(), tenant=tenant, role="admin", name="bootstrap admin",
                             prefix=key[:8], key_hash=hash_key(key), created_at=utcnow(), revoked_at=None))
        except Conflict:  # another replica stored the same key first
            return False
        return True

    async def count_api_keys(self) -> int:
        """Active (unrevoked) keys: zero means the server must bootstrap an admin key."""
        async with self._tx(write=False) as s:
            n = await s.scalar(select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None)))
        return int(n or 0)
