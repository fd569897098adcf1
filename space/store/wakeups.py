"""Wake-ups between the control plane's processes: "an operation is queued" (controllers claim it
now instead of at their next poll) and "operation X finished" (long-polls and stream waits on every
API replica answer now instead of at their next poll).

A wake-up is only ever a hint: whoever receives one re-reads the database, and everyone still polls
it (slowly) as the fallback, so a lost, repeated or forged wake-up costs latency, never correctness.

- :class:`LocalWakeups`: one process is the whole control plane (``space serve``, SQLite);
  delivery is a function call.
- :class:`PostgresWakeups`: ``LISTEN``/``NOTIFY`` on a connection of its own. When that connection
  drops, every listener is told it may have missed something (payload ``None``) once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

log = structlog.get_logger("space.store.wakeups")

#: A controller queued an operation (payload: its id; unused by the receivers).
OPERATION_QUEUED = "space_operation_queued"
#: An operation finished (payload: its id).
OPERATION_FINISHED = "space_operation_finished"
CHANNELS = (OPERATION_QUEUED, OPERATION_FINISHED)

#: NOTIFY payloads are limited to 8000 bytes; ours are ids, far shorter: a receiver drops anything
#: longer (no id is that long, and a truncated one would name the wrong thing).
MAX_PAYLOAD = 200

#: Called with the payload, or None: "you may have missed wake-ups; re-check everything".
Listener = Callable[[str | None], None]


class LocalWakeups:
    """Wake-ups within this process only."""

    def __init__(self) -> None:
        self._listeners: dict[str, list[Listener]] = {}

    def listen(self, channel: str, listener: Listener) -> None:
        self._listeners.setdefault(channel, []).append(listener)

    async def start(self) -> None:
        return None

    async def publish(self, channel: str, payload: str) -> None:
        self._deliver(channel, payload)

    def post(self, channel: str, payload: str) -> None:
        """:meth:`publish` from code that cannot wait for it (delivered here before this returns)."""
        self._deliver(channel, payload)

    async def close(self) -> None:
        return None

    def _deliver(self, channel: str, payload: str | None) -> None:
        for listener in list(self._listeners.get(channel, ())):
            try:
                listener(payload)
            except Exception:  # one broken listener must not starve the others
                log.exception("wakeup.listener_failed", channel=channel)

    def _deliver_all(self) -> None:
        for channel in list(self._listeners):
            self._deliver(channel, None)


class PostgresWakeups(LocalWakeups):
    """``NOTIFY`` through the store's pool; ``LISTEN`` on one dedicated asyncpg connection."""

    def __init__(self, engine: AsyncEngine, *, retry_every: float = 1.0) -> None:
        super().__init__()
        self._engine = engine
        self._dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self.retry_every = retry_every
        self._task: asyncio.Task[None] | None = None
        self._sending: set[asyncio.Task[None]] = set()
        #: Set while the listening connection is up (tests wait on it).
        self.listening = asyncio.Event()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._keep_listening(), name="wakeups.listen")

    async def publish(self, channel: str, payload: str) -> None:
        # Delivered here at once; the other processes get it through the database (and so do we,
        # a second time, which a hint allows).
        self._deliver(channel, payload)
        await self._notify(channel, payload)

    def post(self, channel: str, payload: str) -> None:
        self._deliver(channel, payload)
        task = asyncio.create_task(self._notify(channel, payload))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _notify(self, channel: str, payload: str) -> None:
        try:
            async with self._engine.connect() as conn:
                await conn.execute(text("SELECT pg_notify(:channel, :payload)"),
                                   {"channel": channel, "payload": payload})
                await conn.commit()
        except Exception as exc:  # a hint lost: the receivers' polls find the work a little later
            log.warning("wakeup.notify_failed", channel=channel, error=repr(exc)[:300])

    async def close(self) -> None:
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _keep_listening(self) -> None:
        import asyncpg  # the PostgreSQL driver the store already uses

        first = True
        while True:
            conn = None
            try:
                conn = await asyncpg.connect(self._dsn, timeout=10)
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _c, ev=lost: ev.set())
                for channel in CHANNELS:
                    await conn.add_listener(channel, self._on_notify)
                self.listening.set()
                if not first:
                    log.info("wakeups.listening_again")
                    self._deliver_all()  # what was sent while we were away is read by everyone now
                first = False
                await lost.wait()
                log.warning("wakeups.connection_lost", retry_in=self.retry_every)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("wakeups.connect_failed", error=repr(exc)[:300], retry_in=self.retry_every)
            finally:
                self.listening.clear()
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), timeout=2)
            await asyncio.sleep(self.retry_every)

    def _on_notify(self, _conn: object, _pid: int, channel: str, payload: str) -> None:
        if len(payload) <= MAX_PAYLOAD:
            self._deliver(channel, payload)



def for_engine(engine: AsyncEngine) -> LocalWakeups:
    """PostgreSQL's cross-process wake-ups for a PostgreSQL store; in-process ones otherwise."""
    return PostgresWakeups(engine) if engine.dialect.name == "postgresql" else LocalWakeups()
