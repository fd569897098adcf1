"""Sandboxes and their create operations.

- create: the pair is written atomically; returned rows are complete and detached
- idempotency: same (tenant, key) -> same pair; other tenants' keys are separate; a key reused for
  another kind of operation is a Conflict; 20 concurrent creates with one key -> one sandbox
- concurrency: 20 concurrent distinct creates all succeed (SQLite single-process writers)
- set_sandbox_state: lifecycle transitions, compare-and-set, generation, terminated_at, fields
- tenant isolation: another tenant's sandbox is NotFound
"""

from __future__ import annotations

import anyio
import pytest

from space.errors import Conflict, InvalidRequest, InvalidState, NotFound
from space.lifecycle import State
from space.store import Operation, Sandbox, Store
from tests.store.storekit import new_op, new_sandbox

pytestmark = pytest.mark.anyio


async def test_create_and_get(store: Store) -> None:
    sb, op, created = await store.create_sandbox(
        new_sandbox(env={"A": "1"}, meta={"team": "x"}), new_op(request={"template": "base"})
    )
    assert created
    assert (sb.state, sb.generation, sb.env, sb.meta) == (State.CREATING, 1, {"A": "1"}, {"team": "x"})
    assert (op.target, op.status, op.attempts, op.request) == (sb.id, "pending", 0, {"template": "base"})
    got = await store.get_sandbox(sb.id)
    assert isinstance(got.state, State) and got.state == State.CREATING
    assert (got.tenant, got.template, got.cpu, got.memory_mb) == ("acme", "base", 1.0, 512)
    assert got.meta == {"team": "x"} and got.created_at.tzinfo is not None
    assert got.node_id is None and got.terminated_at is None
    gop = await store.get_operation(op.id)
    assert (gop.kind, gop.target, gop.tenant) == ("sandbox.create", sb.id, "acme")


async def test_idempotent_create(store: Store) -> None:
    sb1, op1, c1 = await store.create_sandbox(new_sandbox(), new_op(key="k1"))
    sb2, op2, c2 = await store.create_sandbox(new_sandbox(), new_op(key="k1"))
    assert (c1, c2) == (True, False)
    assert (sb2.id, op2.id) == (sb1.id, op1.id)
    # the same key in another tenant is another request
    sb3, op3, c3 = await store.create_sandbox(new_sandbox("globex"), new_op("globex", key="k1"))
    assert c3 and sb3.id != sb1.id and op3.id != op1.id
    # no key: never deduplicated
    _, _, c4 = await store.create_sandbox(new_sandbox(), new_op())
    _, _, c5 = await store.create_sandbox(new_sandbox(), new_op())
    assert c4 and c5
    assert len(await store.list_sandboxes("acme")) == 3
    assert len(await store.list_sandboxes()) == 4


async def test_idempotency_key_reused_for_another_kind(store: Store) -> None:
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op(key="k"))
    with pytest.raises(Conflict):
        await store.create_operation(new_op(kind="sandbox.delete", target=sb.id, key="k"))
    op, created = await store.create_operation(new_op(kind="sandbox.delete", target=sb.id, key="k2"))
    again, created2 = await store.create_operation(new_op(kind="sandbox.delete", target=sb.id, key="k2"))
    assert (created, created2, again.id) == (True, False, op.id)


async def test_concurrent_creates_with_one_key_make_one_sandbox(store: Store) -> None:
    results: list[tuple[Sandbox, Operation, bool]] = []

    async def create() -> None:
        results.append(await store.create_sandbox(new_sandbox(), new_op(key="same")))

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(create)
    assert sum(created for _, _, created in results) == 1
    assert len({sb.id for sb, _, _ in results}) == 1
    assert len({op.id for _, op, _ in results}) == 1
    assert len(await store.list_sandboxes()) == 1
    assert len(await store.find_operations()) == 1


async def test_two_replicas_race_on_one_key(store: Store) -> None:
    """Two Store objects on one database (two control-plane replicas, or the CLI beside the
    server): on SQLite they contend for the file lock, on PostgreSQL for the unique index."""
    other = await Store.open(store.url)
    results: list[tuple[Sandbox, Operation, bool]] = []

    async def create(st: Store) -> None:
        results.append(await st.create_sandbox(new_sandbox(), new_op(key="shared")))

    try:
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(create, store if i % 2 else other)
    finally:
        await other.close()
    assert sum(created for _, _, created in results) == 1
    assert len({(sb.id, op.id) for sb, op, _ in results}) == 1
    assert len(await store.list_sandboxes()) == 1


async def test_concurrent_distinct_creates(store: Store) -> None:
    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(store.create_sandbox, new_sandbox(), new_op(key=f"k{i}"))
    assert len(await store.list_sandboxes()) == 20
    assert len(await store.find_operations(kind="sandbox.create", status=["pending"])) == 20


