"""Upgrading a live database: a store at revision 0001 holding a sandbox opens at head with the
row intact and the lifecycle columns at their neutral values (on both dialects)."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from alembic import command
from sqlalchemy import Connection

from space.lifecycle import State
from space.store import Store
from space.store.db import alembic_config, create_engine
from tests.store.conftest import reset_postgres

pytestmark = pytest.mark.anyio

CREATED = dt.datetime(2025, 11, 30, 8, 0, tzinfo=dt.UTC)

# The sandboxes table as revision 0001 made it: migrations are history, so not the model.
_SANDBOXES_0001 = sa.table(
    "sandboxes",
    *(sa.column(name) for name in ("id", "tenant", "template", "template_digest", "state",
                                   "node_id", "instance_id", "cpu", "memory_mb", "generation")),
    sa.column("env", sa.JSON()),
    sa.column("metadata", sa.JSON()),
    sa.column("created_at", sa.DateTime(timezone=True)),
    sa.column("updated_at", sa.DateTime(timezone=True)),
)


def _at_0001_with_a_sandbox(conn: Connection) -> None:
    command.upgrade(alembic_config(conn), "0001")
    conn.execute(sa.insert(_SANDBOXES_0001).values(
        id="sb-old", tenant="acme", template="base", template_digest="d1", state="running",
        node_id="n1", instance_id="i1", cpu=1.5, memory_mb=256, generation=3,
        env={"A": "1"}, metadata={"team": "x"},
        # SQLite keeps UTC wall time without a zone, as UTCDateTime writes it
        created_at=CREATED if conn.dialect.name == "postgresql" else CREATED.replace(tzinfo=None),
        updated_at=CREATED if conn.dialect.name == "postgresql" else CREATED.replace(tzinfo=None),
    ))


async def test_upgrade_from_0001_keeps_sandboxes(store_url: str) -> None:
    if store_url.startswith("postgresql"):
        await reset_postgres(store_url)
    engine = create_engine(store_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_at_0001_with_a_sandbox)
    finally:
        await engine.dispose()

    async with await Store.open(store_url) as store:
        sb = await store.get_sandbox("sb-old")
        assert (sb.state, sb.node_id, sb.cpu, sb.generation, sb.env, sb.meta, sb.created_at) == (
            State.RUNNING, "n1", 1.5, 3, {"A": "1"}, {"team": "x"}, CREATED)
        assert sb.snapshot_policy == {}
        assert (sb.idle_pause_s, sb.idle_suspend_s, sb.expires_at, sb.last_active_at, sb.parent_id,
                sb.source_snapshot, sb.snapshot_id) == (None,) * 7
        # the upgraded row takes the new columns like a new one
        await store.touch_sandbox("sb-old", CREATED)
        up = await store.update_sandbox("sb-old", snapshot_policy={"full": "1h"}, idle_pause_s=30)
        assert (up.snapshot_policy, up.idle_pause_s, up.last_active_at) == ({"full": "1h"}, 30, CREATED)
