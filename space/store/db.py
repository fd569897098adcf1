"""Engines and migrations.

SQLite is tuned for one process with many coroutines: WAL (readers never block the writer),
``busy_timeout`` (a writer waits for the lock instead of failing), ``synchronous=NORMAL`` (durable
at checkpoints, which is what WAL is for) and foreign keys on. The sqlite3 driver's own transaction
handling is turned off because it does not BEGIN before a SELECT, which breaks read-then-write;
instead we emit ``BEGIN IMMEDIATE`` for write transactions, so that a writer takes the lock up
front and waits for it under ``busy_timeout`` rather than failing halfway with SQLITE_BUSY when it
upgrades from reading to writing. Read transactions use a plain ``BEGIN`` and never block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, event, text
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from space.errors import InvalidRequest

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

#: Execution option that marks a write transaction (``BEGIN IMMEDIATE`` on SQLite).
WRITE_OPTION = "space_write"

#: Serializes concurrent ``Store.open`` calls from several control-plane replicas on PostgreSQL.
_PG_MIGRATION_LOCK = 0x5BACE_0001

_SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA foreign_keys=ON",
    "PRAGMA busy_timeout=5000",
    "PRAGMA synchronous=NORMAL",
)

_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
    "postgres": "postgresql+asyncpg",
    "postgresql": "postgresql+asyncpg",
    "postgresql+asyncpg": "postgresql+asyncpg",
}


def normalize_url(url: str) -> URL:
    """Parse a store URL; plain ``sqlite://`` / ``postgresql://`` get the async driver."""
    try:
        parsed = make_url(url)
    except Exception as e:
        raise InvalidRequest(f"invalid database url: {e}") from e
    driver = _DRIVERS.get(parsed.drivername)
    if driver is None:
        raise InvalidRequest(
            f"unsupported database url scheme {parsed.drivername!r}: "
            "use sqlite+aiosqlite:///path or postgresql+asyncpg://..."
        )
    parsed = parsed.set(drivername=driver)
    if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
        # Every pooled connection would get its own empty in-memory database.
        raise InvalidRequest("the sqlite store needs a file path: sqlite+aiosqlite:///path/space.db")
    return parsed


def create_engine(url: str | URL) -> AsyncEngine:
    parsed = normalize_url(url) if isinstance(url, str) else url
    if parsed.get_backend_name() == "sqlite":
        assert parsed.database is not None
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        # Every transaction ends in an explicit COMMIT or ROLLBACK (the session's begin() block), so
        # the pool's reset-on-return ROLLBACK is one more trip to aiosqlite's thread for nothing.
        engine = create_async_engine(parsed, pool_reset_on_return=None)
        _install_sqlite_hooks(engine)
        return engine
    return create_async_engine(parsed, pool_pre_ping=True)


def create_sqlite_fast_writer(engine: AsyncEngine) -> Engine | None:
    """A synchronous engine on the same SQLite file, for the one write on the create hot path
    (see ``Store.create_sandbox``): a two-row insert costs ~0.6 ms through it against ~3 ms through
    the async session and aiosqlite's thread. None for other databases."""
    if engine.dialect.name != "sqlite":
        return None
    url = engine.url.set(drivername="sqlite")
    fast = create_sync_engine(url, pool_size=1, max_overflow=0, pool_reset_on_return=None)
    _install_sqlite_hooks_on(fast)
    return fast


def _install_sqlite_hooks(engine: AsyncEngine) -> None:
    _install_sqlite_hooks_on(engine.sync_engine)


def _install_sqlite_hooks_on(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves, see the module doc
        cursor = dbapi_connection.cursor()
        try:
            for pragma in _SQLITE_PRAGMAS:
                cursor.execute(pragma)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config built in code: the migrations ship inside the package, no ini file."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest migration this code ships."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(connection: Connection) -> str | None:
    """The migration the database is stamped at (None: never migrated)."""
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection).get_current_revision()


def _upgrade(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
    command.upgrade(alembic_config(connection), "head")
    if connection.dialect.name == "sqlite":
        broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        if broken:
            raise RuntimeError(f"migration left rows violating foreign keys: {broken[:5]}")


def _sqlite_foreign_keys(connection: Connection, on: bool) -> None:
    # A PRAGMA outside any transaction, on the driver connection, so no BEGIN is emitted first.
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")
    finally:
        cursor.close()


async def migrate(engine: AsyncEngine) -> None:
    """``alembic upgrade head`` in one transaction (DDL is transactional on both dialects).

    On SQLite, foreign keys are off while migrating: Alembic's batch mode rebuilds a table by
    copying and dropping it, and with foreign keys on, dropping ``operations`` would cascade into
    ``operation_logs``. They are checked before the commit instead.
    """
    sqlite = engine.dialect.name == "sqlite"
    async with engine.execution_options(**{WRITE_OPTION: True}).connect() as conn:
        if sqlite:
            await conn.run_sync(_sqlite_foreign_keys, False)
        try:
            async with conn.begin():
                await conn.run_sync(_upgrade)
        finally:
            if sqlite:
                await conn.run_sync(_sqlite_foreign_keys, True)
