"""Templates (their build status and spec) and the warm pools kept for them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from space.errors import InvalidRequest
from space.store.base import StoreBase
from space.store.models import TEMPLATE_STATUSES, Template, WarmPool, utcnow


class TemplateStore(StoreBase):
    """Templates and warm pools."""

    # ---- templates ------------------------------------------------------------------------------

    async def upsert_template(
        self,
        name: str,
        *,
        digest: str,
        status: str,
        spec: dict[str, Any],
        size_bytes: int | None = None,
        error: str | None = None,
    ) -> Template:
        if status not in TEMPLATE_STATUSES:
            raise InvalidRequest(
                f"invalid template status {status!r}: must be one of {', '.join(TEMPLATE_STATUSES)}"
            )
        now = utcnow()
        values = {"digest": digest, "status": status, "spec": spec, "size_bytes": size_bytes,
                  "error": error, "updated_at": now}
        stmt = self._insert(Template).values(name=name, created_at=now, **values)
        stmt = stmt.on_conflict_do_update(
            index_elements=[Template.name], set_=values
        )
        async with self._tx() as s:
            await s.execute(stmt)
            return await self._get(s, Template, name, "template")

    async def get_template(self, name: str) -> Template:
        async with self._tx(write=False) as s:
            return await self._get(s, Template, name, "template")

    async def list_templates(self) -> list[Template]:
        async with self._tx(write=False) as s:
            return list(await s.scalars(select(Template).order_by(Template.name)))

    # ---- warm pools -----------------------------------------------------------------------------

    async def set_warm_pool(self, template: str, *, cpu: float, memory_mb: int, size: int) -> WarmPool:
        """Set how many ready sandboxes each node keeps for ``template`` at this size; 0 removes it."""
        if size < 0:
            raise InvalidRequest("a warm pool size cannot be negative")
        now = utcnow()
        async with self._tx() as s:
            row = await s.get(WarmPool, (template, cpu, memory_mb))
            if size == 0:
                if row is not None:
                    await s.delete(row)
                return WarmPool(template=template, cpu=cpu, memory_mb=memory_mb, size=0,
                                created_at=now, updated_at=now)
            if row is None:
                row = WarmPool(template=template, cpu=cpu, memory_mb=memory_mb, size=size,
                               created_at=now, updated_at=now)
                s.add(row)
            else:
                row.size = size
                row.updated_at = now
            await s.flush()
            return row

    async def list_warm_pools(self) -> list[WarmPool]:
        async with self._tx(write=False) as s:
            return list(await s.scalars(
                select(WarmPool).order_by(WarmPool.template, WarmPool.cpu, WarmPool.memory_mb)
            ))
