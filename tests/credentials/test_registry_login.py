"""The login template builds pull an image with (CredentialManager.registry_login), on a real store:

- the tenant's basic secret naming the registry's host (its port aside), the exact name over a
  ``*.domain`` one; none: an anonymous pull (None); other formats, other scopes and other tenants'
  secrets never count; two equally specific ones are a conflict naming both; an expired one is none
- every use is audited (target, registry, secret), never with the value
- the registries of a spec's images, its bases' included (registry_auth.image_registries)
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from space.controller.registry_auth import image_registries, registry_logins
from space.credentials import CredentialManager
from space.errors import Conflict
from space.store import Store
from space.store.models import AuditRecord
from tests.credentials.test_manager import ADMIN, OTHER, manager, set_expires

pytestmark = pytest.mark.anyio


class Audit(list[AuditRecord]):
    async def __call__(self, records: list[AuditRecord]) -> None:
        self.extend(records)


@pytest.fixture
def audited(store: Store) -> tuple[CredentialManager, Audit]:
    sink = Audit()
    creds = manager(store)
    creds._audit_sink = sink
    return creds, sink


async def test_the_most_specific_basic_secret_for_the_host(audited: tuple[CredentialManager, Audit]) -> None:
    creds, audit = audited
    assert await creds.registry_login("acme", "registry.example.com") is None  # none yet: anonymous
    await creds.set(ADMIN, "wild", "wild:one", hosts=["*.example.com"], format="basic")
    await creds.set(ADMIN, "bearer", "token", hosts=["registry.example.com"])  # not a login: never used
    await creds.set(OTHER, "theirs", "them:pw", hosts=["registry.example.com"], format="basic")
    assert await creds.registry_login("acme", "registry.example.com:5000") == ("wild", "one")
    await creds.set(ADMIN, "exact", "robot:pa:ss", hosts=["registry.example.com"], format="basic")
    assert await creds.registry_login("acme", "registry.example.com:5000", target="template:app") == (
        "robot", "pa:ss")
    assert await creds.registry_login("acme", "other.org") is None
    last = audit[-1]
    assert (last.action, last.result, last.target, last.details["name"], last.details["registry"]) == (
        "secret.resolve", "ok", "template:app", "exact", "registry.example.com:5000")
    assert "pa:ss" not in json.dumps([a.details for a in audit])


async def test_two_equally_specific_secrets_conflict_and_an_expired_one_is_none(
        store: Store, audited: tuple[CredentialManager, Audit]) -> None:
    creds, _ = audited
    one, _ = await creds.set(ADMIN, "one", "a:b", hosts=["registry.example.com"], format="basic")
    await creds.set(ADMIN, "two", "c:d", hosts=["registry.example.com", "x.example.com"], format="basic")
    with pytest.raises(Conflict, match="one, two"):
        await creds.registry_login("acme", "registry.example.com")
    await creds.delete(ADMIN, "two")
    await set_expires(store, one["id"], dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
    assert await creds.registry_login("acme", "registry.example.com") is None


async def test_the_registries_of_a_spec_and_its_logins(audited: tuple[CredentialManager, Audit]) -> None:
    creds, _ = audited
    base: dict[str, Any] = {"name": "b", "image": "registry.example.com/team/base@sha256:" + "a" * 64}
    derived = {"name": "d", "base_template": {"name": "b", "digest": "x", "spec": base}, "run": ["true"]}
    top = {"name": "t", "image": "localhost:5000/app:1", "base_template": derived}  # not a valid form: walks
    assert image_registries(derived) == ["registry.example.com"]
    assert image_registries({"name": "x", "suite": "bookworm"}) == []
    await creds.set(ADMIN, "login", "u:p", hosts=["registry.example.com"], format="basic")
    assert await registry_logins(creds, "acme", derived, target="template:d") == {
        "registry.example.com": {"username": "u", "password": "p"}}
    assert await registry_logins(None, "acme", derived, target="template:d") == {}
    assert image_registries(top) == ["localhost:5000"]
