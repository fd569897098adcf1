"""A SPACE API key in E2B's spelling (``e2b_`` + hex, space.keyforms) through the real API app on a
real store (SQLite and PostgreSQL).

- a new key comes back in both spellings; either authenticates, on SPACE's API (``Authorization``)
  and on E2B's control API (``X-API-KEY``), as the same tenant and role
- revoking the key refuses both; a spelling that decodes to no key, or to another text, is 401
"""

from __future__ import annotations

import pytest

from space.keyforms import E2B_PREFIX
from tests.api.test_node_join import Api, api, code

pytestmark = pytest.mark.anyio

__all__ = ["api"]


async def test_either_spelling_authenticates_until_the_key_is_revoked(api: Api) -> None:
    r = await api.http.post("/v1/apikeys", json={"tenant": "acme", "role": "member", "name": "agent"},
                            headers=api.operator)
    assert r.status_code == 201, r.text
    key, spelled, key_id = r.json()["key"], r.json()["e2b_key"], r.json()["id"]
    assert spelled.startswith(E2B_PREFIX) and spelled != key
    for k in (key, spelled):
        own = await api.http.get("/v1/sandboxes", headers={"authorization": f"Bearer {k}"})
        assert own.status_code == 200, own.text
        e2b = await api.http.get("/v2/sandboxes", headers={"x-api-key": k})
        assert e2b.status_code == 200, e2b.text
        # The write below is a member's: the spelling carries the key's role and tenant.
        denied = await api.http.post("/v1/apikeys", json={"tenant": "acme", "role": "admin"},
                                     headers={"authorization": f"Bearer {k}"})
        assert denied.status_code == 403, denied.text
    assert (await api.http.delete(f"/v1/apikeys/{key_id}", headers=api.operator)).status_code == 204
    for k in (key, spelled):
        r = await api.http.get("/v1/sandboxes", headers={"authorization": f"Bearer {k}"})
        assert (r.status_code, code(r)) == (401, "unauthorized"), r.text
        assert (await api.http.get("/v2/sandboxes", headers={"x-api-key": k})).status_code == 401


async def test_a_spelling_of_no_key_is_refused(api: Api) -> None:
    for bogus in (E2B_PREFIX + "00" * 20, E2B_PREFIX + b"sk_not-a-key".hex(), E2B_PREFIX + "zz",
                  E2B_PREFIX + b"operator".hex()):
        r = await api.http.get("/v1/sandboxes", headers={"authorization": f"Bearer {bogus}"})
        assert (r.status_code, code(r)) == (401, "unauthorized"), (bogus, r.text)
