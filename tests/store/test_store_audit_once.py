"""A shipped audit record (a gateway's, keyed by node, journal and seq) is stored once however
often it is shipped; the API's own records are appended as ever. On SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from space.store import Store
from space.store.models import AuditRecord

pytestmark = pytest.mark.anyio


def shipped(seq: int, journal: str = "j1") -> AuditRecord:
    return AuditRecord(tenant="acme", actor="gateway:n1", action="egress.allow", target="example.com",
                       result="ok", details={"seq": seq}, source=f"n1:{journal}:{seq}")


async def test_a_reshipped_batch_is_stored_once(store: Store) -> None:
    await store.record_audit([shipped(1), shipped(2)])
    # The drain is retried (the ack was lost), and another controller drains at the same time.
    await store.record_audit([shipped(1), shipped(2), shipped(3)])
    await store.record_audit([shipped(3)])
    # A reinstalled node's journal starts its seqs over: another journal, other records.
    await store.record_audit([shipped(1, journal="j2")])
    for _ in range(2):
        await store.record_audit([AuditRecord(tenant="acme", actor="key_1", action="sandbox.create",
                                              target="s1", result="ok")])
    rows = await store.list_audit("acme", limit=100)
    assert sorted(r.source or "" for r in rows) == ["", "", "n1:j1:1", "n1:j1:2", "n1:j1:3", "n1:j2:1"]


async def test_a_node_cannot_suppress_another_nodes_records(store: Store) -> None:
    """The journal and seq come from the node (hostile); the node id in the key is the control
    plane's own. A node forging another's journal and seqs only ever names records of its own."""
    from space.controller.controller import _gateway_record

    honest = {"seq": 1, "journal": "j1", "tenant": "acme", "action": "egress.allow", "result": "ok"}
    forged = [{**honest, "journal": "j1"}, {**honest, "journal": "x:n1:j1"}, {**honest, "journal": "n1:j1"},
              {**honest, "journal": "y" * 5000}]
    await store.record_audit([_gateway_record("n2", r) for r in forged])
    await store.record_audit([_gateway_record("n1", honest)])
    rows = await store.list_audit("acme", limit=100)
    assert "n1:j1:1" in {r.source for r in rows}
    assert all(len(r.source or "") <= 200 for r in rows)
    assert len(rows) == 5
