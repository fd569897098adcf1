"""What every part of the store shares: the engine and its sessions, the transaction helper, and
database errors translated to :mod:`space.errors` (the rules are in :mod:`space.store.repo`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Sequence
from typing import Any, Self, TypeVar, cast

import structlog
from sqlalchemy import CursorResult, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import sessionmaker

from space.errors import Conflict, Internal, InvalidRequest, LeaseLost, NotFound, Unavailable
from space.store import db, fencing
from space.store.models import Base, Operation, utcnow
from space.store.wakeups import LocalWakeups, for_engine

# One logger for the whole store, under the name it had when the store was one module.
log = structlog.get_logger("space.store.repo")

_M = TypeVar("_M", bound=Base)


def _rowcount(result: Any) -> int:
    return cast(CursorResult[Any], result).rowcount


class StoreBase:
    """The connection and transaction machinery the aggregates' classes build on."""

    url: str
    dialect: str

    def __init__(self, url: str, engine: AsyncEngine) -> None:
        self.url = url
        self.dialect = engine.dialect.name
        self._engine = engine
        writer = engine.execution_options(**{db.WRITE_OPTION: True})
        self._sessionmaker = async_sessionmaker(writer, expire_on_commit=False)
        self._reader = async_sessionmaker(engine, expire_on_commit=False)
        self._write_lock = asyncio.Lock() if self.dialect == "sqlite" else None
        self._fast = db.create_sqlite_fast_writer(engine)
        self._fast_sessions = (
            sessionmaker(self._fast.execution_options(**{db.WRITE_OPTION: True}), expire_on_commit=False)
            if self._fast is not None else None
        )
        self._fast_reads = sessionmaker(self._fast, expire_on_commit=False) if self._fast is not None else None

    @classmethod
    async def open(cls, url: str) -> Self:
        """Connect and bring the schema to the newest migration."""
        with _translate_errors():
            engine = db.create_engine(url)
        try:
            await _translated(db.migrate(engine))
        except BaseException:
            await engine.dispose()
            raise
        log.debug("store opened", dialect=engine.dialect.name)
        return cls(url, engine)

    def wakeups(self) -> LocalWakeups:
        """Wake-ups between the processes sharing this database (:mod:`space.store.wakeups`);
        the caller starts and closes them."""
        return for_engine(self._engine)

    async def schema_revision(self) -> str | None:
        """The migration the database is at now (another replica may have moved it on), read
        with a fresh connection: also the readiness probe's check that the database answers."""
        async with self._engine.connect() as conn:
            revision: str | None = await _translated(conn.run_sync(db.current_revision))
        return revision

    async def close(self) -> None:
        await self._engine.dispose()
        if self._fast is not None:
            self._fast.dispose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @contextlib.asynccontextmanager
    async def _tx(self, *, write: bool = True) -> AsyncIterator[AsyncSession]:
        # SQLite serves one process (space serve's one controller): nobody else takes a lease over,
        # so there is nothing to fence, and a write saves the locking read (~0.5 ms).
        fence = fencing.current() if write and self.dialect == "postgresql" else None
        if write and self._write_lock is not None:
            # SQLite has one writer at a time anyway: queueing our own writers here is much
            # cheaper than letting them poll the file lock in SQLite's busy handler.
            async with self._write_lock, self._session(write) as s:
                if fence is not None:
                    await _check_fence(s, fence)
                yield s
        else:
            async with self._session(write) as s:
                if fence is not None:
                    await _check_fence(s, fence)
                yield s

    @contextlib.asynccontextmanager
    async def _session(self, write: bool) -> AsyncIterator[AsyncSession]:
        maker = self._sessionmaker if write else self._reader
        with _translate_errors():
            async with maker() as s, s.begin():
                yield s

    async def _by_key(self, model: type[_M], key: Any) -> _M | None:
        """One row by its primary key, read on its own. SQLite: on the event loop through the
        synchronous engine (a WAL read waits for no writer; ~0.2 ms against ~2-3 ms of trips to
        aiosqlite's thread, and the hot paths read a sandbox or an operation on every call)."""
        if self._fast_reads is not None:
            with _translate_errors(), self._fast_reads() as fs, fs.begin():
                return fs.get(model, key)
        async with self._tx(write=False) as s:
            return await s.get(model, key)

    async def _db_now(self, s: AsyncSession) -> dt.datetime:
        """The time every replica agrees on, for leases: the database server's clock on
        PostgreSQL (controllers on several machines may disagree by seconds), this machine's on
        SQLite (one machine anyway)."""
        if self.dialect == "postgresql":
            now = await s.scalar(select(func.clock_timestamp()))
            assert isinstance(now, dt.datetime)
            return now.astimezone(dt.UTC)
        return utcnow()

    def _insert(self, model: type[Base]) -> postgresql.Insert | sqlite.Insert:
        if self.dialect == "postgresql":
            return postgresql.insert(model)
        return sqlite.insert(model)

    async def _get(
        self, s: AsyncSession, model: type[_M], key: Any, what: str, *, lock: bool = False
    ) -> _M:
        row = await s.get(model, key, with_for_update=lock or None)
        if row is None:
            raise NotFound(f"{what} {key} not found")
        return row


async def _check_fence(s: AsyncSession, fence: fencing.Fence) -> None:
    """First in a fenced write transaction: the operation's row locked (exclusively, so that two
    fenced writes of one operation queue rather than deadlock upgrading a shared lock) and its
    lease still ``fence.owner``'s (:mod:`space.store.fencing`)."""
    row = (await s.execute(select(Operation.lease_owner, Operation.status)
                           .where(Operation.id == fence.op_id).with_for_update())).first()
    if row is None or row.status != "running" or row.lease_owner != fence.owner:
        holder = None if row is None else row.lease_owner
        raise LeaseLost(f"operation {fence.op_id} is no longer leased to {fence.owner!r}"
                        + ("" if row is None else f" ({row.status}, leased by {holder!r})"),
                        lease_owner=holder)


def _check_choice(what: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise InvalidRequest(f"invalid {what} {value!r}: must be one of {', '.join(allowed)}")


def _require_aware(value: dt.datetime, what: str) -> None:
    if value.tzinfo is None:
        raise InvalidRequest(f"{what} must be a timezone-aware datetime, got {value!r}")


@contextlib.contextmanager
def _translate_errors() -> Any:
    try:
        yield
    except IntegrityError as e:
        raise Conflict(f"conflicting row: {_orig(e)}") from e
    except (OperationalError, InterfaceError) as e:
        raise Unavailable(f"database unavailable: {_orig(e)}") from e
    except DBAPIError as e:
        raise Internal(f"database error: {_orig(e)}") from e
    except OSError as e:  # asyncpg raises these directly while connecting
        raise Unavailable(f"database unavailable: {e}") from e


async def _translated(aw: Any) -> Any:
    with _translate_errors():
        return await aw


def _orig(e: DBAPIError) -> str:
    return str(e.orig).strip().splitlines()[0] if e.orig is not None else str(e)
