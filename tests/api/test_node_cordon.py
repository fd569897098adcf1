"""Cordon, uncordon and drain through the real API app on a real store (SQLite and PostgreSQL).

- cordon takes a node out of placement (``schedulable`` false, the scheduler passes it over) and
  uncordon puts it back; both are the operator's, as is a drain
- a drain cordons the node and answers its ``node.drain`` operation; asked again while it runs, the
  same operation; with nowhere to move the sandboxes to, or of a node that is not ready, it is
  refused at once (409) and the node is left as it was
- an unknown node is 404 for all three; a bad ``parallel`` is 422
"""

from __future__ import annotations

import pytest

from space.errors import Unavailable
from space.store import Store
from tests.api.test_node_join import Api, api, code

pytestmark = pytest.mark.anyio

__all__ = ["api"]


async def _node(api: Api, node_id: str) -> None:
    assert (await api.join(await api.token(), node_id, url=f"https://{node_id}.cluster.test:7443")).status_code == 201


async def test_cordon_takes_a_node_out_of_placement_and_uncordon_puts_it_back(api: Api, store: Store) -> None:
    await _node(api, "n1")
    await store.set_node_state("n1", "ready")
    r = await api.http.post("/v1/nodes/n1/cordon", headers=api.operator)
    assert r.status_code == 200 and (r.json()["cordoned"], r.json()["schedulable"]) == (True, False), r.text
    registry = api.state.nodes
    registry.invalidate_rows()
    with pytest.raises(Unavailable, match="cordoned"):
        await registry.schedule()
    r = await api.http.post("/v1/nodes/n1/uncordon", headers=api.operator)
    assert (r.json()["cordoned"], r.json()["schedulable"]) == (False, True)
    assert [n.id for n in await registry.placeable_rows()] == ["n1"]


async def test_a_drain_cordons_and_is_one_operation(api: Api, store: Store) -> None:
    for n in ("n1", "n2"):
        await _node(api, n)
        await store.set_node_state(n, "ready")
    r = await api.http.post("/v1/nodes/n1/drain", json={"parallel": 4}, headers=api.operator)
    assert r.status_code == 202, r.text
    op = r.json()["operation"]
    assert (op["kind"], op["target"], op["status"]) == ("node.drain", "node/n1", "pending")
    assert r.json()["node"]["cordoned"]
    again = await api.http.post("/v1/nodes/n1/drain", headers=api.operator)
    assert again.status_code == 202 and again.json()["operation"]["id"] == op["id"]
    assert (await store.get_operation(op["id"])).request == {"node": "n1", "parallel": 4}


async def test_a_drain_with_nowhere_to_go_is_refused_and_changes_nothing(api: Api, store: Store) -> None:
    await _node(api, "n1")
    await store.set_node_state("n1", "ready")
    r = await api.http.post("/v1/nodes/n1/drain", headers=api.operator)
    assert (r.status_code, code(r)) == (409, "conflict"), r.text
    assert "no other ready, uncordoned node" in r.json()["error"]["message"]
    assert not (await store.get_node("n1")).cordoned
    assert not await store.find_operations(kind="node.drain")


async def test_only_a_ready_node_is_drained(api: Api, store: Store) -> None:
    for n in ("n1", "n2"):
        await _node(api, n)
        await store.set_node_state(n, "ready")
    await store.set_node_state("n1", "unreachable")
    r = await api.http.post("/v1/nodes/n1/drain", headers=api.operator)
    assert (r.status_code, code(r)) == (409, "conflict") and "is unreachable" in r.json()["error"]["message"], r.text
    assert not (await store.get_node("n1")).cordoned


async def test_cordon_and_drain_are_the_operators_and_need_a_node(api: Api) -> None:
    await _node(api, "n1")
    for path in ("/v1/nodes/n1/cordon", "/v1/nodes/n1/uncordon", "/v1/nodes/n1/drain"):
        r = await api.http.post(path, headers=api.tenant_admin)
        assert (r.status_code, code(r)) == (403, "forbidden"), path
        r = await api.http.post(path.replace("n1", "nope"), headers=api.operator)
        assert (r.status_code, code(r)) == (404, "not_found"), path
    for bad in (0, 17, "x"):
        r = await api.http.post("/v1/nodes/n1/drain", json={"parallel": bad}, headers=api.operator)
        assert r.status_code == 422, (bad, r.text)
