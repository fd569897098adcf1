"""Schema: the migrations create exactly the models' schema, on both dialects.

- ``alembic upgrade head`` (run by ``Store.open``) leaves no autogenerate difference
- the database is stamped at the head revision; reopening is a no-op; downgrade/upgrade round-trips
- SQLite connections carry WAL, foreign keys, busy_timeout and synchronous=NORMAL (and a plain
  ``sqlite:///`` URL gets the async driver and its parent directories)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect, text

from space.errors import InvalidRequest
from space.store import Store
from space.store.db import alembic_config
from space.store.models import Base

pytestmark = pytest.mark.anyio

TABLES = {"api_keys", "nodes", "templates", "sandboxes", "operations", "operation_logs", "snapshots",
          "sandbox_events", "warm_pools", "audit_log", "tenant_quotas", "secrets", "leases", "join_tokens",
          "template_tags"}


def _diff(conn: Connection) -> list[Any]:
    ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
    return list(compare_metadata(ctx, Base.metadata))


async def test_migrated_schema_matches_models(store: Store) -> None:
    async with store._engine.connect() as conn:
        diff = await conn.run_sync(_diff)
        tables = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    assert diff == []
    assert tables == TABLES | {"alembic_version"}


async def test_alembic_check_through_env(store: Store) -> None:
    """``alembic check`` through our env.py (its compare options) finds nothing to generate."""
    async with store._engine.connect() as conn:
        await conn.run_sync(lambda c: command.check(alembic_config(c)))


async def test_stamped_at_head_and_reopen_is_noop(store: Store) -> None:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    async with store._engine.connect() as conn:
        current = await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
    assert current == head == "0021"
    again = await Store.open(store.url)  # a second replica starting up
    await again.close()


async def test_downgrade_then_upgrade(store: Store) -> None:
    def down(conn: Connection) -> set[str]:
        command.downgrade(alembic_config(conn), "base")
        return set(inspect(conn).get_table_names())

    def up(conn: Connection) -> list[Any]:
        command.upgrade(alembic_config(conn), "head")
        return _diff(conn)

    async with store._engine.begin() as conn:
        assert await conn.run_sync(down) == {"alembic_version"}
    async with store._engine.begin() as conn:
        assert await conn.run_sync(up) == []


async def test_sqlite_pragmas(tmp_path: Path) -> None:
    async with await Store.open(f"sqlite:///{tmp_path}/sub/dir/space.db") as store:
        assert store.dialect == "sqlite"
        async with store._engine.connect() as conn:
            got = {p: (await conn.execute(text(f"PRAGMA {p}"))).scalar()
                   for p in ("journal_mode", "foreign_keys", "busy_timeout", "synchronous")}
    assert got == {"journal_mode": "wal", "foreign_keys": 1, "busy_timeout": 5000, "synchronous": 1}


@pytest.mark.parametrize("url", ["mysql+aiomysql://x/y", "sqlite+aiosqlite://", "not a url"])
async def test_unsupported_urls(url: str) -> None:
    with pytest.raises(InvalidRequest):
        await Store.open(url)
