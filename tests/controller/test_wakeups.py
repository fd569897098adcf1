"""Wake-ups between control-plane processes: a queued or finished operation reaches the other
processes' listeners through PostgreSQL's LISTEN/NOTIFY, and a listener whose connection dropped
is told to re-check once it is back. On SQLite (one process) they are delivered in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text

from space.controller import Controller, NodeRegistry
from space.store import Store
from space.store.wakeups import OPERATION_FINISHED, OPERATION_QUEUED, LocalWakeups, PostgresWakeups
from tests.waiting import until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def replica(store: Store) -> AsyncIterator[Store]:
    """A second store on the same database: another process's, in effect."""
    other = await Store.open(store.url)
    try:
        yield other
    finally:
        await other.close()


class Heard:
    def __init__(self) -> None:
        self.payloads: list[str | None] = []

    def __call__(self, payload: str | None) -> None:
        self.payloads.append(payload)


async def test_in_process_delivery_on_any_database(store: Store) -> None:
    wakeups = store.wakeups()
    heard = Heard()
    wakeups.listen(OPERATION_FINISHED, heard)
    wakeups.post(OPERATION_FINISHED, "op_1")
    # Delivered in this process before post returns, whatever carries it to the others.
    assert heard.payloads == ["op_1"]
    await wakeups.close()


@pytest.mark.postgres
async def test_a_wakeup_reaches_another_process(store: Store, replica: Store) -> None:
    if store.dialect != "postgresql":
        pytest.skip("one process is the whole control plane on SQLite")
    sender, receiver = store.wakeups(), replica.wakeups()
    assert isinstance(receiver, PostgresWakeups)
    heard = Heard()
    receiver.listen(OPERATION_FINISHED, heard)
    await receiver.start()
    try:
        await asyncio.wait_for(receiver.listening.wait(), 10)
        await sender.publish(OPERATION_FINISHED, "op_42")
        await until(lambda: "op_42" in heard.payloads, 10, "the NOTIFY reaches the other process")
        # Only the channel it listens on, and nothing oversized (no id is that long).
        await sender.publish(OPERATION_QUEUED, "op_43")
        await sender.publish(OPERATION_FINISHED, "x" * 1000)
        await sender.publish(OPERATION_FINISHED, "op_44")
        await until(lambda: "op_44" in heard.payloads, 10, "the later NOTIFY")
        assert heard.payloads == ["op_42", "op_44"]
    finally:
        await receiver.close()
        await sender.close()


@pytest.mark.postgres
async def test_a_dropped_listener_comes_back_and_is_told_to_recheck(store: Store, replica: Store) -> None:
    if store.dialect != "postgresql":
        pytest.skip("one process is the whole control plane on SQLite")
    sender = store.wakeups()
    receiver = PostgresWakeups(replica._engine, retry_every=0.05)
    heard = Heard()
    receiver.listen(OPERATION_FINISHED, heard)
    await receiver.start()
    try:
        await asyncio.wait_for(receiver.listening.wait(), 10)
        async with store._engine.connect() as conn:  # what a database failover does to it
            killed = (await conn.execute(text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE query LIKE 'LISTEN%' AND pid <> pg_backend_pid() AND datname = current_database()"))).scalar()
        assert killed == 1
        await until(lambda: None in heard.payloads, 10, "the listener is back and says it may have missed some")
        await sender.publish(OPERATION_FINISHED, "op_after")
        await until(lambda: "op_after" in heard.payloads, 10, "NOTIFYs reach it again")
    finally:
        await receiver.close()
        await sender.close()


@pytest.mark.postgres
async def test_a_long_poll_wakes_when_another_controller_finishes(store: Store, replica: Store) -> None:
    """The API replica's controller object (which claims nothing) hears the other process's finish."""
    if store.dialect != "postgresql":
        pytest.skip("one process is the whole control plane on SQLite")
    api_wakeups, ctl_wakeups = store.wakeups(), replica.wakeups()
    api = Controller(store, NodeRegistry(store), wakeups=api_wakeups)
    worker = Controller(replica, NodeRegistry(replica), wakeups=ctl_wakeups)
    await api_wakeups.start()
    await ctl_wakeups.start()
    try:
        assert isinstance(api_wakeups, PostgresWakeups) and isinstance(ctl_wakeups, PostgresWakeups)
        await asyncio.wait_for(api_wakeups.listening.wait(), 10)
        await asyncio.wait_for(ctl_wakeups.listening.wait(), 10)
        done = api.watch("op_x")
        worker.wakeups.post(OPERATION_FINISHED, "op_x")
        await asyncio.wait_for(done.wait(), 10)
        # And a queued operation wakes the claiming loop of the other process.
        worker._wake.clear()
        api.wake()
        await asyncio.wait_for(worker._wake.wait(), 10)
        api.unwatch("op_x", done)
    finally:
        await api_wakeups.close()
        await ctl_wakeups.close()


def test_local_wakeups_survive_a_broken_listener() -> None:
    wakeups = LocalWakeups()
    heard = Heard()

    def broken(_payload: str | None) -> None:
        raise RuntimeError("boom")

    wakeups.listen(OPERATION_FINISHED, broken)
    wakeups.listen(OPERATION_FINISHED, heard)
    wakeups.post(OPERATION_FINISHED, "op_1")
    assert heard.payloads == ["op_1"]
