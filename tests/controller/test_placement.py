"""Placement ranks nodes from their heartbeats: a warm sandbox of the same template and size first,
then the template on disk, then the least committed memory and CPU; a node past the memory
overcommit goes last; warm candidates include nodes keeping the pool even when none was reported
ready (reports lag)."""

from __future__ import annotations

from typing import Any

from space.controller.placement import Committed, Request, fresh, keeps_pool, rank, warm_candidates, warm_ready
from space.store import Node

REQ = Request("base", 1.0, 512)


def node(node_id: str, **capacity: Any) -> Node:
    base: dict[str, Any] = {"cpus": 2, "memory_mb": 8192, "templates": [], "warm": []}
    return Node(id=node_id, url="http://x", token="t", state="ready", capacity={**base, **capacity})


def pool(ready: int, *, template: str = "base", memory_mb: int = 512, size: int = 2) -> dict[str, Any]:
    return {"template": template, "cpu": 1.0, "memory_mb": memory_mb, "size": size, "effective_size": size,
            "ready": ready}


def ids(nodes: list[Node]) -> list[str]:
    return [n.id for n in nodes]


def test_warm_beats_template_beats_load() -> None:
    idle = node("idle")
    has_template = node("tmpl", templates=["base"])
    has_warm = node("warm", templates=["base"], warm=[pool(1)])
    used = {"tmpl": Committed(1, 4096), "warm": Committed(2, 6000)}
    assert ids(rank([idle, has_template, has_warm], REQ, used)) == ["warm", "tmpl", "idle"]


def test_least_committed_memory_then_cpu() -> None:
    nodes = [node(x, templates=["base"]) for x in "abc"]
    used = {"a": Committed(1, 2048), "b": Committed(3, 1024), "c": Committed(1, 1024)}
    assert ids(rank(nodes, REQ, used)) == ["c", "b", "a"]


def test_memory_relative_to_what_the_node_has() -> None:
    small = node("small", templates=["base"], memory_mb=4096)
    big = node("big", templates=["base"], memory_mb=65536)
    used = {"small": Committed(1, 2048), "big": Committed(4, 8192)}
    assert ids(rank([small, big], REQ, used)) == ["big", "small"]


def test_an_overcommitted_node_goes_last_even_with_a_warm_sandbox() -> None:
    full = node("full", templates=["base"], memory_mb=1024, warm=[pool(2)])
    other = node("other")
    assert ids(rank([full, other], REQ, {"full": Committed(4, 4000)})) == ["other", "full"]


def test_warm_matching_is_by_template_and_size() -> None:
    n = node("n", warm=[pool(3, memory_mb=1024), pool(2, template="py")])
    assert warm_ready(n.capacity, REQ) == 0
    assert warm_ready(n.capacity, Request("base", 1.0, 1024)) == 3
    assert warm_ready(n.capacity, Request("py", 1.0, 512)) == 2
    assert not keeps_pool(n.capacity, REQ)


def test_warm_candidates_most_ready_first_and_lagging_reports_count() -> None:
    none_reported = node("lag", warm=[pool(0)])
    two = node("two", warm=[pool(2)])
    one = node("one", warm=[pool(1)])
    no_pool = node("nopool", templates=["base"])
    assert ids(warm_candidates([none_reported, two, one, no_pool], REQ)) == ["two", "one", "lag"]


def test_missing_heartbeat_fields_do_not_break_ranking() -> None:
    bare = Node(id="bare", url="http://x", token="t", state="ready", capacity={})
    legacy = Node(id="legacy", url="http://x", token="t", state="ready", capacity={"sandboxes": 3})
    assert set(ids(rank([bare, legacy], REQ))) == {"bare", "legacy"}


def test_nodes_not_heard_from_lately_are_passed_over_unless_none_is_fresh() -> None:
    import datetime as dt

    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    live = node("live", templates=["base"])
    gone = node("gone", templates=["base"], warm=[pool(2)])
    live.heartbeat_at = now - dt.timedelta(seconds=3)
    gone.heartbeat_at = now - dt.timedelta(seconds=40)
    assert ids(fresh([live, gone], now)) == ["live"]
    assert ids(fresh([gone], now)) == ["gone"]  # nothing better: try it rather than nothing
