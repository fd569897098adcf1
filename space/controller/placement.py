"""Where a new sandbox goes: pure ranking over the nodes' last heartbeats (``Node.capacity``).

Preference, in order:

1. a node with a warm sandbox of the same template and size ready (the create is a claim);
2. a node that has the template on disk (no download, no build);
3. the least loaded node: committed memory, then committed CPU, relative to what it has.

What a node *has* (CPUs, memory, templates, warm sandboxes) comes from its heartbeats; what is
*committed* on it comes from the database (the sandboxes placed there), which knows about a
placement the moment it is made — heartbeats would let a burst of creates pile onto one node.

A node whose committed memory plus the request would pass :data:`MEMORY_OVERCOMMIT` times its
memory is placed last (sandbox memory limits are ceilings, not reservations, so some overcommit is
normal; far beyond it the OOM killer decides instead of the scheduler).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from space.store import Node

MEMORY_OVERCOMMIT: Final = 4.0
#: Seconds without a heartbeat after which a node is passed over (heartbeats come every 5 s).
STALE_AFTER: Final = 12.0


@dataclass(frozen=True)
class Request:
    template: str
    cpu: float
    memory_mb: int


@dataclass
class Committed:
    """What the sandboxes placed on a node may use."""

    cpu: float = 0.0
    memory_mb: int = 0


def warm_ready(capacity: dict[str, Any], req: Request) -> int:
    """How many warm sandboxes of ``req``'s template and size the node last reported ready."""
    for p in capacity.get("warm") or []:
        if (p.get("template") == req.template and float(p.get("cpu", 0)) == float(req.cpu)
                and int(p.get("memory_mb", 0)) == int(req.memory_mb)):
            return int(p.get("ready") or 0)
    return 0


def keeps_pool(capacity: dict[str, Any], req: Request) -> bool:
    """The node keeps a warm pool for ``req``'s key (even if it last reported none ready)."""
    return any(
        p.get("template") == req.template and float(p.get("cpu", 0)) == float(req.cpu)
        and int(p.get("memory_mb", 0)) == int(req.memory_mb) and int(p.get("effective_size") or 0) > 0
        for p in capacity.get("warm") or []
    )


def _load(capacity: dict[str, Any], used: Committed, req: Request) -> tuple[bool, float, float]:
    # A node that has not reported its size yet counts as a small one rather than an empty one.
    mem = float(capacity.get("memory_mb") or 0) or 4096.0
    cpus = float(capacity.get("cpus") or 0) or 1.0
    over = used.memory_mb + req.memory_mb > mem * MEMORY_OVERCOMMIT
    return over, used.memory_mb / mem, used.cpu / cpus


def fresh(nodes: Sequence[Node], now: datetime | None = None) -> list[Node]:
    """The nodes heard from within :data:`STALE_AFTER` seconds, or all of them if none is: a node
    that stopped answering is still ``ready`` until its heartbeats mark it down, and placing work on
    it in the meantime only fails."""
    now = now or datetime.now(UTC)
    recent = [n for n in nodes if n.heartbeat_at is None or (now - n.heartbeat_at).total_seconds() <= STALE_AFTER]
    return recent or list(nodes)


def rank(nodes: Sequence[Node], req: Request, committed: Mapping[str, Committed] | None = None) -> list[Node]:
    """All ``nodes``, best first, for a create of ``req``; ``committed``: per node id."""
    committed = committed or {}

    def score(n: Node) -> tuple[Any, ...]:
        cap = n.capacity or {}
        over, mem_ratio, cpu_ratio = _load(cap, committed.get(n.id, Committed()), req)
        has_template = req.template in (cap.get("templates") or [])
        return (over, -warm_ready(cap, req), not has_template, mem_ratio, cpu_ratio, n.id)

    return sorted(nodes, key=score)


def warm_candidates(nodes: Sequence[Node], req: Request,
                    committed: Mapping[str, Committed] | None = None) -> list[Node]:
    """Nodes worth asking for a warm sandbox of ``req``, most ready first; a node with none
    reported ready is still worth one cheap claim if it keeps that pool (reports lag)."""
    order = {n.id: i for i, n in enumerate(rank(nodes, req, committed))}
    pooled = [n for n in nodes if keeps_pool(n.capacity or {}, req) or warm_ready(n.capacity or {}, req)]
    return sorted(pooled, key=lambda n: (-warm_ready(n.capacity or {}, req), order[n.id]))
