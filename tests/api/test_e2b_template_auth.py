"""E2B's template build API is the operator's (SPACE's templates are global), through the real app
on a real store: a tenant's admin key is refused (403) on every route that builds or reads a build,
before anything is done (no operation, no template row, no tag), and a wrong key is 401; the operator's
key names a build; ``Template.exists`` is anyone's (the template list is)."""

from __future__ import annotations

import uuid

import pytest

from space.store import Store
from tests.api.test_node_join import Api, api

pytestmark = pytest.mark.anyio

__all__ = ["api"]

ROUTES = (("POST", "/v3/templates", {"name": "t1"}),
          ("GET", "/templates/t1/files/abc", None),
          ("POST", "/v2/templates/t1/builds/bld-1", {"fromImage": "registry.example.com/team/app:1", "steps": []}),
          ("GET", "/templates/t1/builds/bld-1/status", None),
          ("POST", "/templates/tags", {"target": "t1:v1", "tags": ["prod"]}),
          ("DELETE", "/templates/tags", {"name": "t1", "tags": ["prod"]}))


async def test_only_the_operator_builds(api: Api, store: Store) -> None:
    tenant_admin = api.tenant_admin["authorization"].removeprefix("Bearer ")
    operator = api.operator["authorization"].removeprefix("Bearer ")
    for method, path, body in ROUTES:
        for key, status in ((tenant_admin, 403), ("sk_wrong", 401)):
            r = await api.http.request(method, path, json=body, headers={"x-api-key": key})
            assert r.status_code == status, (method, path, r.text)
    assert await store.find_operations(kind="template.build") == []
    assert [t.name for t in await store.list_templates()] == []
    assert await store.list_template_tags("t1") == []
    r = await api.http.post("/v3/templates", json={"name": "t1:v2"}, headers={"x-api-key": operator})
    # The templateID carries the build's tag to the SDK's next calls; build ids are UUIDs, as E2B's.
    assert r.status_code == 202 and r.json()["templateID"] == "t1:v2" and r.json()["tags"] == ["v2"]
    uuid.UUID(r.json()["buildID"])
    r = await api.http.get("/templates/aliases/t1", headers={"x-api-key": tenant_admin})
    assert r.status_code == 404  # anyone may ask; there is none yet
