"""Template tags through the real app and store (no node: the builds' outcomes are written as the
controller writes them): E2B's ``/templates/tags`` assigns (from ``name:tag`` or a template's
current build) and removes, ``/templates/{id}/tags`` lists with build ids E2B's SDK parses (UUIDs),
``POST /v3/templates`` hands the build's tags on in its ``templateID``, malformed tags are 400s that
write nothing, tagging needs the operator; and a sandbox of ``name:tag`` starts from the tag's build
only while it is the template's current one (409 naming both digests otherwise)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from space import ids
from space.api.app import create_app
from space.api.state import AppState
from space.cluster.pki import ClusterCA
from space.controller import Controller, NodeRegistry
from space.objstore import ObjectStore
from space.store import Operation, Store

pytestmark = pytest.mark.anyio

D1, D2 = "1" * 64, "2" * 64


class Api:
    def __init__(self, http: httpx.AsyncClient, store: Store, operator: str, member: str) -> None:
        self.http, self.store = http, store
        self.operator = {"x-api-key": operator}
        self.member = {"x-api-key": member}


@pytest.fixture
async def api(store: Store, tmp_path: Path) -> AsyncIterator[Api]:
    nodes = NodeRegistry(store)
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    state = AppState(store=store, nodes=nodes, controller=Controller(store, nodes, objects=objects),
                     secret=b"k" * 32, cluster_ca=ClusterCA.create())
    _, operator = await store.create_api_key("default", "admin", "operator")
    _, member = await store.create_api_key("acme", "member", "acme member")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)),
                                     base_url="http://api.test:8080") as c:
            yield Api(c, store, operator, member)
    finally:
        await state.audit.aclose()
        await nodes.aclose()


async def built(store: Store, name: str, digest: str, *, tags: list[str], e2b_build: str | None = None) -> str:
    """A finished build of ``name`` as the controller leaves it: the template, its tags, the operation."""
    op = Operation(id=ids.operation_id(), tenant="default", kind="template.build", target=name, status="pending",
                   request={"spec": {}, **({"e2b_build": e2b_build} if e2b_build else {})})
    await store.create_operation(op)
    claimed = await store.claim_operation("test", 60, op_id=op.id)
    assert claimed is not None
    await store.finish_operation(op.id, "succeeded", result={"template": name, "digest": digest})
    await store.upsert_template(name, digest=digest, status="ready", spec={})
    build = e2b_build or op.id
    if tags:
        await store.tag_template(name, tags, digest=digest, build_id=build)
    return build


async def test_assign_list_and_remove(api: Api) -> None:
    b1 = str(uuid.uuid4())
    await built(api.store, "env", D1, tags=["v1"], e2b_build=b1)

    r = await api.http.post("/templates/tags", json={"target": "env:v1", "tags": ["production", "env:stable"]},
                            headers=api.operator)
    assert r.status_code == 201, r.text
    assert r.json() == {"buildID": b1, "tags": ["production", "stable"]}  # tags without the name

    r = await api.http.get("/templates/env/tags", headers=api.member)  # listing: any key
    assert r.status_code == 200, r.text
    assert {(t["tag"], t["buildID"]) for t in r.json()} == {("v1", b1), ("production", b1), ("stable", b1)}
    assert all(t["createdAt"].endswith("Z") for t in r.json())

    r = await api.http.request("DELETE", "/templates/tags", json={"name": "env", "tags": ["production", "v1"]},
                               headers=api.operator)
    assert r.status_code == 204, r.text
    assert [t.tag for t in await api.store.list_template_tags("env")] == ["stable"]
    r = await api.http.request("DELETE", "/templates/tags", json={"name": "env", "tags": ["production"]},
                               headers=api.operator)
    assert r.status_code == 404, r.text
    r = await api.http.request("DELETE", "/templates/tags", json={"name": "nope", "tags": ["x"]},
                               headers=api.operator)
    assert r.status_code == 404, r.text
    assert (await api.http.get("/templates/nope/tags", headers=api.operator)).status_code == 404

    # SPACE's own API lists them too, with the digest each names.
    r = await api.http.get("/v1/templates/env/tags", headers={"authorization": f"Bearer {api.member['x-api-key']}"})
    assert r.status_code == 200, r.text
    assert [(t["tag"], t["digest"]) for t in r.json()["tags"]] == [("stable", D1)]


async def test_a_template_name_tags_its_current_build(api: Api) -> None:
    op_build = await built(api.store, "env", D1, tags=[])  # built by SPACE: an operation's id
    r = await api.http.post("/templates/tags", json={"target": "env", "tags": ["latest"]}, headers=api.operator)
    assert r.status_code == 201, r.text
    assert r.json()["buildID"] == str(uuid.uuid5(uuid.UUID("5d0c3c55-9b57-4ad4-93b4-2f1e0a39a6c1"), op_build))
    uuid.UUID(r.json()["buildID"])  # E2B's SDK parses it as one
    tag = await api.store.get_template_tag("env", "latest")
    assert (tag.digest, tag.build_id) == (D1, op_build)


@pytest.mark.parametrize("body", [
    {"target": "env:v1", "tags": [":invalid-tag"]},
    {"target": "env:v1", "tags": ["env:"]},
    {"target": "env:v1", "tags": ["other:prod"]},
    {"target": "env:v1", "tags": ["ok", "bad tag"]},
    {"target": "env:", "tags": ["ok"]},
    {"target": ":v1", "tags": ["ok"]},
])
async def test_malformed_tags_are_refused_and_write_nothing(api: Api, body: dict[str, object]) -> None:
    await built(api.store, "env", D1, tags=["v1"])
    r = await api.http.post("/templates/tags", json=body, headers=api.operator)
    assert r.status_code == 400, r.text
    assert [t.tag for t in await api.store.list_template_tags("env")] == ["v1"]


async def test_tagging_is_the_operators(api: Api) -> None:
    await built(api.store, "env", D1, tags=["v1"])
    r = await api.http.post("/templates/tags", json={"target": "env:v1", "tags": ["mine"]}, headers=api.member)
    assert r.status_code == 403, r.text
    r = await api.http.request("DELETE", "/templates/tags", json={"name": "env", "tags": ["v1"]}, headers=api.member)
    assert r.status_code == 403, r.text
    assert [t.tag for t in await api.store.list_template_tags("env")] == ["v1"]
    r = await api.http.post("/templates/tags", json={"target": "env:v9", "tags": ["x"]}, headers=api.operator)
    assert r.status_code == 404, r.text


async def test_a_build_request_hands_its_tags_on(api: Api) -> None:
    r = await api.http.post("/v3/templates", json={"name": "env:v2", "tags": ["prod", "v2"]}, headers=api.operator)
    assert r.status_code == 202, r.text
    body = r.json()
    assert (body["templateID"], body["tags"], body["names"]) == ("env:v2,prod", ["v2", "prod"], ["env"])
    uuid.UUID(body["buildID"])
    r = await api.http.post("/v3/templates", json={"name": "env"}, headers=api.operator)
    assert (r.json()["templateID"], r.json()["tags"]) == ("env", [])
    r = await api.http.post("/v3/templates", json={"name": "env:bad tag"}, headers=api.operator)
    assert r.status_code == 400, r.text


async def test_a_sandbox_of_a_tag_starts_from_its_build_while_it_is_current(api: Api) -> None:
    await built(api.store, "env", D1, tags=["v1"])
    await built(api.store, "env", D2, tags=["v2"])
    auth = {"authorization": f"Bearer {api.member['x-api-key']}"}
    r = await api.http.post("/v1/sandboxes", json={"template": "env:v1"}, headers=auth)
    assert r.status_code == 409, r.text
    assert "earlier build (1111111111111111)" in r.json()["error"]["message"], r.text
    assert "(2222222222222222 now)" in r.json()["error"]["message"], r.text
    r = await api.http.post("/v1/sandboxes", json={"template": "env:v3"}, headers=auth)
    assert r.status_code == 404, r.text
    r = await api.http.post("/v1/sandboxes", json={"template": "env:v2"}, headers=auth)
    assert r.status_code == 202, r.text
    assert r.json()["sandbox"]["template"] == "env", r.json()
