"""The credential manager on a real store: set/list/delete, scopes, expiry, audit, sealing, rotation,
and the HashiCorp Vault backend at an ``httpx.MockTransport`` seam (no Vault server runs here)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text, update

from space import ids
from space.api.auth import Principal
from space.credentials import Backends, CredentialManager, HashiCorpVaultBackend, Keyring, MasterKeyError
from space.credentials.backends import BUILTIN, VAULT, BackendConfig, BuiltinBackend
from space.credentials.crypto import generate_key
from space.errors import Forbidden, Internal, InvalidRequest, NotFound, PayloadTooLarge, Unavailable
from space.store import Sandbox, Store
from space.store.models import Secret
from tests.store.storekit import new_op, new_sandbox

ADMIN = Principal(key_id="key-admin", tenant="acme", role="admin")
MEMBER = Principal(key_id="key-member", tenant="acme", role="member")
READONLY = Principal(key_id="key-ro", tenant="acme", role="readonly")
OTHER = Principal(key_id="key-other", tenant="globex", role="admin")
VALUE = "ghp_s3cr3t-VALUE-1234567890"


def manager(store: Store, *keys: bytes) -> CredentialManager:
    return CredentialManager(store, Backends({BUILTIN: BuiltinBackend(Keyring(list(keys) or [generate_key()]))}))


@pytest.fixture
def creds(store: Store) -> CredentialManager:
    return manager(store)


async def sandbox(store: Store, tenant: str = "acme", **kw: Any) -> Sandbox:
    sb, _, _ = await store.create_sandbox(new_sandbox(tenant, **kw), new_op(tenant))
    return sb


async def raw_rows(store: Store) -> list[dict[str, Any]]:
    async with store._sessionmaker() as s:
        return [dict(r._mapping) for r in await s.execute(text("SELECT * FROM secrets"))]


async def set_expires(store: Store, secret_id: str, when: dt.datetime) -> None:
    async with store._sessionmaker() as s, s.begin():
        await s.execute(update(Secret).where(Secret.id == secret_id).values(expires_at=when))


# ---- set, list, delete ------------------------------------------------------------------------------


async def test_set_list_resolve_round_trip(store: Store, creds: CredentialManager) -> None:
    view, created = await creds.set(MEMBER, "GITHUB_TOKEN", VALUE, hosts=["api.github.com", "*.GitHub.com"],
                                    rate_limit=60)
    assert created
    assert view["name"] == "GITHUB_TOKEN" and view["scope"] == "tenant" and view["backend"] == "builtin"
    assert view["hosts"] == ["api.github.com", "*.github.com"]
    assert view["header"] == "Authorization" and view["format"] == "Bearer {}"
    assert view["created_by"] == "key-member" and view["rate_limit"] == 60 and view["expires_at"] is None
    assert VALUE not in json.dumps(view)
    listed = await creds.list(READONLY)  # read-only keys may list
    assert [s["name"] for s in listed] == ["GITHUB_TOKEN"] and VALUE not in json.dumps(listed)

    sb = await sandbox(store, secrets=["GITHUB_TOKEN"])
    [r] = await creds.resolve(sb)
    assert (r.name, r.scope, r.secret_id, r.header, r.value) == (
        "GITHUB_TOKEN", "tenant", view["id"], "Authorization", f"Bearer {VALUE}")
    assert r.hosts == ("api.github.com", "*.github.com") and r.rate_limit == 60 and r.expires_at is None
    wire = r.to_wire()
    assert json.loads(json.dumps(wire)) == wire and wire["value"] == f"Bearer {VALUE}"
    assert VALUE not in repr(r)


async def test_replace_keeps_identity(store: Store, creds: CredentialManager) -> None:
    first, created = await creds.set(MEMBER, "T", "one", hosts=["a.example.com"])
    again, created_again = await creds.set(ADMIN, "T", "two", hosts=["b.example.com"], header="X-Api-Key",
                                           format="{}")
    assert created and not created_again
    assert again["id"] == first["id"] and again["created_at"] == first["created_at"]
    assert again["created_by"] == "key-member" and again["hosts"] == ["b.example.com"]
    [r] = await creds.resolve(await sandbox(store, secrets=["T"]))
    assert (r.header, r.value) == ("X-Api-Key", "two")


@pytest.mark.parametrize(("fmt", "value", "expected"), [
    ("basic", "user:pa ss", "Basic dXNlcjpwYSBzcw=="),
    ("bearer", "tok", "Bearer tok"),
    ("token {}", "tok", "token tok"),
    ("{}", "a{}b", "a{}b"),  # braces in the value are not a template
])
async def test_formats(store: Store, creds: CredentialManager, fmt: str, value: str, expected: str) -> None:
    await creds.set(MEMBER, "S", value, hosts=["x.example.com"], format=fmt)
    [r] = await creds.resolve(await sandbox(store, secrets=["S"]))
    assert r.value == expected


async def test_delete(store: Store, creds: CredentialManager) -> None:
    await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"])
    await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"], scope="project:web")
    await creds.delete(MEMBER, "S")
    assert [(s["name"], s["scope"]) for s in await creds.list(MEMBER)] == [("S", "project:web")]
    with pytest.raises(NotFound, match="secret S not found in scope tenant"):
        await creds.delete(MEMBER, "S")
    with pytest.raises(Forbidden):
        await creds.delete(READONLY, "S", "project:web")
    await creds.delete(MEMBER, "S", "project:web")
    assert await creds.list(MEMBER) == []


async def test_tenants_are_isolated(store: Store, creds: CredentialManager) -> None:
    await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"])
    assert await creds.list(OTHER) == []
    with pytest.raises(NotFound):
        await creds.delete(OTHER, "S")
    other_sb = await sandbox(store, tenant="globex", secrets=["S"])
    assert await creds.resolve(other_sb) == []
    mine = await sandbox(store)
    with pytest.raises(NotFound):  # another tenant's sandbox is as good as missing
        await creds.set(OTHER, "S", VALUE, hosts=["api.example.com"], scope=f"sandbox:{mine.id}")
    assert len(await creds.list(MEMBER)) == 1


async def test_list_by_scope(creds: CredentialManager) -> None:
    await creds.set(MEMBER, "A", "1", hosts=["api.example.com"])
    await creds.set(MEMBER, "B", "2", hosts=["api.example.com"], scope="project:web")
    assert [s["name"] for s in await creds.list(MEMBER, "project:web")] == ["B"]
    assert [s["name"] for s in await creds.list(MEMBER, "tenant")] == ["A"]
    with pytest.raises(InvalidRequest, match="invalid scope"):
        await creds.list(MEMBER, "projects:web")


# ---- validation -------------------------------------------------------------------------------------

BAD: list[tuple[dict[str, Any], str]] = [
    ({"name": "1abc"}, "invalid secret name"),
    ({"name": "a/b"}, "invalid secret name"),
    ({"name": "x" * 129}, "invalid secret name"),
    ({"hosts": []}, "at least one host"),
    ({"hosts": ["http://x.com"]}, "invalid host pattern"),
    ({"hosts": ["a.*.com"]}, "invalid host pattern"),
    ({"header": "Bad Header"}, "invalid header name"),
    ({"header": "Host"}, "cannot carry a secret"),
    ({"header": "content-length"}, "cannot carry a secret"),
    ({"format": "Token"}, "exactly once"),
    ({"format": "{} {}"}, "exactly once"),
    ({"format": "Bearer {}\r\nX-Evil: 1"}, "control characters"),
    ({"format": "basic", "value": "no-colon"}, "user:password"),
    ({"value": ""}, "non-empty"),
    ({"value": "abc\r\nHost: evil"}, "control characters"),
    ({"rate_limit": 0}, "rate_limit"),
    ({"ttl_seconds": 0}, "ttl_seconds"),
    ({"ttl_seconds": 5, "expires_at": dt.datetime(2100, 1, 1, tzinfo=dt.UTC)}, "not both"),
    ({"expires_at": dt.datetime(2000, 1, 1, tzinfo=dt.UTC)}, "in the past"),
    ({"expires_at": dt.datetime(2100, 1, 1)}, "time zone"),
    ({"scope": "team:x"}, "invalid scope"),
    ({"scope": "project:"}, "invalid scope"),
]


@pytest.mark.parametrize(("change", "message"), BAD)
async def test_validation_errors(store: Store, creds: CredentialManager, change: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"name": "S", "value": VALUE, "hosts": ["api.example.com"]}
    args.update(change)
    with pytest.raises(InvalidRequest, match=message) as info:
        await creds.set(MEMBER, args.pop("name"), args.pop("value"), **args)
    assert VALUE not in str(info.value) and VALUE not in json.dumps(info.value.to_wire())
    assert await raw_rows(store) == []
    [rec] = await store.list_audit("acme", action="secret.set")
    assert rec.result == "invalid_request" and rec.status == 400


async def test_value_size_limit(creds: CredentialManager) -> None:
    await creds.set(MEMBER, "S", "x" * 16384, hosts=["api.example.com"])
    with pytest.raises(PayloadTooLarge):
        await creds.set(MEMBER, "S", "x" * 16385, hosts=["api.example.com"])


async def test_sandbox_scope_needs_a_sandbox_of_the_tenant(creds: CredentialManager) -> None:
    with pytest.raises(NotFound, match="sandbox"):
        await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"], scope=f"sandbox:{ids.sandbox_id()}")


async def test_readonly_cannot_set_and_is_audited(store: Store, creds: CredentialManager) -> None:
    with pytest.raises(Forbidden):
        await creds.set(READONLY, "S", VALUE, hosts=["api.example.com"])
    [rec] = await store.list_audit("acme", action="secret.set")
    assert (rec.actor, rec.result, rec.status, rec.target) == ("key-ro", "forbidden", 403, "S")


# ---- at rest -----------------------------------------------------------------------------------------


async def test_the_database_never_holds_the_value(store: Store, creds: CredentialManager) -> None:
    await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"])
    await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"], scope="project:p")
    await creds.resolve(await sandbox(store, project="p", secrets=["S"]))
    needle = VALUE.encode()
    rows = await raw_rows(store)
    assert len(rows) == 2
    for row in rows:
        assert row["ciphertext"] and row["key_id"] and row["ref"] is None
        for v in row.values():
            assert needle not in (bytes(v) if isinstance(v, bytes | memoryview) else str(v).encode())
    for rec in await store.list_audit(None, limit=1000):
        assert VALUE not in json.dumps(rec.details) and VALUE not in rec.target
    if store.dialect == "sqlite":
        db = Path(store.url.split("///", 1)[1])
        for path in (db, db.with_name(db.name + "-wal")):
            if path.exists():
                assert needle not in path.read_bytes()


async def test_swapped_ciphertexts_do_not_open(store: Store, creds: CredentialManager) -> None:
    """Someone with write access to the database but not the key moves a ciphertext from one
    secret to another (say, to make a sandbox inject another tenant's token): it no longer opens."""
    a, _ = await creds.set(MEMBER, "A", "value-a", hosts=["api.example.com"])
    b, _ = await creds.set(OTHER, "A", "value-b", hosts=["api.example.com"])
    async with store._sessionmaker() as s, s.begin():
        blob = await s.scalar(select(Secret.ciphertext).where(Secret.id == b["id"]))
        await s.execute(update(Secret).where(Secret.id == a["id"]).values(ciphertext=blob))
    sb = await sandbox(store, secrets=["A"])
    with pytest.raises(MasterKeyError, match="altered or belongs to another secret"):
        await creds.resolve(sb)
    [rec] = await store.list_audit("acme", action="secret.resolve")
    assert rec.result == "internal" and rec.target == sb.id


async def test_key_rotation(store: Store) -> None:
    old, new = generate_key(), generate_key()
    await manager(store, old).set(MEMBER, "S", VALUE, hosts=["api.example.com"])
    sb = await sandbox(store, secrets=["S"])
    rotated = manager(store, new, old)
    [r] = await rotated.resolve(sb)
    assert r.value == f"Bearer {VALUE}"
    assert await rotated.rekey() == 1
    assert await rotated.rekey() == 0
    [row] = await raw_rows(store)
    assert row["key_id"] == Keyring([new]).current_id
    [r] = await manager(store, new).resolve(sb)  # the old key is no longer needed
    assert r.value == f"Bearer {VALUE}"
    with pytest.raises(MasterKeyError, match="does not hold"):
        await manager(store, old).resolve(sb)


# ---- scopes, expiry, audit ---------------------------------------------------------------------------


async def test_most_specific_scope_wins(store: Store, creds: CredentialManager) -> None:
    target = await sandbox(store, project="web", secrets=["S", "ONLY_TENANT"])
    sibling = await sandbox(store, project="web", secrets=["S"])
    loner = await sandbox(store, secrets=["S"])
    await creds.set(MEMBER, "S", "tenant-value", hosts=["api.example.com"])
    await creds.set(MEMBER, "ONLY_TENANT", "t2", hosts=["api.example.com"])
    await creds.set(MEMBER, "S", "project-value", hosts=["api.example.com"], scope="project:web")
    await creds.set(MEMBER, "S", "sandbox-value", hosts=["api.example.com"], scope=f"sandbox:{target.id}")
    got = {r.name: (r.scope, r.value) for r in await creds.resolve(target)}
    assert got == {"S": (f"sandbox:{target.id}", "Bearer sandbox-value"), "ONLY_TENANT": ("tenant", "Bearer t2")}
    assert [(r.scope, r.value) for r in await creds.resolve(sibling)] == [("project:web", "Bearer project-value")]
    assert [(r.scope, r.value) for r in await creds.resolve(loner)] == [("tenant", "Bearer tenant-value")]


async def test_expired_secret_resolves_to_nothing(store: Store, creds: CredentialManager) -> None:
    sb = await sandbox(store, project="web", secrets=["S", "T"])
    await creds.set(MEMBER, "S", "tenant-value", hosts=["api.example.com"])
    view, _ = await creds.set(MEMBER, "S", "project-value", hosts=["api.example.com"], scope="project:web",
                              ttl_seconds=3600)
    await creds.set(MEMBER, "T", "t", hosts=["api.example.com"],
                    expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
    assert view["expires_at"] is not None and not view["expired"]
    [r_s, r_t] = await creds.resolve(sb)
    assert r_s.expires_at == view["expires_at"] and r_t.expires_at is not None
    await set_expires(store, view["id"], dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
    # The expired project secret is not replaced by the tenant one of the same name.
    assert [r.name for r in await creds.resolve(sb)] == ["T"]
    [rec] = await store.list_audit("acme", action="secret.expired")
    assert rec.target == sb.id and rec.details["name"] == "S" and rec.details["scope"] == "project:web"
    assert [s["expired"] for s in await creds.list(MEMBER, "project:web")] == [True]


async def test_resolution_is_audited(store: Store, creds: CredentialManager) -> None:
    await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"])
    sb = await sandbox(store, secrets=["S", "MISSING"])
    [r] = await creds.resolve(sb, actor="controller")
    recs = await store.list_audit("acme", action="secret.resolve")
    assert [(x.actor, x.target, x.result, x.details.get("name"), x.details.get("scope")) for x in recs] == [
        ("controller", sb.id, "ok", "S", "tenant"), ("controller", sb.id, "not_found", "MISSING", None)]
    assert recs[0].details["secret_id"] == r.secret_id
    sets = await store.list_audit("acme", action="secret.set")
    assert [(x.result, x.status, x.target) for x in sets] == [("ok", 201, "S")]
    assert all(VALUE not in json.dumps(x.details) for x in [*recs, *sets])


async def test_unbound_sandbox_resolves_nothing_and_writes_nothing(store: Store, creds: CredentialManager) -> None:
    assert await creds.resolve(await sandbox(store)) == []
    assert await store.list_audit("acme", action="secret.") == []


async def test_custom_audit_sink(store: Store) -> None:
    seen: list[str] = []

    async def sink(records: Any) -> None:
        seen.extend(r.action for r in records)

    creds = CredentialManager(store, Backends({BUILTIN: BuiltinBackend(Keyring([generate_key()]))}), sink)
    await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"])
    await creds.resolve(await sandbox(store, secrets=["S"]))
    assert seen == ["secret.set", "secret.resolve"]
    assert await store.list_audit("acme") == []


# ---- binding -----------------------------------------------------------------------------------------


async def test_check_bindable(store: Store, creds: CredentialManager) -> None:
    sb = await sandbox(store, project="web")
    other = await sandbox(store, project="web")
    await creds.set(MEMBER, "T", "1", hosts=["api.example.com"])
    await creds.set(MEMBER, "P", "2", hosts=["api.example.com"], scope="project:web")
    await creds.set(MEMBER, "X", "3", hosts=["api.example.com"], scope=f"sandbox:{sb.id}")
    assert await creds.check_bindable(MEMBER, "acme", "web", sb.id, ["T", "P", "X", "T"]) == ["T", "P", "X"]
    assert await creds.check_bindable(MEMBER, "acme", "web", None, ["T", "P"]) == ["T", "P"]
    with pytest.raises(NotFound, match="secret X not found") as info:
        await creds.check_bindable(MEMBER, "acme", "web", other.id, ["T", "X"])
    assert info.value.details["secret"] == "X"
    with pytest.raises(NotFound, match="secret P"):
        await creds.check_bindable(MEMBER, "acme", "", None, ["P"])
    with pytest.raises(Forbidden):
        await creds.check_bindable(READONLY, "acme", "web", None, ["T"])
    with pytest.raises(Forbidden):
        await creds.check_bindable(OTHER, "acme", "web", None, ["T"])
    with pytest.raises(NotFound):
        await creds.check_bindable(OTHER, "globex", "web", None, ["T"])
    with pytest.raises(InvalidRequest):
        await creds.check_bindable(MEMBER, "acme", "", None, ["bad name"])


# ---- HashiCorp Vault KV v2, at the HTTP seam ---------------------------------------------------------


class FakeVault:
    """Just enough of Vault's KV v2 HTTP API for the backend: data write/read, metadata delete."""

    def __init__(self, token: str = "s.root") -> None:
        self.token = token
        self.data: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail: int | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.method, request.url.path))
        if self.fail is not None:
            return httpx.Response(self.fail, json={"errors": ["boom"]})
        if request.headers.get("x-vault-token") != self.token:
            return httpx.Response(403, json={"errors": ["permission denied"]})
        path = request.url.raw_path.decode()
        mount, kind, rest = path.removeprefix("/v1/").partition("/")[0], *path.split("/", 4)[3:5]
        key = f"{mount}/{rest}"
        if kind == "data" and request.method == "POST":
            self.data[key] = json.loads(request.content)["data"]["value"]
            return httpx.Response(200, json={"data": {"version": 1}})
        if kind == "data" and request.method == "GET":
            if key not in self.data:
                return httpx.Response(404, json={"errors": []})
            return httpx.Response(200, json={"data": {"data": {"value": self.data[key]}, "metadata": {"version": 1}}})
        if kind == "metadata" and request.method == "DELETE":
            self.data.pop(key, None)
            return httpx.Response(204)
        return httpx.Response(405, json={"errors": ["unsupported"]})


def vault_manager(store: Store, fake: Callable[[httpx.Request], httpx.Response],
                  token: str = "s.root") -> CredentialManager:
    config = BackendConfig(default=VAULT, vault_addr="http://vault.invalid:8200", vault_token=token, vault_mount="kv")
    return CredentialManager(store, Backends.from_config(config, Keyring([generate_key()]),
                                                         transport=httpx.MockTransport(fake)))


async def test_vault_backend_round_trip(store: Store) -> None:
    fake = FakeVault()
    creds = vault_manager(store, fake)
    sb = await sandbox(store, secrets=["S"])
    view, _ = await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"], scope=f"sandbox:{sb.id}")
    assert view["backend"] == "vault"
    [row] = await raw_rows(store)
    assert row["ref"] == f"kv/data/space/acme/sandbox:{sb.id}/S" and row["ciphertext"] is None
    assert fake.data == {f"kv/space/acme/sandbox:{sb.id}/S": VALUE}
    [r] = await creds.resolve(sb)
    assert r.value == f"Bearer {VALUE}"
    await creds.delete(MEMBER, "S", f"sandbox:{sb.id}")
    assert fake.data == {}
    assert fake.calls[-1] == ("DELETE", f"/v1/kv/metadata/space/acme/sandbox:{sb.id}/S")
    await creds.aclose()


async def test_vault_errors_map_to_space_errors(store: Store) -> None:
    fake = FakeVault()
    creds = vault_manager(store, fake)
    fake.fail = 503
    with pytest.raises(Unavailable):
        await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"])
    assert await raw_rows(store) == []  # nothing is written when the vault did not take the value
    fake.fail = None
    await creds.set(MEMBER, "S", VALUE, hosts=["api.example.com"])
    bad_token = vault_manager(store, fake, token="wrong")
    with pytest.raises(Internal, match="403"):
        await bad_token.resolve(await sandbox(store, secrets=["S"]))

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(Unavailable, match="unreachable"):
        await vault_manager(store, unreachable).resolve(await sandbox(store, secrets=["S"]))
    for m in (creds, bad_token):
        await m.aclose()


async def test_rows_are_read_through_the_backend_that_wrote_them(store: Store) -> None:
    """Switching the default backend leaves existing secrets readable; a replace moves the value."""
    key = generate_key()
    fake = FakeVault()
    await manager(store, key).set(MEMBER, "S", "old", hosts=["api.example.com"])
    config = BackendConfig(default=VAULT, vault_addr="http://vault.invalid", vault_token="s.root")
    creds = CredentialManager(store, Backends.from_config(config, Keyring([key]), transport=httpx.MockTransport(fake)))
    sb = await sandbox(store, secrets=["S"])
    assert [r.value for r in await creds.resolve(sb)] == ["Bearer old"]
    await creds.set(MEMBER, "S", "new", hosts=["api.example.com"])
    [row] = await raw_rows(store)
    assert row["backend"] == "vault" and row["ciphertext"] is None
    assert [r.value for r in await creds.resolve(sb)] == ["Bearer new"]
    await creds.aclose()


def test_vault_needs_address_and_token() -> None:
    with pytest.raises(InvalidRequest):
        HashiCorpVaultBackend("", "t")
    with pytest.raises(InvalidRequest):
        Backends.from_config(BackendConfig(default=VAULT), Keyring([generate_key()]))
    with pytest.raises(InvalidRequest, match="unknown secret backend"):
        Backends.from_config(BackendConfig(default="aws"), Keyring([generate_key()]))
