"""Templates (their build status and spec), their tags, and the warm pools kept for them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import delete, select

from space.errors import InvalidRequest, NotFound
from space.store.base import StoreBase, _rowcount
from space.store.models import TEMPLATE_STATUSES, Template, TemplateTag, WarmPool, utcnow

#: A tag: what a template name may hold, up to 128 characters (no ':', which separates it).
TAG_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_tag(tag: str) -> str:
    """``tag`` if it is a valid tag, else InvalidRequest naming it."""
    if not TAG_RE.fullmatch(tag):
        raise InvalidRequest(f"invalid tag {tag[:140]!r}: 1-128 letters, digits, '.', '_' and '-', "
                             "starting with a letter or digit", field="tags")
    return tag


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

    # ---- tags -----------------------------------------------------------------------------------

    async def tag_template(self, template: str, tags: Sequence[str], *, digest: str,
                           build_id: str) -> list[TemplateTag]:
        """Point each of ``tags`` at one build of ``template`` (moving a tag another build had)."""
        for tag in tags:
            check_tag(tag)
        now = utcnow()
        async with self._tx() as s:
            for tag in dict.fromkeys(tags):
                values = {"digest": digest, "build_id": build_id, "created_at": now}
                stmt = self._insert(TemplateTag).values(template=template, tag=tag, **values)
                await s.execute(stmt.on_conflict_do_update(
                    index_elements=[TemplateTag.template, TemplateTag.tag], set_=values))
            rows = await s.scalars(select(TemplateTag).where(TemplateTag.template == template,
                                                             TemplateTag.tag.in_(list(tags))))
            return sorted(rows, key=lambda r: list(tags).index(r.tag))

    async def get_template_tag(self, template: str, tag: str) -> TemplateTag:
        async with self._tx(write=False) as s:
            row = await s.get(TemplateTag, (template, tag))
        if row is None:
            raise NotFound(f"template {template} has no tag {tag!r}", template=template, tag=tag)
        return row

    async def list_template_tags(self, template: str) -> list[TemplateTag]:
        async with self._tx(write=False) as s:
            return list(await s.scalars(select(TemplateTag).where(TemplateTag.template == template)
                                        .order_by(TemplateTag.created_at, TemplateTag.tag)))

    async def untag_template(self, template: str, tags: Sequence[str]) -> int:
        """Remove ``tags`` from ``template``: how many there were."""
        async with self._tx() as s:
            result = await s.execute(delete(TemplateTag).where(TemplateTag.template == template,
                                                               TemplateTag.tag.in_(list(tags))))
            return _rowcount(result)

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
