"""Finding 8: a secret bound to host ``*`` (or any pattern a stranger can get a name under) goes to
whatever host the sandbox names, its owner's own server included. Such patterns are refused when a
secret is set (for every key, the operator's too), dropped when an old row is resolved, and refused
by the gateway itself; a secret goes only to the hosts its pattern names, over verified TLS
(``tests/security/test_secrets_injection.py``)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from sqlalchemy import update

from space.api.auth import Principal
from space.credentials import Backends, CredentialManager, Keyring
from space.credentials.backends import BUILTIN, BuiltinBackend
from space.credentials.crypto import generate_key
from space.errors import InvalidRequest
from space.store import Sandbox, Store
from space.store.models import AuditRecord, Secret
from tests.store.conftest import anyio_backend, store, store_url
from tests.store.storekit import new_op, new_sandbox

__all__ = ["anyio_backend", "store", "store_url"]  # the real store's fixtures

OPERATOR = Principal(key_id="key-op", tenant="default", role="admin")
MEMBER = Principal(key_id="key-member", tenant="acme", role="member")
VALUE = "ghp_s3cr3t-VALUE-1234567890"

#: Patterns that match every host, or every host under a suffix anyone can register a name in.
TOO_BROAD = ["*", "*.com", "*.COM.", "*.io", "*.co.uk", "*.github.io", "*.s3.amazonaws.com", "*.internal",
             "*.zz"]
#: Narrow ones: a name, or the subdomains of a registrable domain.
NARROW = ["api.github.com", "*.github.com", "*.example.co.uk", "*.api.example.com", "github.io", "com",
          "*.my-user.github.io"]


@pytest.fixture
def creds(store: Store) -> CredentialManager:
    return CredentialManager(store, Backends({BUILTIN: BuiltinBackend(Keyring([generate_key()]))}))


@pytest.mark.parametrize("who", [MEMBER, OPERATOR], ids=["tenant-member", "operator-admin"])
@pytest.mark.parametrize("pattern", TOO_BROAD)
async def test_a_secret_for_every_host_is_refused(creds: CredentialManager, who: Principal, pattern: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        await creds.set(who, "S", VALUE, hosts=["api.example.com", pattern])
    assert e.value.status == 400 and e.value.details["field"] == "hosts"
    assert "every host" in e.value.message or "public suffix" in e.value.message
    assert await creds.list(who) == []


@pytest.mark.parametrize("pattern", NARROW)
async def test_narrow_patterns_are_accepted(creds: CredentialManager, pattern: str) -> None:
    view, _ = await creds.set(MEMBER, "S", VALUE, hosts=[pattern])
    assert view["hosts"] == [pattern]


async def test_a_secret_is_bound_to_names_not_addresses(creds: CredentialManager) -> None:
    """Host patterns are names (space.egress_policy): an address is a CIDR's business, and a secret
    goes out only over TLS verified for a name."""
    with pytest.raises(InvalidRequest) as e:
        await creds.set(MEMBER, "S", VALUE, hosts=["10.0.0.7"])
    assert e.value.status == 400 and "10.0.0.7" in e.value.message
    assert await creds.list(MEMBER) == []


async def _sandbox(store: Store, **kw: Any) -> Sandbox:
    sb, _, _ = await store.create_sandbox(new_sandbox("acme", **kw), new_op("acme"))
    return sb


async def test_an_old_row_bound_to_every_host_is_never_handed_to_the_gateway(store: Store) -> None:
    """A row written before the check (or into the database directly) resolves without its broad
    patterns; with none left, to nothing, audited."""
    records: list[AuditRecord] = []

    async def sink(batch: Any) -> None:
        records.extend(batch)

    creds = CredentialManager(store, Backends({BUILTIN: BuiltinBackend(Keyring([generate_key()]))}), sink)
    await creds.set(MEMBER, "WIDE", VALUE, hosts=["api.example.com"])
    await creds.set(MEMBER, "ALL", VALUE, hosts=["api.example.com"])
    async with store._sessionmaker() as s, s.begin():
        await s.execute(update(Secret).where(Secret.name == "WIDE").values(hosts=["api.example.com", "*"]))
        await s.execute(update(Secret).where(Secret.name == "ALL").values(hosts=["*", "*.com"]))
    sb = await _sandbox(store, secrets=["WIDE", "ALL"])
    resolved = await creds.resolve(sb)
    assert [(r.name, r.hosts) for r in resolved] == [("WIDE", ("api.example.com",))]
    refused = [r for r in records if r.action == "secret.refused"]
    assert [(r.details["name"], r.details["hosts"]) for r in refused] == [("WIDE", ["*"]), ("ALL", ["*", "*.com"])]


def test_the_gateway_refuses_a_secret_for_every_host() -> None:
    from space.gateway.registry import Registry

    reg = Registry()
    secret: dict[str, Any] = {"name": "S", "secret_id": "s1", "hosts": ["*"], "header": "Authorization",
                              "value": "Bearer " + VALUE}
    doc: dict[str, Any] = {"ip": "10.208.0.2", "sandbox": "sb", "tenant": "acme", "policy": {"allow": ["*"]},
                           "secrets": [secret]}
    with pytest.raises(InvalidRequest, match="every host"):
        reg.put(doc)
    assert reg.get("10.208.0.2") is None
    # The egress policy itself may still say "*": that is not a secret's binding.
    reg.put({**doc, "secrets": [{**secret, "hosts": ["api.example.com"]}]})


def test_public_suffix_rules() -> None:
    from space import secret_hosts

    psl = secret_hosts.public_suffixes()
    assert psl.is_public("com") and psl.is_public("co.uk") and psl.is_public("github.io")
    assert psl.is_public("anything.ck") and not psl.is_public("www.ck")  # "*.ck" and its exception "!www.ck"
    assert psl.is_public("unlisted")  # the default rule: every unlisted TLD
    assert not psl.is_public("example.com") and not psl.is_public("example.co.uk")
    assert secret_hosts.too_broad("*.www.ck") is None


def test_without_the_public_suffix_list_wildcards_are_refused(tmp_path: Any) -> None:
    from space import secret_hosts

    missing = secret_hosts.PublicSuffixes.load([tmp_path / "none.dat"])
    assert missing.is_public("example.com")  # fail closed: nothing counts as registrable
    assert "public suffix list" in (secret_hosts.too_broad("*.example.com", missing) or "")
    assert secret_hosts.too_broad("api.example.com", missing) is None


def test_expiry_still_applies_to_narrow_secrets() -> None:
    from space.gateway.registry import Secret as GwSecret

    past = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)).isoformat()
    s = GwSecret.from_doc({"name": "n", "secret_id": "s", "hosts": ["*.example.com"], "header": "Authorization",
                           "value": "Bearer x", "expires_at": past})
    assert s.expired() and s.matches("a.example.com") and not s.matches("example.com")
    assert not s.matches("evilexample.com") and not s.matches("a.example.com.evil.test")