async def test_create_rejects_mismatched_tenant_and_duplicate_id(store: Store) -> None:
    with pytest.raises(InvalidRequest):
        await store.create_sandbox(new_sandbox("acme"), new_op("globex"))
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    with pytest.raises(Conflict):
        await store.create_sandbox(new_sandbox(id=sb.id), new_op())
    assert len(await store.find_operations()) == 1  # the failed pair left nothing behind


async def test_state_transitions(store: Store) -> None:
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    running = await store.set_sandbox_state(sb.id, State.RUNNING, node_id="n1", instance_id="i1")
    assert (running.state, running.node_id, running.instance_id, running.generation) == (
        State.RUNNING, "n1", "i1", 2)
    assert running.updated_at >= sb.updated_at

    with pytest.raises(InvalidState) as ei:
        await store.set_sandbox_state(sb.id, State.SUSPENDED)  # must go through suspending
    assert ei.value.state == "running" and "pause" in ei.value.allowed
    assert (await store.get_sandbox(sb.id)).generation == 2  # nothing changed

    failed = await store.set_sandbox_state(sb.id, "failed", error_code="runtime_error",
                                           error_message="sentry died")
    assert (failed.state, failed.error_code, failed.error_message) == (State.FAILED, "runtime_error",
                                                                        "sentry died")
    await store.set_sandbox_state(sb.id, State.TERMINATING)
    done = await store.set_sandbox_state(sb.id, State.TERMINATED)
    assert done.terminated_at is not None and done.generation == 5
    with pytest.raises(InvalidState):
        await store.set_sandbox_state(sb.id, State.RUNNING)  # terminated is final
    stored = await store.get_sandbox(sb.id)
    assert (stored.state, stored.terminated_at, stored.generation) == (State.TERMINATED,
                                                                        done.terminated_at, 5)


async def test_compare_and_set(store: Store) -> None:
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    await store.set_sandbox_state(sb.id, State.RUNNING, expect=State.CREATING)
    with pytest.raises(InvalidState) as ei:
        await store.set_sandbox_state(sb.id, State.PAUSED, expect=[State.CREATING, State.SUSPENDED])
    assert ei.value.state == "running"
    paused = await store.set_sandbox_state(sb.id, State.PAUSED, expect=[State.RUNNING, State.PAUSED])
    assert paused.state == State.PAUSED

    # Two racers both expecting "paused": exactly one wins.
    outcomes: list[str] = []

    async def move(dst: State) -> None:
        try:
            await store.set_sandbox_state(sb.id, dst, expect=State.PAUSED)
            outcomes.append(dst.value)
        except InvalidState:
            outcomes.append("lost")

    async with anyio.create_task_group() as tg:
        tg.start_soon(move, State.RUNNING)
        tg.start_soon(move, State.SUSPENDING)
    assert sorted(outcomes)[0] == "lost" and len(outcomes) == 2
    [winner] = [o for o in outcomes if o != "lost"]
    assert (await store.get_sandbox(sb.id)).state == winner


async def test_update_sandbox(store: Store) -> None:
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    up = await store.update_sandbox(sb.id, meta={"k": "v"}, template_digest="sha256:x", node_id="n2")
    assert (up.meta, up.template_digest, up.node_id, up.generation, up.state) == (
        {"k": "v"}, "sha256:x", "n2", 2, State.CREATING)
    with pytest.raises(InvalidRequest):
        await store.update_sandbox(sb.id, state="running")
    with pytest.raises(InvalidRequest):
        await store.set_sandbox_state(sb.id, State.RUNNING, tenant="evil")
    with pytest.raises(NotFound):
        await store.update_sandbox("snope", cpu=2.0)
    with pytest.raises(NotFound):
        await store.set_sandbox_state("snope", State.RUNNING)


async def test_tenant_isolation(store: Store) -> None:
    sb, op, _ = await store.create_sandbox(new_sandbox("acme"), new_op("acme"))
    other, _, _ = await store.create_sandbox(new_sandbox("globex"), new_op("globex"))
    assert (await store.get_sandbox(sb.id, tenant="acme")).id == sb.id
    with pytest.raises(NotFound):
        await store.get_sandbox(sb.id, tenant="globex")
    with pytest.raises(NotFound):
        await store.get_operation(op.id, tenant="globex")
    with pytest.raises(NotFound):
        await store.get_sandbox("s-missing")
    assert [s.id for s in await store.list_sandboxes("globex")] == [other.id]


async def test_list_filters(store: Store) -> None:
    a, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    b, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    c, _, _ = await store.create_sandbox(new_sandbox("globex"), new_op("globex"))
    await store.set_sandbox_state(a.id, State.RUNNING, node_id="n1")
    await store.set_sandbox_state(c.id, State.RUNNING, node_id="n1")
    assert [s.id for s in await store.list_sandboxes("acme", states=["running"])] == [a.id]
    assert {s.id for s in await store.list_sandboxes(states=[State.RUNNING])} == {a.id, c.id}
    assert {s.id for s in await store.list_sandboxes(node_id="n1")} == {a.id, c.id}
    assert [s.id for s in await store.list_sandboxes("acme", states=["creating", "paused"])] == [b.id]
    assert await store.list_sandboxes(states=[]) == []
