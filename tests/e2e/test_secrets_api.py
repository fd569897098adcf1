"""Secrets through the real server: the HTTP API, the ``space secret`` CLI and the SDK. Values go in
and never come back out (API, CLI table and JSON, database file)."""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from space import Client
from space.errors import Forbidden, InvalidRequest
from tests.e2e.harness import SPACE, Server, create_sandbox, wait_operation

pytestmark = pytest.mark.runtime


def new_key(server: Server, tenant: str, role: str) -> str:
    with server.client() as admin:
        r = admin.post("/v1/apikeys", json={"tenant": tenant, "role": role, "name": "secrets-e2e"})
        assert r.status_code == 201, r.text
        return str(r.json()["key"])


@pytest.fixture(scope="module")
def tenant() -> str:
    return "sec" + secrets.token_hex(4)


@pytest.fixture(scope="module")
def keys(server: Server, tenant: str) -> dict[str, str]:
    return {role: new_key(server, tenant, role) for role in ("member", "readonly")} | {
        "other": new_key(server, tenant + "x", "admin")}


@pytest.fixture
def member(server: Server, keys: dict[str, str]) -> Iterator[httpx.Client]:
    with server.client(keys["member"]) as c:
        yield c
        for s in c.get("/v1/secrets").json()["secrets"]:
            c.delete(f"/v1/secrets/{s['name']}", params={"scope": s["scope"]})


def value() -> str:
    return "tok_" + secrets.token_urlsafe(24)


def cli(server: Server, key: str, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "SPACE_URL": server.url, "SPACE_API_KEY": key}
    return subprocess.run([SPACE, *args], env=env, capture_output=True, input=stdin, timeout=120)


def test_set_list_delete_over_http(server: Server, member: httpx.Client, keys: dict[str, str]) -> None:
    v = value()
    r = member.put("/v1/secrets/GITHUB_TOKEN", json={"value": v, "hosts": ["api.github.com"], "rate_limit": 30,
                                                     "ttl_seconds": 3600})
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["name"], body["scope"], body["hosts"], body["header"], body["format"], body["rate_limit"]) == (
        "GITHUB_TOKEN", "tenant", ["api.github.com"], "Authorization", "Bearer {}", 30)
    assert body["expires_at"] is not None and v not in r.text
    r = member.put("/v1/secrets/GITHUB_TOKEN", json={"value": v, "hosts": ["*.github.com"], "format": "token {}"})
    assert r.status_code == 200 and r.json()["id"] == body["id"] and r.json()["expires_at"] is None

    listed = member.get("/v1/secrets")
    assert listed.status_code == 200 and v not in listed.text
    assert [(s["name"], s["format"]) for s in listed.json()["secrets"]] == [("GITHUB_TOKEN", "token {}")]
    assert member.get("/v1/secrets", params={"scope": "project:none"}).json() == {"secrets": []}

    # Sealed at rest: neither the database nor its write-ahead log holds the value.
    for name in ("space.db", "space.db-wal"):
        path = server.data_dir / "control" / name
        if path.exists():
            assert v.encode() not in path.read_bytes()
    key_file = server.data_dir / "master.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600

    assert member.delete("/v1/secrets/GITHUB_TOKEN").status_code == 204
    r = member.delete("/v1/secrets/GITHUB_TOKEN")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert member.get("/v1/secrets").json() == {"secrets": []}


def test_readonly_keys_list_but_do_not_change(server: Server, member: httpx.Client, keys: dict[str, str]) -> None:
    assert member.put("/v1/secrets/S", json={"value": value(), "hosts": ["api.example.com"]}).status_code == 201
    with server.client(keys["readonly"]) as ro:
        assert [s["name"] for s in ro.get("/v1/secrets").json()["secrets"]] == ["S"]
        for r in (ro.put("/v1/secrets/S", json={"value": "x", "hosts": ["api.example.com"]}),
                  ro.delete("/v1/secrets/S")):
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert [s["name"] for s in member.get("/v1/secrets").json()["secrets"]] == ["S"]


