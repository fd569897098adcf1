"""The API's audit trail: the batching writer against a real store, and how a call becomes a record.

- writer: records reach the store in batches (one transaction per batch), never raise into the
  caller, survive a store outage (retried with their order kept), are dropped (counted) beyond the
  bounded queue, and are written by aclose; a record the store can never take is dropped after a few
  attempts without blocking the ones behind it
- naming: the action table, the fallback rule, targets from path parameters and created ids,
  results from error codes, the anonymous caller
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence
from typing import Any

import pytest

from space.api.auditing import AuditWriter, action_for, build_record, route_template
from space.api.auth import Principal
from space.errors import Internal, Unavailable
from space.store import Store
from space.store.models import AuditRecord

pytestmark = pytest.mark.anyio


def rec(i: int, tenant: str = "acme", action: str = "sandbox.create") -> dict[str, Any]:
    return {"at": dt.datetime.now(dt.UTC), "tenant": tenant, "actor": "key-1", "action": action,
            "target": f"sb-{i}", "result": "ok", "status": 202, "details": {"i": i}}


class Seam:
    """Wraps Store.record_audit: counts batches, fails on demand, can hold a write."""

    def __init__(self, store: Store) -> None:
        self.real = store.record_audit
        self.batches: list[int] = []
        self.fail_next = 0
        self.fail_with: type[Exception] = Unavailable
        self.poison: str | None = None
        self.gate: asyncio.Event | None = None

    async def __call__(self, records: Sequence[AuditRecord]) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next > 0:
            self.fail_next -= 1
            raise self.fail_with("database unavailable: test")
        if self.poison is not None and any(r.action == self.poison for r in records):
            raise Internal("database error: value too long")
        await self.real(records)
        self.batches.append(len(records))


@pytest.fixture
def seam(store: Store, monkeypatch: pytest.MonkeyPatch) -> Seam:
    s = Seam(store)
    monkeypatch.setattr(store, "record_audit", s)
    return s


async def test_records_are_written_in_batches(store: Store, seam: Seam) -> None:
    w = AuditWriter(store, interval=0.05, batch=4)
    for i in range(10):
        w.record(rec(i))
    assert await w.flush(timeout=10)
    rows = await store.list_audit("acme")
    assert [r.target for r in rows] == [f"sb-{i}" for i in range(10)]
    assert rows[0].details == {"i": 0} and rows[0].status == 202 and rows[0].at.tzinfo is not None
    assert sum(seam.batches) == 10 and max(seam.batches) <= 4 and len(seam.batches) <= 4
    await w.aclose()


async def test_a_store_outage_is_retried_in_order(store: Store, seam: Seam) -> None:
    seam.fail_next = 3
    w = AuditWriter(store, interval=0.01, batch=50, max_backoff=0.2)
    for i in range(5):
        w.record(rec(i))  # never raises, whatever the store does
    assert await w.flush(timeout=20)
    w.record(rec(5))
    await w.aclose()
    assert [r.target for r in await store.list_audit("acme")] == [f"sb-{i}" for i in range(6)]
    assert w.written == 6 and w.dropped == 0


async def test_the_queue_is_bounded(store: Store, seam: Seam) -> None:
    seam.gate = asyncio.Event()  # the store hangs: nothing leaves the queue
    w = AuditWriter(store, interval=0.01, batch=10, max_pending=3)
    for i in range(5):
        w.record(rec(i))
    assert (w.pending, w.dropped) == (3, 2)
    seam.gate.set()
    await w.aclose()
    assert [r.target for r in await store.list_audit("acme")] == ["sb-0", "sb-1", "sb-2"]


async def test_aclose_writes_what_is_queued(store: Store) -> None:
    w = AuditWriter(store, interval=5.0, batch=1000)  # nothing would be written for 5 s
    for i in range(3):
        w.record(rec(i))
    await w.aclose()
    assert len(await store.list_audit("acme")) == 3


async def test_a_record_the_store_refuses_for_good_is_dropped(store: Store, seam: Seam) -> None:
    seam.poison = "bad.action"
    w = AuditWriter(store, interval=0.01, batch=1)
    w.record(rec(0, action="bad.action"))
    w.record(rec(1))
    assert await w.flush(timeout=20)
    await w.aclose()
    assert [r.target for r in await store.list_audit("acme")] == ["sb-1"]


def scope(method: str, path: str, params: dict[str, str] | None = None, principal: Any = None,
          headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "path_params": params or {},
            "state": {"principal": principal} if principal else {}, "headers": headers or []}


def test_action_names() -> None:
    assert action_for("POST", "/v1/sandboxes") == "sandbox.create"
    assert action_for("POST", "/v1/sandboxes/{sandbox_id}/commands") == "sandbox.exec"
    assert action_for("DELETE", "/v1/sandboxes/{sandbox_id}/snapshots/{snapshot_id}") == "snapshot.delete"
    assert action_for("POST", "/v1/apikeys") == "apikey.create"
    # the rule, for routes not in the table
    assert action_for("PUT", "/v1/secrets/{name}") == "secret.set"
    assert action_for("DELETE", "/v1/secrets/{name}") == "secret.delete"
    assert action_for("POST", "/v1/widgets/{id}/frobnicate") == "widget.frobnicate"
    assert action_for("POST", "/v1/nothing/here") == "nothing.here"
    # a route template rebuilt from the path when the scope has no route
    sc = scope("POST", "/v1/sandboxes/sb-1/commands/c-1/stdin", {"sandbox_id": "sb-1", "cid": "c-1"})
    assert route_template(sc) == "/v1/sandboxes/{sandbox_id}/commands/{cid}/stdin"


def test_records_of_calls() -> None:
    who = Principal(key_id="key-9", tenant="acme", role="member")
    at = dt.datetime.now(dt.UTC)
    made = build_record(scope("POST", "/v1/sandboxes", principal=who, headers=[(b"x-request-id", b"r-1")]), at,
                        201, b'{"sandbox": {"id": "sb-new"}, "operation": {"id": "op-1"}}')
    assert (made["tenant"], made["actor"], made["action"], made["target"], made["result"], made["status"]) == \
        ("acme", "key-9", "sandbox.create", "sb-new", "ok", 201)
    assert made["details"] == {"method": "POST", "path": "/v1/sandboxes", "request_id": "r-1"}
    snap = build_record(scope("DELETE", "/v1/sandboxes/sb-1/snapshots/snap-2",
                              {"sandbox_id": "sb-1", "snapshot_id": "snap-2"}, who), at, 404,
                        b'{"error": {"code": "not_found", "message": "x"}}')
    assert (snap["action"], snap["target"], snap["result"]) == ("snapshot.delete", "snap-2", "not_found")
    forked = build_record(scope("POST", "/v1/sandboxes/sb-1/fork", {"sandbox_id": "sb-1"}, who), at, 202,
                          b'{"sandboxes": [{"id": "sb-2"}, {"id": "sb-3"}], "snapshot": "snap-1"}')
    assert forked["target"] == "sb-1" and forked["details"]["sandboxes"] == ["sb-2", "sb-3"]
    anon = build_record(scope("POST", "/v1/sandboxes"), at, 401, b'{"error": {"code": "unauthorized"}}')
    assert (anon["tenant"], anon["actor"], anon["result"]) == ("", "anonymous", "unauthorized")
    crashed = build_record(scope("POST", "/v1/sandboxes/sb-1/pause", {"sandbox_id": "sb-1"}, who), at, 500, b"",
                           failure="internal")
    assert (crashed["result"], crashed["target"]) == ("internal", "sb-1")
    plain = build_record(scope("PUT", "/v1/pools/base", {"template": "base"}, who), at, 502, b"")
    assert plain["result"] == "http_502"
