"""``space serve --database-url postgresql+asyncpg://...``: the same platform on PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from tests.e2e.harness import Server, create_sandbox, run, wait_operation

pytestmark = [pytest.mark.runtime, pytest.mark.postgres]


async def _reset_schema(url: str) -> None:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute("DROP SCHEMA IF EXISTS public CASCADE; CREATE SCHEMA public;")
    finally:
        await conn.close()


def test_serve_on_postgresql(fresh_server: Server, postgres_url: str) -> None:
    asyncio.run(_reset_schema(postgres_url))
    fresh_server.extra_args = ["--database-url", postgres_url]
    fresh_server.start()
    with fresh_server.client() as api:
        sid = create_sandbox(api)
        assert run(api, sid, {"shell": "echo pg"})[:2] == (0, b"pg\n")
        d = api.delete(f"/v1/sandboxes/{sid}").json()
        assert wait_operation(api, d["operation"]["id"])["status"] == "succeeded"
    # The rows are in PostgreSQL, not in a SQLite file of the data dir.
    assert not (fresh_server.data_dir / "control" / "space.db").exists()