def test_other_tenants_see_nothing(server: Server, member: httpx.Client, keys: dict[str, str]) -> None:
    v = value()
    assert member.put("/v1/secrets/S", json={"value": v, "hosts": ["api.example.com"]}).status_code == 201
    with server.client(keys["other"]) as other:
        assert other.get("/v1/secrets").json() == {"secrets": []}
        r = other.delete("/v1/secrets/S")
        assert r.status_code == 404 and v not in r.text
    assert [s["name"] for s in member.get("/v1/secrets").json()["secrets"]] == ["S"]


@pytest.mark.parametrize(("body", "field", "status"), [
    ({"hosts": ["http://api.x.com/path"]}, "hosts", 400),
    ({"hosts": []}, "hosts", 400),
    ({"format": "Token"}, "format", 400),
    ({"format": "{}{}"}, "format", 400),
    ({"header": "Content-Length"}, "header", 400),
    ({"value": "a\nb"}, "value", 400),
    ({"scope": "sandbox:s0000000000000000000"}, None, 404),
    ({"scope": "galaxy"}, "scope", 400),
    ({"rate_limit": 0}, "rate_limit", 400),
    ({"value": "x" * 20000}, "value", 413),
])
def test_bad_requests_are_json_errors(member: httpx.Client, body: dict[str, object], field: str | None,
                                      status: int) -> None:
    full = {"value": "tok_abc", "hosts": ["api.example.com"], **body}
    r = member.put("/v1/secrets/S", json=full)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] in ("invalid_request", "not_found", "too_large") and err["message"]
    if field:
        assert err["field"] == field
    assert "tok_abc" not in r.text
    assert member.get("/v1/secrets").json() == {"secrets": []}


