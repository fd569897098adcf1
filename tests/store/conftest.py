"""The store suite runs every test on SQLite (a temporary file) and on PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import NullPool, text
from sqlalchemy.ext.asyncio import create_async_engine

from space.store import Store


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def reset_postgres(url: str) -> None:
    """Give the next test an empty database: drop everything in ``public``."""
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
            await conn.execute(text("CREATE SCHEMA public"))
    finally:
        await engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/space.db"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    if store_url.startswith("postgresql"):
        await reset_postgres(store_url)
    st = await Store.open(store_url)
    try:
        yield st
    finally:
        await st.close()
