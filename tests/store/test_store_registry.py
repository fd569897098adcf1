"""API keys, nodes and templates.

- keys: only the sha256 is stored; authenticate finds active keys; revoke is final and idempotent;
  role validation; per-tenant listing; the active-key count
- nodes: upsert keeps created_at; heartbeats refresh capacity and revive down nodes; stale marking
- templates: upsert keeps created_at and updates the rest
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re

import pytest
from sqlalchemy import text

from space.errors import InvalidRequest, NotFound
from space.store import Store

pytestmark = pytest.mark.anyio


async def test_api_key_hash_stored_not_plaintext(store: Store) -> None:
    row, key = await store.create_api_key("acme", "admin", "ci")
    assert re.fullmatch(r"sk_[A-Za-z0-9_-]{40}", key)
    assert row.prefix == key[:8]
    assert row.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert row.created_at.tzinfo is not None and row.revoked_at is None
    async with store._engine.connect() as conn:
        dump = [tuple(r) for r in await conn.execute(text("SELECT * FROM api_keys"))]
    assert all(key not in str(v) for r in dump for v in r)


async def test_authenticate_and_revoke(store: Store) -> None:
    row, key = await store.create_api_key("acme", "member")
    _, other_key = await store.create_api_key("acme", "readonly")
    found = await store.authenticate(key)
    assert found is not None and (found.id, found.tenant, found.role) == (row.id, "acme", "member")
    assert await store.authenticate(key + "x") is None
    assert await store.authenticate("") is None

    await store.revoke_api_key(row.id)
    assert await store.authenticate(key) is None
    assert await store.authenticate(other_key) is not None
    [revoked] = [k for k in await store.list_api_keys(include_revoked=True) if k.id == row.id]
    assert revoked.revoked_at is not None
    await store.revoke_api_key(row.id)  # idempotent, keeps the first time
    [again] = [k for k in await store.list_api_keys(include_revoked=True) if k.id == row.id]
    assert again.revoked_at == revoked.revoked_at
    with pytest.raises(NotFound):
        await store.revoke_api_key("key-missing")


async def test_api_key_validation_list_and_count(store: Store) -> None:
    assert await store.count_api_keys() == 0
    with pytest.raises(InvalidRequest):
        await store.create_api_key("acme", "root")
    with pytest.raises(InvalidRequest):
        await store.create_api_key("", "admin")
    a, _ = await store.create_api_key("acme", "admin")
    b, _ = await store.create_api_key("globex", "member")
    c, _ = await store.create_api_key("acme", "readonly")
    assert [k.id for k in await store.list_api_keys("acme")] == [a.id, c.id]
    assert {k.id for k in await store.list_api_keys()} == {a.id, b.id, c.id}
    assert await store.count_api_keys() == 3
    await store.revoke_api_key(c.id)
    assert [k.id for k in await store.list_api_keys("acme")] == [a.id]
    assert await store.count_api_keys() == 2


async def test_nodes_upsert_and_heartbeat(store: Store) -> None:
    n1 = await store.upsert_node("n1", "http://127.0.0.1:7001", "tok1", {"cpu": 2, "memory_mb": 4096})
    assert (n1.state, n1.capacity) == ("ready", {"cpu": 2, "memory_mb": 4096})
    n1b = await store.upsert_node("n1", "http://127.0.0.1:7002", "tok2", {"cpu": 4})
    assert (n1b.url, n1b.token, n1b.capacity) == ("http://127.0.0.1:7002", "tok2", {"cpu": 4})
    assert n1b.created_at == n1.created_at
    assert n1b.heartbeat_at >= n1.heartbeat_at

    await store.set_node_state("n1", "unreachable")
    assert await store.list_nodes() == []
    assert [n.id for n in await store.list_nodes(state="unreachable")] == ["n1"]
    await store.heartbeat_node("n1", {"cpu": 3})
    got = await store.get_node("n1")
    assert (got.state, got.capacity) == ("ready", {"cpu": 3})
    assert got.heartbeat_at >= n1b.heartbeat_at
    assert got.heartbeat_at.tzinfo == dt.UTC

    with pytest.raises(NotFound):
        await store.heartbeat_node("nope", {})
    with pytest.raises(NotFound):
        await store.get_node("nope")
    with pytest.raises(InvalidRequest):
        await store.set_node_state("n1", "exploded")


async def test_stale_nodes_marked_down(store: Store) -> None:
    await store.upsert_node("n1", "http://a", "t", {})
    await store.upsert_node("n2", "http://b", "t", {})
    assert await store.mark_stale_nodes_down(3600) == []
    assert sorted(await store.mark_stale_nodes_down(-1)) == ["n1", "n2"]  # everything is stale
    assert await store.list_nodes() == []
    assert len(await store.list_nodes(state=None)) == 2


async def test_templates_upsert(store: Store) -> None:
    t = await store.upsert_template("base", digest="d1", status="building", spec={"image": "debian"})
    assert (t.status, t.size_bytes, t.error) == ("building", None, None)
    t2 = await store.upsert_template("base", digest="d2", status="ready", spec={"image": "debian"},
                                     size_bytes=5 * 2**30)
    assert (t2.digest, t2.status, t2.size_bytes) == ("d2", "ready", 5 * 2**30)
    assert t2.created_at == t.created_at and t2.updated_at >= t.updated_at
    await store.upsert_template("py", digest="d3", status="failed", spec={}, error="boom")
    assert [x.name for x in await store.list_templates()] == ["base", "py"]
    assert (await store.get_template("py")).error == "boom"
    with pytest.raises(NotFound):
        await store.get_template("nope")
    with pytest.raises(InvalidRequest):
        await store.upsert_template("x", digest="d", status="done", spec={})