def test_unknown_fields_and_bad_types_are_refused(member: httpx.Client) -> None:
    r = member.put("/v1/secrets/S", json={"value": "v", "hosts": ["api.example.com"], "host": "x"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_failed"
    r = member.put("/v1/secrets/bad%20name", json={"value": "v", "hosts": ["api.example.com"]})
    assert r.status_code == 400 and r.json()["error"]["field"] == "name"


def test_sandbox_scope(server: Server, member: httpx.Client, keys: dict[str, str]) -> None:
    sid = create_sandbox(member)
    try:
        r = member.put("/v1/secrets/S", json={"value": value(), "hosts": ["api.example.com"],
                                              "scope": f"sandbox:{sid}"})
        assert r.status_code == 201 and r.json()["scope"] == f"sandbox:{sid}"
        listed = member.get("/v1/secrets", params={"scope": f"sandbox:{sid}"}).json()["secrets"]
        assert [s["name"] for s in listed] == ["S"]
        with server.client(keys["other"]) as other:  # another tenant's sandbox does not exist for it
            r = other.put("/v1/secrets/S", json={"value": "x", "hosts": ["api.example.com"], "scope": f"sandbox:{sid}"})
            assert r.status_code == 404
        assert member.delete("/v1/secrets/S", params={"scope": f"sandbox:{sid}"}).status_code == 204
    finally:
        r = member.delete(f"/v1/sandboxes/{sid}")
        assert r.status_code == 202, r.text
        assert wait_operation(member, r.json()["operation"]["id"])["status"] == "succeeded"


def test_cli(server: Server, member: httpx.Client, keys: dict[str, str]) -> None:
    v = value()
    key = keys["member"]
    p = cli(server, key, "secret", "set", "API_KEY", "-", "--host", "api.example.com", "--host", "*.example.org",
            "--header", "X-Api-Key", "--format", "{}", "--ttl", "600", "--rate-limit", "5", stdin=v.encode() + b"\n")
    assert p.returncode == 0, p.stderr
    assert v.encode() not in p.stdout + p.stderr
    p = cli(server, key, "secret", "set", "BASIC", "user:" + v, "--host", "x.example.com", "--format", "basic",
            "--scope", "project:web")
    assert p.returncode == 0, p.stderr

    table = cli(server, key, "secret", "list")
    assert table.returncode == 0, table.stderr
    out = table.stdout.decode()
    assert "API_KEY" in out and "X-Api-Key" in out and "api.example.com,*.example.org" in out and "project:web" in out
    as_json = cli(server, key, "secret", "list", "--json")
    got = {s["name"]: s for s in json.loads(as_json.stdout)}
    assert got["API_KEY"]["rate_limit"] == 5 and got["API_KEY"]["expires_at"] and got["BASIC"]["format"] == "basic"
    only_web = json.loads(cli(server, key, "secret", "list", "--scope", "project:web", "--json").stdout)
    assert [s["name"] for s in only_web] == ["BASIC"]
    for p in (table, as_json):
        assert v.encode() not in p.stdout + p.stderr

    bad = cli(server, key, "secret", "set", "X", "v", "--host", "not a host")
    assert bad.returncode == 1 and b"invalid_request" in bad.stderr
    both = cli(server, key, "secret", "set", "X", "v", "--host", "a.com", "--ttl", "5", "--expires-at",
               "2100-01-01T00:00:00Z")
    assert both.returncode == 2
    ro = cli(server, keys["readonly"], "secret", "delete", "API_KEY")
    assert ro.returncode == 1 and b"forbidden" in ro.stderr

    assert cli(server, key, "secret", "delete", "API_KEY").returncode == 0
    assert cli(server, key, "secret", "delete", "BASIC", "--scope", "project:web").returncode == 0
    gone = cli(server, key, "secret", "delete", "BASIC", "--scope", "project:web")
    assert gone.returncode == 1 and b"not_found" in gone.stderr
    assert json.loads(cli(server, key, "secret", "list", "--json").stdout) == []


def test_sdk(server: Server, keys: dict[str, str]) -> None:
    with Client(server.url, keys["member"]) as c:
        view = c.secrets.set("SDK", value(), hosts=["api.example.com"], scope="project:p",
                             expires_at="2100-01-01T00:00:00Z")
        assert view["scope"] == "project:p" and view["expires_at"].startswith("2100-01-01")
        assert [s["name"] for s in c.secrets.list("project:p")] == ["SDK"]
        with pytest.raises(InvalidRequest):
            c.secrets.set("SDK", "v", hosts=["api.example.com"], format="nope")
        c.secrets.delete("SDK", "project:p")
        assert c.secrets.list() == []
    with Client(server.url, keys["readonly"]) as ro, pytest.raises(Forbidden):
        ro.secrets.set("SDK", "v", hosts=["api.example.com"])


def test_each_secret_change_is_audited_once(server: Server, member: httpx.Client, tenant: str) -> None:
    """The credential manager's record is the audit of a secret change (and of a refusal); the
    generic per-call record does not add a second row. A call refused before it reaches the manager
    (a malformed body) still gets the generic one."""
    name = "ONCE_" + secrets.token_hex(3).upper()
    assert member.put(f"/v1/secrets/{name}", json={"value": value(), "hosts": ["api.example.com"]}).status_code == 201
    assert member.put(f"/v1/secrets/{name}", json={"value": value(), "hosts": ["bad host"]}).status_code == 400
    assert member.put(f"/v1/secrets/{name}", json={"value": 1, "hosts": "x"}).status_code == 422
    assert member.delete(f"/v1/secrets/{name}").status_code == 204
    with server.client() as admin:
        records = admin.get("/v1/audit", params={"tenant": tenant, "target": name, "limit": 1000}).json()["records"]
    # Sorted: the manager writes at once, the generic records go through a batching writer.
    seen = sorted((r["action"], r["result"]) for r in records)
    assert seen == [("secret.delete", "ok"), ("secret.set", "invalid_request"), ("secret.set", "ok"),
                    ("secret.set", "validation_failed")], seen
    ok = next(r for r in records if (r["action"], r["result"]) == ("secret.set", "ok"))
    assert ok["details"].get("secret_id")  # the manager's record, not the generic one
