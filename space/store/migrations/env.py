"""Alembic environment for the SPACE store.

``Store.open`` runs the migrations itself on an open connection (``config.attributes["connection"]``,
handed over through ``AsyncConnection.run_sync``). Run by hand, e.g. to autogenerate a revision,
the database comes from the ``sqlalchemy.url`` option or ``$SPACE_DATABASE_URL`` and is driven
through an async engine in the same way. To autogenerate a new revision against a database
migrated to head::

    from alembic import command
    from space.store.db import alembic_config
    cfg = alembic_config()
    cfg.set_main_option("sqlalchemy.url", "sqlite+aiosqlite:////tmp/dev.db")
    command.revision(cfg, "add snapshots", autogenerate=True)
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import Connection, TypeDecorator

from space.store.db import create_engine
from space.store.models import Base

config = context.config
target_metadata = Base.metadata


def _render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    # Migrations are frozen history: spell our TypeDecorators as the plain types they store,
    # so that an old migration never imports model code that may have changed since.
    if type_ == "type" and isinstance(obj, TypeDecorator):
        autogen_context.imports.add("import sqlalchemy as sa")
        return f"sa.{obj.impl_instance!r}"
    return False


def _configure(**kw: Any) -> None:
    context.configure(
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite can only ALTER through table copies
        render_item=_render_item,
        compare_type=True,
        **kw,
    )


def _run(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("SPACE_DATABASE_URL")
    if not url:
        raise SystemExit("set sqlalchemy.url or SPACE_DATABASE_URL")
    return url


async def _run_async() -> None:
    engine = create_engine(_url())
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()
elif (connection := config.attributes.get("connection")) is not None:
    _run(connection)
else:
    asyncio.run(_run_async())
