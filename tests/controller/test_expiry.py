"""A timeout that pauses a sandbox (space.controller.policies): the tick enqueues the pause once
and keeps the deadline until the pause has happened (the pause clears it in the write that records
the sandbox paused), so a request that arrives meanwhile sees the sandbox still timed out and waits
for the pause instead of reaching a sandbox being frozen (space/e2b/edge.py); a pause that failed
gives the deadline up, as before, and is not tried again by every tick."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from space.controller import NodeRegistry
from space.controller.policies import Policies
from space.lifecycle import State
from space.store import Store
from tests.store.storekit import new_op, new_sandbox


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def event(self, sb: Any, what: str, message: str, **data: Any) -> None:
        self.seen.append((sb.id, what))


async def test_a_timeout_pause_keeps_the_deadline_until_it_has_paused(store: Store) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    sb, _, _ = await store.create_sandbox(new_sandbox(expire_action="pause", auto_resume=True), new_op())
    sb = await store.set_sandbox_state(sb.id, State.RUNNING)
    await store.update_sandbox(sb.id, expires_at=past)
    for op in await store.find_operations(target=sb.id):  # the create's, done
        await store.finish_operation(op.id, "succeeded")
    events = Events()
    policies = Policies(store, NodeRegistry(store), events)  # type: ignore[arg-type]

    assert await policies.tick() == 1
    pauses = await store.find_operations(target=sb.id, kind="sandbox.pause")
    assert [(op.status, op.request["reason"]) for op in pauses] == [("pending", "timeout")]
    assert (await store.get_sandbox(sb.id)).expires_at is not None  # kept until it has paused
    assert events.seen == [(sb.id, "expired")]
    assert await policies.tick() == 0  # the pause is under way: nothing more
    assert len(await store.find_operations(target=sb.id, kind="sandbox.pause")) == 1

    # The pause failed: the deadline is given up, not tried again at every tick.
    await store.finish_operation(pauses[0].id, "failed", error_code="runtime_error", error_message="boom")
    assert await policies.tick() == 0
    assert (await store.get_sandbox(sb.id)).expires_at is None
    assert len(await store.find_operations(target=sb.id, kind="sandbox.pause")) == 1
    assert events.seen == [(sb.id, "expired")]


async def test_the_pause_for_a_timeout_ends_it_in_the_same_write(store: Store) -> None:
    """What LifecycleOps.pause writes for a timeout's pause: the state and the deadline at once."""
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    sb, _, _ = await store.create_sandbox(new_sandbox(expire_action="pause"), new_op())
    sb = await store.set_sandbox_state(sb.id, State.RUNNING)
    await store.update_sandbox(sb.id, expires_at=past)
    paused = await store.set_sandbox_state(sb.id, State.PAUSED, expect=[State.RUNNING], expires_at=None,
                                           event=("paused", "paused (timeout)", {"reason": "timeout"}))
    assert (paused.state, paused.expires_at) == (State.PAUSED, None)


async def test_the_next_tick_is_due_at_the_nearest_deadline(store: Store) -> None:
    """The leader ticks at the nearest deadline, not only every period: a 3 s timeout acts at 3 s."""
    import time

    from space.controller import Controller

    now = dt.datetime.now(dt.UTC)
    for ahead in (30.0, 1.5):
        sb, _, _ = await store.create_sandbox(new_sandbox(expire_action="pause"), new_op())
        await store.set_sandbox_state(sb.id, State.RUNNING)
        await store.update_sandbox(sb.id, expires_at=now + dt.timedelta(seconds=ahead))
    policies = Policies(store, NodeRegistry(store), Events())  # type: ignore[arg-type]
    before = time.monotonic()
    await policies.tick(now)
    assert policies.next_deadline is not None
    assert before + 1.4 <= policies.next_deadline <= time.monotonic() + 1.5

    controller = Controller(store, NodeRegistry(store), policy_every=2.0)
    controller.policies.next_deadline = policies.next_deadline
    assert controller._next_policy(before) == pytest.approx(policies.next_deadline + 0.02)
    controller.policies.next_deadline = before + 60  # beyond the period: the period
    assert controller._next_policy(before) == before + 2.0
    controller.policies.next_deadline = None
    assert controller._next_policy(before) == before + 2.0
