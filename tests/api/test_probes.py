"""Liveness and readiness of an API replica, on a real store (SQLite and PostgreSQL).

- ``/healthz`` (liveness) asks nothing it depends on: it answers while the database is down
- ``/readyz`` is 200 with the migration once the database answers at the code's head revision;
  503 naming both revisions when the schema is behind (another release is migrating); 503 when
  the database does not answer
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from alembic import command
from sqlalchemy.ext.asyncio import AsyncConnection

from space.api.app import create_app
from space.api.state import AppState
from space.controller import Controller, NodeRegistry
from space.errors import Unavailable
from space.store import Store, db

pytestmark = pytest.mark.anyio


@pytest.fixture
async def api(store: Store) -> AsyncIterator[httpx.AsyncClient]:
    nodes = NodeRegistry(store)
    state = AppState(store=store, nodes=nodes, controller=Controller(store, nodes), secret=b"k" * 32)
    transport = httpx.ASGITransport(app=create_app(state))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as c:
            yield c
    finally:
        await state.audit.aclose()
        await nodes.aclose()


async def test_ready_at_head(api: httpx.AsyncClient) -> None:
    r = await api.get("/readyz")
    assert r.status_code == 200
    assert r.json() == {"status": "ready", "database": "ok", "migration": db.head_revision(), "nodes": 0}
    assert (await api.get("/healthz")).json() == {"status": "ok"}


async def test_unready_while_the_schema_is_behind(api: httpx.AsyncClient, store: Store) -> None:
    def downgrade(conn: Any) -> None:
        command.downgrade(db.alembic_config(conn), "-1")

    async with store._engine.begin() as conn:
        assert isinstance(conn, AsyncConnection)
        await conn.run_sync(downgrade)
    r = await api.get("/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "unready" and body["expected_migration"] == db.head_revision()
    assert body["migration"] != db.head_revision()
    assert (await api.get("/healthz")).status_code == 200


async def test_unready_without_a_database_but_alive(api: httpx.AsyncClient, store: Store,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    async def down() -> str | None:
        raise Unavailable("database unavailable: connection refused")

    monkeypatch.setattr(store, "schema_revision", down)
    r = await api.get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "unready"
    assert "connection refused" in r.json()["database"]
    assert (await api.get("/healthz")).json() == {"status": "ok"}
