"""A tenant's continuous-backup interval through the real API app on a real store (SQLite and
PostgreSQL): ``GET``/``PUT /v1/tenants/{tenant}/backup``.

- any key of the tenant reads it; the tenant's admin and the operator set it; another tenant's
  admin, a member and a readonly key get 403 and nothing changes
- durations, ``off`` (0) and ``default`` (null) are accepted; a too-short interval, a bad duration,
  a boolean, a missing ``every`` or an unknown field is 422 naming the field, and nothing changes
- the setting is what the controller resolves (the store's answer), and each PUT is audited
"""

from __future__ import annotations

from typing import Any

import pytest

from space.store import Store
from tests.api.test_node_join import Api, api, code

pytestmark = pytest.mark.anyio

__all__ = ["api"]


async def _get(api: Api, tenant: str = "acme") -> dict[str, Any]:
    r = await api.http.get(f"/v1/tenants/{tenant}/backup", headers=api.tenant_admin)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_the_tenant_admin_and_the_operator_set_it_and_the_controller_reads_it(api: Api, store: Store) -> None:
    assert await _get(api) == {"tenant": "acme", "every": None, "source": "default"}
    r = await api.http.put("/v1/tenants/acme/backup", json={"every": "2m"}, headers=api.tenant_admin)
    assert r.status_code == 200 and r.json() == {"tenant": "acme", "every": 120.0, "source": "tenant"}, r.text
    assert await store.tenant_backup_every(["acme"]) == {"acme": 120.0}
    r = await api.http.put("/v1/tenants/acme/backup", json={"every": "off"}, headers=api.operator)
    assert r.json()["every"] == 0 and await store.tenant_backup_every(["acme"]) == {"acme": 0.0}
    r = await api.http.put("/v1/tenants/acme/backup", json={"every": 30}, headers=api.tenant_admin)
    assert r.json()["every"] == 30.0
    r = await api.http.put("/v1/tenants/acme/backup", json={"every": "default"}, headers=api.tenant_admin)
    assert r.json() == {"tenant": "acme", "every": None, "source": "default"}
    assert await store.tenant_backup_every(["acme"]) == {}
    # A quota row made here keeps the tenant on the default limits (the interval is not a limit).
    assert (await store.effective_quota("acme"))[1] == "none"
    await api.state.audit.flush()
    records = await store.list_audit(None, action="backup.set")  # the operator's under its own tenant
    assert [(r.target, r.result) for r in records] == [("acme", "ok")] * 4


async def test_others_are_refused_and_nothing_changes(api: Api, store: Store) -> None:
    _, other_admin = await store.create_api_key("globex", "admin", "globex admin")
    _, member = await store.create_api_key("acme", "member", "acme member")
    _, readonly = await store.create_api_key("acme", "readonly", "acme readonly")
    for key, status in ((other_admin, 403), (member, 403), (readonly, 403)):
        r = await api.http.put("/v1/tenants/acme/backup", json={"every": 5},
                               headers={"authorization": f"Bearer {key}"})
        assert (r.status_code, code(r)) == (status, "forbidden"), r.text
    r = await api.http.get("/v1/tenants/acme/backup", headers={"authorization": f"Bearer {other_admin}"})
    assert (r.status_code, code(r)) == (403, "forbidden")
    r = await api.http.get("/v1/tenants/acme/backup", headers={"authorization": f"Bearer {member}"})
    assert r.status_code == 200
    assert await store.tenant_backup_every(["acme"]) == {}


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"every": 0.5}, 400, "every"),            # shorter than a second
    ({"every": "soon"}, 400, "every"),         # not a duration
    ({"every": "-5s"}, 400, "every"),
    ({"every": True}, 422, "every"),           # a boolean is not a duration
    ({"every": "x" * 100}, 422, "every"),      # bounded
    ({}, 422, "every"),                        # required (null is the explicit default)
    ({"every": 30, "evry": 5}, 422, "evry"),   # a misspelt field is not ignored
])
async def test_bad_intervals_are_refused_naming_the_field(api: Api, store: Store, body: dict[str, Any],
                                                          status: int, field: str) -> None:
    r = await api.http.put("/v1/tenants/acme/backup", json=body, headers=api.tenant_admin)
    assert r.status_code == status, r.text
    assert code(r) == ("invalid_request" if status == 400 else "validation_failed"), r.text
    assert field in r.text
    assert await store.tenant_backup_every(["acme"]) == {}
