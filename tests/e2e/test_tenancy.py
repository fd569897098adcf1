"""Tenancy end to end on a real server: isolation, roles, the operator, quotas and the audit trail.

Aspects:
- isolation: tenant B gets 404 for everything of tenant A's (sandbox get/exec/files/fork/pause/
  delete, snapshot get/list/restore), and B's listing does not show A's sandbox
- roles: a tenant admin creates keys only for its tenant (403 otherwise), lists only its tenant's,
  cannot revoke another tenant's key (404), cannot read another tenant's audit (403) nor set quotas;
  a member cannot read the audit; a readonly key cannot mutate (403); the operator does all of it
- quotas: the (k+1)th create is 429 naming the resource, limit, in_use and requested; concurrent
  creates at the limit admit exactly k; cpu and memory limits; a delete frees the quota; a tenant at
  its limit does not consume a warm sandbox; GET /v1/quota shows limits and usage
- egress default: validated, set by the tenant's admin or the operator, read by the tenant
- audit: each mutating call above is recorded once with actor, action, target, result and status,
  failures included (401 as tenant "" / actor "anonymous"); reading is tenant-scoped
- backup interval: the tenant's admin sets it (CLI `space quota backup`, SDK), a member reads it
- CLI: `space quota get/set/backup`, `space audit --json`
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from space.config import DEFAULT_QUOTA
from tests.e2e.harness import SPACE, Server, create_sandbox, run, wait_operation
from tests.waiting import wait_for

pytestmark = pytest.mark.runtime

SMALL = {"template": "base", "cpu": 0.25, "memory_mb": 128}


class Tenant:
    def __init__(self, server: Server, operator: httpx.Client, name: str) -> None:
        self.name = name
        self.server = server
        made = {role: operator.post("/v1/apikeys", json={"tenant": name, "role": role}).json()
                for role in ("admin", "member", "readonly")}
        self.key_ids = {role: m["id"] for role, m in made.items()}
        self.admin = server.client(made["admin"]["key"])
        self.member = server.client(made["member"]["key"])
        self.readonly = server.client(made["readonly"]["key"])

    def close(self) -> None:
        for c in (self.admin, self.member, self.readonly):
            c.close()

    def audit(self, **params: Any) -> list[dict[str, Any]]:
        r = self.admin.get("/v1/audit", params={"limit": 1000, **params})
        assert r.status_code == 200, r.text
        return list(r.json()["records"])


@pytest.fixture(scope="module")
def make_tenant(server: Server, api: httpx.Client) -> Iterator[Any]:
    made: list[Tenant] = []

    def make(prefix: str) -> Tenant:
        t = Tenant(server, api, f"{prefix}-{secrets.token_hex(3)}")
        made.append(t)
        return t

    yield make
    for t in made:
        for sb in t.admin.get("/v1/sandboxes").json().get("sandboxes", []):
            t.admin.delete(f"/v1/sandboxes/{sb['id']}")
        t.close()


def err(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body: dict[str, Any] = r.json()["error"]
    assert body["code"] == code, body
    return body


def once(records: list[dict[str, Any]], action: str, target: str) -> dict[str, Any]:
    found = [r for r in records if r["action"] == action and r["target"] == target]
    assert len(found) == 1, (action, target, found)
    return found[0]


def delete_and_wait(c: httpx.Client, sid: str) -> None:
    r = c.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code == 202, r.text
    assert wait_operation(c, r.json()["operation"]["id"])["status"] == "succeeded"


def test_a_tenant_sees_nothing_of_another(make_tenant: Any) -> None:
    a, b = make_tenant("iso-a"), make_tenant("iso-b")
    sa = create_sandbox(a.member, **SMALL)
    code, out, _ = run(a.member, sa, {"cmd": ["echo", "mine"]})
    assert (code, out) == (0, b"mine\n")
    r = a.member.post(f"/v1/sandboxes/{sa}/snapshots", json={"kind": "disk"})
    assert r.status_code == 202, r.text
    snap = r.json()["snapshot"]["id"]
    assert wait_operation(a.member, r.json()["operation"]["id"])["status"] == "succeeded"

    attempts = [
        ("GET", f"/v1/sandboxes/{sa}", None, None),
        ("POST", f"/v1/sandboxes/{sa}/commands", {"cmd": ["true"]}, "sandbox.exec"),
        ("GET", f"/v1/sandboxes/{sa}/files", None, None),
        ("POST", f"/v1/sandboxes/{sa}/fork", {}, "sandbox.fork"),
        ("POST", f"/v1/sandboxes/{sa}/pause", None, "sandbox.pause"),
        ("POST", f"/v1/sandboxes/{sa}/restore", None, "sandbox.restore"),
        ("GET", f"/v1/sandboxes/{sa}/snapshots", None, None),
        ("GET", f"/v1/snapshots/{snap}", None, None),
        ("DELETE", f"/v1/sandboxes/{sa}/snapshots/{snap}", None, "snapshot.delete"),
        ("DELETE", f"/v1/sandboxes/{sa}", None, "sandbox.delete"),
    ]
    for method, path, body, _ in attempts:
        params = {"path": "/etc/hostname"} if path.endswith("/files") else None
        err(b.admin.request(method, path, json=body, params=params), 404, "not_found")
    assert sa not in [s["id"] for s in b.admin.get("/v1/sandboxes").json()["sandboxes"]]
    assert a.member.get(f"/v1/sandboxes/{sa}").json()["state"] == "running"  # untouched

    # Every refused mutation is in B's audit once, as B's, naming A's object; none is in A's.
    b_records = b.audit()
    for _, path, _, action in attempts:
        if action is not None:
            target = snap if action == "snapshot.delete" else sa
            r = once(b_records, action, target)
            assert (r["tenant"], r["actor"], r["result"], r["status"]) == (b.name, b.key_ids["admin"],
                                                                          "not_found", 404)
            assert r["details"]["path"] == path
    a_records = a.audit()
    assert all(r["actor"] != b.key_ids["admin"] for r in a_records)
    created = once(a_records, "sandbox.create", sa)
    assert (created["actor"], created["result"], created["status"]) == (a.key_ids["member"], "ok", 202)
    assert once(a_records, "sandbox.exec", sa)["details"]["command"]
    assert once(a_records, "snapshot.create", snap)["details"]["params"] == {"sandbox_id": sa}
    delete_and_wait(a.member, sa)
    assert once(a.audit(action="sandbox."), "sandbox.delete", sa)["result"] == "ok"


def test_roles_and_the_operator(server: Server, api: httpx.Client, make_tenant: Any) -> None:
    a, b = make_tenant("role-a"), make_tenant("role-b")
    # A tenant admin manages its own tenant's keys only.
    err(a.admin.post("/v1/apikeys", json={"tenant": b.name, "role": "admin"}), 403, "forbidden")
    own = a.admin.post("/v1/apikeys", json={"tenant": a.name, "role": "member", "name": "ci"})
    assert own.status_code == 201, own.text
    listed = a.admin.get("/v1/apikeys").json()["apikeys"]
    assert {k["tenant"] for k in listed} == {a.name} and own.json()["id"] in [k["id"] for k in listed]
    err(a.admin.get("/v1/apikeys", params={"tenant": b.name}), 403, "forbidden")
    err(a.admin.delete(f"/v1/apikeys/{b.key_ids['member']}"), 404, "not_found")
    assert a.admin.delete(f"/v1/apikeys/{own.json()['id']}").status_code == 204
    err(a.member.post("/v1/apikeys", json={"tenant": a.name}), 403, "forbidden")
    # Audit: a tenant admin reads its own; not another's; a member reads none.
    err(a.admin.get("/v1/audit", params={"tenant": b.name}), 403, "forbidden")
    err(a.member.get("/v1/audit"), 403, "forbidden")
    # Platform-wide actions are the operator's, not any tenant admin's: admitting nodes (a node
    # gets other tenants' sandboxes and secrets), warm pools, templates (shared by every tenant).
    err(a.admin.post("/v1/nodes/tokens", json={}), 403, "forbidden")
    err(a.admin.get("/v1/nodes"), 403, "forbidden")
    err(a.admin.get("/v1/nodes/tokens"), 403, "forbidden")
    err(a.admin.delete("/v1/nodes/node-1"), 403, "forbidden")
    err(a.admin.put("/v1/pools/base", json={"size": 1}), 403, "forbidden")
    err(a.admin.post("/v1/templates/rogue/build", json={}), 403, "forbidden")
    err(a.admin.post("/v1/templates", json={"name": "rogue", "sandbox_id": "s0000000000000000000"}), 403,
        "forbidden")
    # Readonly keys read but never mutate.
    assert a.readonly.get("/v1/sandboxes").status_code == 200
    err(a.readonly.post("/v1/sandboxes", json=SMALL), 403, "forbidden")
    err(a.readonly.put(f"/v1/tenants/{a.name}/egress", json={}), 403, "forbidden")
    # Quotas are the operator's: a tenant admin cannot raise its own.
    err(a.admin.put(f"/v1/tenants/{a.name}/quota", json={"sandboxes": 100}), 403, "forbidden")
    err(a.admin.get(f"/v1/tenants/{b.name}/quota"), 403, "forbidden")
    assert a.member.get(f"/v1/tenants/{a.name}/quota").status_code == 200
    # The operator does all of it.
    assert api.get("/v1/apikeys", params={"tenant": b.name}).json()["apikeys"]
    assert api.put(f"/v1/tenants/{b.name}/quota", json={"memory_mb": 4096}).status_code == 200
    assert api.get("/v1/audit", params={"tenant": a.name}).status_code == 200
    # An unauthenticated call is audited as anonymous, visible to the operator under tenant "".
    with httpx.Client(base_url=server.url, headers={"authorization": "Bearer sk_nope"}) as anon:
        marker = f"/v1/sandboxes/sb-anon{secrets.token_hex(3)}/pause"
        err(anon.post(marker), 401, "unauthorized")

    a_records = a.audit()
    refused = [r for r in a_records if r["action"] == "apikey.create" and r["result"] == "forbidden"]
    assert {r["actor"] for r in refused} == {a.key_ids["admin"], a.key_ids["member"]}
    made = once(a_records, "apikey.create", own.json()["id"])
    assert (made["actor"], made["status"]) == (a.key_ids["admin"], 201)
    assert once(a_records, "apikey.delete", b.key_ids["member"])["result"] == "not_found"
    assert once(a_records, "apikey.delete", own.json()["id"])["result"] == "ok"
    assert once(a_records, "sandbox.create", "")["actor"] == a.key_ids["readonly"]
    assert once(a_records, "quota.set", a.name)["result"] == "forbidden"
    assert once(a_records, "egress.set", a.name)["result"] == "forbidden"
    anon_records = api.get("/v1/audit", params={"tenant": "", "action": "sandbox.pause", "limit": 1000}).json()
    hit = [r for r in anon_records["records"] if r["details"]["path"] == marker]
    assert len(hit) == 1 and (hit[0]["actor"], hit[0]["result"], hit[0]["status"]) == ("anonymous",
                                                                                        "unauthorized", 401)
    # Reading is tenant-scoped: B's records are not A's, the operator's view has both.
    assert all(r["tenant"] == a.name for r in a_records)
    everyone = api.get("/v1/audit", params={"limit": 1000, "action": "apikey."}).json()["records"]
    assert {a.name, "default"} <= {r["tenant"] for r in everyone}


def test_quotas(server: Server, api: httpx.Client, make_tenant: Any) -> None:
    t = make_tenant("quota")
    # A tenant whose limits were never set has the defaults (finding 11 of issue 13).
    assert t.member.get("/v1/quota").json() == {
        "tenant": t.name, "limits": DEFAULT_QUOTA, "source": "default",
        "usage": {"sandboxes": 0, "cpu": 0.0, "memory_mb": 0, "storage_mb": 0.0}, "updated_at": None}
    r = api.put(f"/v1/tenants/{t.name}/quota", json={"sandboxes": 2})
    assert r.status_code == 200 and r.json()["limits"]["sandboxes"] == 2
    err(api.put(f"/v1/tenants/{t.name}/quota", json={"memory": 512}), 422, "validation_failed")
    err(api.put(f"/v1/tenants/{t.name}/quota", json={"cpu": -1}), 422, "validation_failed")

    first = [t.member.post("/v1/sandboxes", json=SMALL) for _ in range(2)]
    assert [r.status_code for r in first] == [202, 202], [r.text for r in first]
    body = err(t.member.post("/v1/sandboxes", json=SMALL), 429, "quota_exceeded")
    assert {k: body[k] for k in ("resource", "limit", "in_use", "requested")} == {
        "resource": "sandboxes", "limit": 2, "in_use": 2, "requested": 1}
    usage = t.member.get("/v1/quota").json()["usage"]
    assert usage == {"sandboxes": 2, "cpu": 0.5, "memory_mb": 256, "storage_mb": 0.0}

    # cpu and memory: refused before anything is placed
    api.put(f"/v1/tenants/{t.name}/quota", json={"sandboxes": None, "cpu": 1.0, "memory_mb": 300})
    body = err(t.member.post("/v1/sandboxes", json={**SMALL, "cpu": 1.0}), 429, "quota_exceeded")
    assert (body["resource"], body["limit"], body["in_use"], body["requested"]) == ("cpu", 1.0, 0.5, 1)
    body = err(t.member.post("/v1/sandboxes", json=SMALL), 429, "quota_exceeded")
    assert (body["resource"], body["limit"], body["in_use"], body["requested"]) == ("memory_mb", 300, 256, 128)

    # A delete frees the quota at once (the sandbox is terminating).
    deletes = [t.member.delete(f"/v1/sandboxes/{r.json()['sandbox']['id']}") for r in first]
    assert [d.status_code for d in deletes] == [202, 202]
    assert t.member.get("/v1/quota").json()["usage"]["sandboxes"] == 0
    for d in deletes:
        wait_operation(t.member, d.json()["operation"]["id"])

    # Concurrent creates at the limit: exactly the limit gets through.
    api.put(f"/v1/tenants/{t.name}/quota", json={"sandboxes": 2, "cpu": None, "memory_mb": None})
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: t.member.post("/v1/sandboxes", json=SMALL), range(6)))
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [202, 202, 429, 429, 429, 429], [r.text for r in answers]
    won = [r.json() for r in answers if r.status_code == 202]
    for w in won:
        assert wait_operation(t.member, w["operation"]["id"])["status"] == "succeeded"
    assert len(t.member.get("/v1/sandboxes").json()["sandboxes"]) == 2

    # An idempotent retry of an accepted create is answered, not refused.
    retry_key = secrets.token_hex(4)
    delete_and_wait(t.member, won[0]["sandbox"]["id"])
    ok = t.member.post("/v1/sandboxes", json=SMALL, headers={"Idempotency-Key": retry_key})
    assert ok.status_code == 202, ok.text
    again = t.member.post("/v1/sandboxes", json=SMALL, headers={"Idempotency-Key": retry_key})
    assert again.status_code == 202 and again.json()["sandbox"]["id"] == ok.json()["sandbox"]["id"]
    err(t.member.post("/v1/sandboxes", json=SMALL, headers={"Idempotency-Key": "other"}), 429, "quota_exceeded")

    # Audit: every create once, the refused ones with their error code.
    creates = t.audit(action="sandbox.create")
    assert [r["result"] for r in creates].count("quota_exceeded") == 3 + 4 + 1
    for r in answers:
        if r.status_code == 202:
            assert once(creates, "sandbox.create", r.json()["sandbox"]["id"])["status"] == 202
    # The operator's calls are the operator's records (naming the tenant), not the tenant's.
    assert t.audit(action="quota.") == []
    op_sets = [r for r in api.get("/v1/audit", params={"action": "quota.set", "limit": 1000}).json()["records"]
               if r["target"] == t.name]
    assert sorted(r["result"] for r in op_sets) == ["ok"] * 3 + ["validation_failed"] * 2
    assert {r["tenant"] for r in op_sets} == {"default"}
    for sb in t.member.get("/v1/sandboxes").json()["sandboxes"]:
        delete_and_wait(t.member, sb["id"])


def test_a_tenant_at_its_limit_does_not_take_a_warm_sandbox(api: httpx.Client, make_tenant: Any) -> None:
    t = make_tenant("warm")
    size = {"template": "base", "cpu": 0.5, "memory_mb": 192}
    pool = {"size": 1, "cpu": 0.5, "memory_mb": 192}
    assert api.put("/v1/pools/base", json=pool).status_code == 200
    try:
        def ready() -> bool:
            return any(p["cpu"] == 0.5 and p["memory_mb"] == 192 and p["ready"] >= 1
                       for p in api.get("/v1/pools").json()["pools"])
        wait_for(ready, 120, "a warm sandbox of the test size")
        api.put(f"/v1/tenants/{t.name}/quota", json={"sandboxes": 0})
        err(t.member.post("/v1/sandboxes", json=size), 429, "quota_exceeded")
        assert ready(), "the refused create claimed the warm sandbox"
    finally:
        api.delete("/v1/pools/base", params={"cpu": 0.5, "memory_mb": 192})


def test_egress_default(api: httpx.Client, make_tenant: Any) -> None:
    t = make_tenant("egress")
    assert t.member.get(f"/v1/tenants/{t.name}/egress").json() == {"tenant": t.name, "egress": {}}
    err(t.admin.put(f"/v1/tenants/{t.name}/egress", json={"allow": ["not a host!"]}), 400, "invalid_request")
    err(t.member.put(f"/v1/tenants/{t.name}/egress", json={"allow": ["pypi.org"]}), 403, "forbidden")
    r = t.admin.put(f"/v1/tenants/{t.name}/egress", json={"allow": ["pypi.org", "*.pythonhosted.org", "pypi.org"]})
    assert r.json() == {"tenant": t.name, "egress": {"allow": ["pypi.org", "*.pythonhosted.org"]}}
    assert api.put(f"/v1/tenants/{t.name}/egress", json={"default": "deny"}).status_code == 200
    assert t.member.get(f"/v1/tenants/{t.name}/egress").json()["egress"] == {"default": "deny"}
    # The egress default and the limits are independent.
    api.put(f"/v1/tenants/{t.name}/quota", json={"sandboxes": 3})
    assert t.member.get(f"/v1/tenants/{t.name}/egress").json()["egress"] == {"default": "deny"}
    results = [r["result"] for r in t.audit(action="egress.set")]
    assert sorted(results) == ["forbidden", "invalid_request", "ok"]


def test_cli(server: Server, make_tenant: Any) -> None:
    t = make_tenant("cli")

    def space(*args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {"SPACE_URL": server.url, "SPACE_API_KEY": key or server.admin_key, "PATH": "/usr/bin:/bin"}
        return subprocess.run([SPACE, *args], capture_output=True, text=True, env=env, timeout=60, check=False)

    set_ = space("quota", "set", t.name, "--sandboxes", "5", "--cpu", "2.5", "--json")
    assert set_.returncode == 0, set_.stderr
    assert json.loads(set_.stdout)["limits"] == {"sandboxes": 5, "cpu": 2.5, "memory_mb": None, "storage_mb": None,
                                                 "disk_mb": None}
    cleared = space("quota", "set", t.name, "--sandboxes", "none", "--memory", "1024", "--json")
    assert json.loads(cleared.stdout)["limits"] == {"sandboxes": None, "cpu": 2.5, "memory_mb": 1024,
                                                    "storage_mb": None, "disk_mb": None}
    shown = space("quota", "get", t.name)
    assert shown.returncode == 0 and "unlimited" in shown.stdout and "2.5" in shown.stdout
    bad = space("quota", "set", t.name, "--sandboxes", "lots")
    assert bad.returncode == 2 and "none" in bad.stderr
    refused = space("quota", "set", t.name, "--sandboxes", "9", key=t.admin.headers["authorization"][7:])
    assert refused.returncode == 1 and "forbidden" in refused.stderr
    own = space("quota", "get", "--json", key=t.member.headers["authorization"][7:])
    assert json.loads(own.stdout)["tenant"] == t.name
    audit = space("audit", "--action", "quota.", "--json", key=t.admin.headers["authorization"][7:])
    assert audit.returncode == 0, audit.stderr
    records = json.loads(audit.stdout)
    assert [(r["action"], r["result"]) for r in records] == [("quota.set", "forbidden")]
    table = space("audit", "--tenant", t.name, "--target", t.name)
    assert table.returncode == 0 and "quota.set" in table.stdout and "forbidden" in table.stdout
    # The tenant's backup interval: its admin sets it, a member reads it.
    admin, member = t.admin.headers["authorization"][7:], t.member.headers["authorization"][7:]
    every = space("quota", "backup", t.name, "--every", "2m", "--json", key=admin)
    assert every.returncode == 0, every.stderr
    assert json.loads(every.stdout) == {"tenant": t.name, "every": 120.0, "source": "tenant"}
    assert "backup every 120 s" in space("quota", "backup", t.name, key=member).stdout
    assert "backup off" in space("quota", "backup", t.name, "--every", "off", key=admin).stdout
    bad = space("quota", "backup", t.name, "--every", "soon", key=admin)
    assert bad.returncode == 1 and "invalid_request" in bad.stderr
    refused = space("quota", "backup", t.name, "--every", "1m", key=member)
    assert refused.returncode == 1 and "forbidden" in refused.stderr
    assert "the deployment's default" in space("quota", "backup", t.name, "--every", "default", key=admin).stdout


def test_sdk(server: Server, make_tenant: Any) -> None:
    from space import Client, errors

    t = make_tenant("sdk")
    with Client(server.url, server.admin_key) as op, Client(server.url, t.admin.headers["authorization"][7:]) as mine:
        assert op.quotas.set(t.name, sandboxes=4, cpu=2.0)["limits"]["sandboxes"] == 4
        q = op.quotas.set(t.name, sandboxes=None)  # cpu left out: it stays
        assert q["limits"] == {"sandboxes": None, "cpu": 2.0, "memory_mb": None, "storage_mb": None, "disk_mb": None}
        assert mine.quotas.get()["limits"] == q["limits"] and mine.quotas.get(t.name)["tenant"] == t.name
        with pytest.raises(errors.Forbidden):
            mine.quotas.set(t.name, sandboxes=100)
        assert mine.quotas.set_egress(t.name, {"deny": ["evil.test"]}) == {"deny": ["evil.test"]}
        assert mine.quotas.get_egress(t.name) == {"deny": ["evil.test"]}
        with pytest.raises(errors.InvalidRequest):
            mine.quotas.set_egress(t.name, {"allow": "pypi.org"})
        assert mine.quotas.set_backup(t.name, "45s") == {"tenant": t.name, "every": 45.0, "source": "tenant"}
        assert op.quotas.get_backup(t.name)["every"] == 45.0
        assert mine.quotas.set_backup(t.name, None)["source"] == "default"
        with pytest.raises(errors.InvalidRequest):
            mine.quotas.set_backup(t.name, 0.2)
        for i in range(5):
            mine.apikeys.create(t.name, role="readonly", name=f"k{i}")
        paged = list(mine.audit.iter(action="apikey.create", page=2))
        assert [r["details"]["method"] for r in paged] == ["POST"] * 5
        assert len({r["id"] for r in paged}) == 5 and all(r["result"] == "ok" for r in paged)
        first = mine.audit.list(limit=1)
        assert len(first) == 1 and mine.audit.list(after=first[0]["id"], limit=1000)[0]["id"] > first[0]["id"]
        with pytest.raises(errors.Forbidden):
            mine.audit.list(tenant="default")
