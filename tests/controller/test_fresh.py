"""Values the create path reads (node rows, a node's identity, tenant limits) are never older than
their bound, and while they are used they are read again in the background, not on the request's
path (issue 18: those reads were a quarter of a warm create)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

import pytest

from space.controller import NodeRegistry
from space.controller.fresh import Fresh, FreshPerOwner
from space.store import Store
from tests.waiting import await_for

pytestmark = pytest.mark.anyio


class Source:
    """What a cache reads: a value per key that a test changes, and every read counted."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.reads = 0
        self.gate: asyncio.Event | None = None

    async def load(self, key: str) -> int:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        return self.values.get(key, 0)


async def test_a_value_is_read_once_and_served_until_it_is_ttl_old() -> None:
    src = Source()
    src.values["t"] = 1
    cache = Fresh("t", src.load, ttl=30.0)
    try:
        assert [await cache.get("t") for _ in range(5)] == [1] * 5
        assert src.reads == 1
        src.values["t"] = 2
        cache.forget("t")  # this replica changed it: the next get reads it
        assert await cache.get("t") == 2
    finally:
        await cache.aclose()


async def test_a_used_key_is_read_again_in_the_background_and_never_served_stale() -> None:
    src = Source()
    cache = Fresh("t", src.load, ttl=0.2, keep_for=5.0)
    try:
        await cache.get("t")
        src.values["t"] = 7
        # Three ttl's pass with no request; the keeper keeps the value fresh meanwhile.
        await eventually(lambda: cache.reads["background"] >= 3, "three background reads")
        assert await cache.get("t") == 7
        assert cache.reads["request"] == 1  # the first get only
        # Whatever the keeper does, a value at hand is never older than ttl.
        hit = cache._values["t"]
        assert time.monotonic() - hit[0] <= cache.ttl
    finally:
        await cache.aclose()


async def test_without_use_the_keeper_stops_and_the_value_expires() -> None:
    src = Source()
    cache = Fresh("t", src.load, ttl=0.1, keep_for=0.3)
    try:
        await cache.get("t")
        keeper = cache._keeper
        assert keeper is not None
        await eventually(lambda: keeper.done(), "the keeper to stop")
        await eventually(lambda: cache.peek("t") is None, "the value to expire")
        reads = src.reads
        await cache.get("t")  # read on the request path again, and the keeper starts again
        assert src.reads == reads + 1
        assert cache._keeper is not None and not cache._keeper.done()
    finally:
        await cache.aclose()


async def test_concurrent_gets_share_one_read() -> None:
    src = Source()
    src.gate = asyncio.Event()
    cache = Fresh("t", src.load, ttl=30.0)
    try:
        gets = [asyncio.create_task(cache.get("t")) for _ in range(10)]
        await eventually(lambda: src.reads == 1, "the read to start")
        src.gate.set()
        assert await asyncio.gather(*gets) == [0] * 10
        assert src.reads == 1
    finally:
        await cache.aclose()


async def test_a_read_that_started_before_a_forget_is_not_kept() -> None:
    src = Source()
    src.gate = asyncio.Event()
    cache = Fresh("t", src.load, ttl=30.0)
    try:
        first = asyncio.create_task(cache.get("t"))
        await eventually(lambda: src.reads == 1, "the read to start")
        src.values["t"] = 5
        cache.forget("t")  # the change lands while the old read is under way
        src.gate.set()
        await first
        assert cache.peek("t") is None
        assert await cache.get("t") == 5
    finally:
        await cache.aclose()


async def test_what_is_not_cacheable_is_read_every_time() -> None:
    src = Source()
    cache: Fresh[str, int] = Fresh("t", src.load, ttl=30.0, cacheable=bool)
    try:
        await cache.get("t")
        await cache.get("t")
        assert src.reads == 2  # 0 is not kept: (no nodes is never cached)
        src.values["t"] = 3
        await cache.get("t")
        await cache.get("t")
        assert src.reads == 3
    finally:
        await cache.aclose()


async def test_a_node_client_is_checked_against_the_placement_rows_without_a_read_of_its_own(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    await store.upsert_node("n1", "http://127.0.0.1:9", "token-1", {})
    registry = NodeRegistry(store, rows_ttl=0.2)
    try:
        first = await registry.client("n1")
        reads: list[str] = []
        real_get_node = store.get_node

        async def get_node(node_id: str) -> object:
            reads.append(node_id)
            return await real_get_node(node_id)

        monkeypatch.setattr(store, "get_node", get_node)
        registry._clients["n1"].checked_at -= 1  # the client's own check is due (older than rows_ttl)
        await registry.placeable_rows()
        assert await registry.client("n1") is first
        assert reads == []
        # A node that registered again (a new token) is seen through the rows as well.
        await store.upsert_node("n1", "http://127.0.0.1:9", "token-2", {})
        registry.invalidate_rows()
        await registry.placeable_rows()
        registry._clients["n1"].checked_at -= 1
        replaced = await registry.client("n1")
        assert replaced is not first and registry._clients["n1"].identity[1] == "token-2"
        assert reads == []
    finally:
        await registry.aclose()


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    async def check() -> bool:
        return predicate()
    await await_for(check, 5, what)


class Owner:
    """Stands for a Store: what the per-owner caches are keyed by (weakly)."""

    def __init__(self, name: str) -> None:
        self.name = name


async def test_each_owner_has_its_own_values_a_forget_reaches_all_and_an_owner_gone_takes_its_cache() -> None:
    reads: list[tuple[str, str]] = []

    async def load(owner: Owner, key: str) -> str:
        reads.append((owner.name, key))
        return f"{owner.name}:{key}"

    caches: FreshPerOwner[Owner, str, str] = FreshPerOwner("test", load, ttl=60)
    a, b = Owner("a"), Owner("b")
    assert (await caches.get(a, "k"), await caches.get(b, "k")) == ("a:k", "b:k")
    assert (await caches.get(a, "k"), await caches.get(b, "k")) == ("a:k", "b:k")
    assert reads == [("a", "k"), ("b", "k")]  # one read per owner, then served
    caches.forget("k")
    await caches.get(a, "k")
    await caches.get(b, "k")
    assert reads[2:] == [("a", "k"), ("b", "k")]
    caches.clear()
    await caches.get(a, "k")
    assert reads[4:] == [("a", "k")]
    keeper = caches.of(b)._keeper
    assert keeper is not None and not keeper.done()
    del b
    gc.collect()
    assert list(caches._by_owner) == [a]  # b's cache went with b, and so did its background reads
    await asyncio.gather(keeper, return_exceptions=True)
    assert keeper.cancelled()
    await caches.of(a).aclose()
