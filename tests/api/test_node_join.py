"""Join tokens and the join, through the real API app on a real store (SQLite and PostgreSQL).

- an operator makes a token; a node joins with it and its own CSR, and gets a certificate for its
  advertised host, signed by the cluster CA, naming it as a node (serverAuth only)
- the join is authenticated by the token before its body is read; an API key is no join token; a
  revoked, unknown or used-up token admits nobody, and a refused join counts no use
- another key cannot join under an existing node's id; the node's own key can (a restart, a move)
- nodes are listed, shown and removed by the operator only
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from space.api.app import create_app
from space.api.state import AppState
from space.cluster import pki
from space.cluster.pki import ClusterCA
from space.controller import Controller, NodeRegistry
from space.store import Store

pytestmark = pytest.mark.anyio


class Api:
    def __init__(self, http: httpx.AsyncClient, operator: str, tenant_admin: str, ca: ClusterCA,
                 state: AppState) -> None:
        self.http, self.ca, self.state = http, ca, state
        self.operator = {"authorization": f"Bearer {operator}"}
        self.tenant_admin = {"authorization": f"Bearer {tenant_admin}"}

    async def token(self, **body: Any) -> str:
        r = await self.http.post("/v1/nodes/tokens", json=body, headers=self.operator)
        assert r.status_code == 201, r.text
        assert r.json()["ca_fingerprint"] == self.ca.fingerprint
        text: str = r.json()["token"]
        return text

    async def join(self, token: str, node_id: str = "n1", *, key: bytes | None = None,
                   url: str = "https://n1.cluster.test:7443", **extra: Any) -> httpx.Response:
        key = key or pki.new_key()
        body = {"node_id": node_id, "advertise_url": url, "csr": pki.csr_for_key(key, node_id).decode(),
                "version": "0.9", **extra}
        return await self.http.post("/v1/nodes/join", json=body, headers={"authorization": f"Bearer {token}"})


@pytest.fixture
async def api(store: Store) -> AsyncIterator[Api]:
    nodes = NodeRegistry(store)
    ca = ClusterCA.create()
    state = AppState(store=store, nodes=nodes, controller=Controller(store, nodes), secret=b"k" * 32, cluster_ca=ca)
    _, operator = await store.create_api_key("default", "admin", "operator")
    _, tenant_admin = await store.create_api_key("acme", "admin", "acme admin")
    transport = httpx.ASGITransport(app=create_app(state))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as c:
            yield Api(c, operator, tenant_admin, ca, state)
    finally:
        await state.audit.aclose()
        await nodes.aclose()


def code(r: httpx.Response) -> str:
    c: str = r.json()["error"]["code"]
    return c


async def test_a_node_joins_and_gets_a_node_certificate(api: Api, store: Store) -> None:
    key = pki.new_key()
    r = await api.join(await api.token(description="rack 4"), key=key)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["ca_certificate"] == api.ca.cert_pem.decode()
    cert = x509.load_pem_x509_certificate(body["certificate"].encode())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node:n1"
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == [pki.identity_name("n1"), "n1.cluster.test"]
    assert pki.node_id_of(body["certificate"].encode()) == "n1"
    assert body["node"]["state"] == "joining" and body["node"]["identity"] == "certificate"
    row = await store.get_node("n1")
    assert (row.url, row.version, row.token) == ("https://n1.cluster.test:7443", "0.9", "")
    assert row.key_sha256 == pki.public_key_sha256(pki.csr_for_key(key, "n1"))


async def test_the_join_is_authenticated_before_its_body_is_read(api: Api, store: Store) -> None:
    broken = b'{"node_id": ' + b"x" * 100_000  # not JSON: read and parsed, it would be a 422
    for headers in ({}, {"authorization": "Bearer spj_abcdefgh." + "x" * 43}, api.operator):
        r = await api.http.post("/v1/nodes/join", content=broken,
                                headers={**headers, "content-type": "application/json"})
        assert (r.status_code, code(r)) == (401, "join_token_refused"), r.text
    assert await store.list_nodes(None) == []


async def test_an_api_key_is_no_join_token(api: Api, store: Store) -> None:
    r = await api.join(api.operator["authorization"].removeprefix("Bearer "))
    assert (r.status_code, code(r)) == (401, "join_token_refused")
    assert await store.list_nodes(None) == []


async def test_refused_tokens_say_why_and_refused_joins_count_nothing(api: Api, store: Store) -> None:
    token = await api.token(max_uses=1)
    for url in ("http://n1:7443", "https://n1", "https://n1:7443/path", "https://u:p@n1:7443", "https://n1:99999"):
        r = await api.join(token, url=url)
        assert (r.status_code, code(r)) == (400, "invalid_request"), (url, r.text)
    r = await api.join(token, csr="-----BEGIN CERTIFICATE REQUEST-----\ngarbage\n")
    assert (r.status_code, code(r)) == (400, "invalid_request"), r.text
    [row] = await store.list_join_tokens()
    assert row.uses == 0
    assert (await api.join(token)).status_code == 201
    r = await api.join(token, "n2")
    assert (r.status_code, code(r), r.json()["error"]["reason"]) == (401, "join_token_refused", "used_up")

    revoked = await api.token()
    token_id = revoked.removeprefix("spj_").split(".")[0]
    assert (await api.http.delete(f"/v1/nodes/tokens/{token_id}", headers=api.operator)).status_code == 200
    r = await api.join(revoked, "n3")
    assert (r.status_code, r.json()["error"]["reason"]) == (401, "revoked")
    listed = (await api.http.get("/v1/nodes/tokens", headers=api.operator)).json()["tokens"]
    assert {t["id"]: t["uses"] for t in listed}[token_id] == 0
    assert all("token" not in t and "secret_hash" not in t for t in listed)


async def test_only_the_nodes_own_key_joins_again_under_its_id(api: Api) -> None:
    token = await api.token()
    key = pki.new_key()
    assert (await api.join(token, key=key)).status_code == 201
    r = await api.join(token, url="https://evil.test:7443")
    assert (r.status_code, code(r)) == (409, "node_exists")
    moved = await api.join(token, key=key, url="https://n1-new.cluster.test:7443")
    assert moved.status_code == 201 and moved.json()["node"]["url"] == "https://n1-new.cluster.test:7443"


async def test_nodes_are_the_operators(api: Api) -> None:
    assert (await api.join(await api.token(), url="https://10.0.0.7:7443")).status_code == 201
    r = await api.http.get("/v1/nodes/n1", headers=api.operator)
    assert r.status_code == 200 and r.json()["url"] == "https://10.0.0.7:7443"
    assert set(r.json()) >= {"state", "capacity", "load", "version", "heartbeat_at"}
    for method, path in (("GET", "/v1/nodes"), ("GET", "/v1/nodes/n1"), ("DELETE", "/v1/nodes/n1"),
                         ("GET", "/v1/nodes/tokens"), ("POST", "/v1/nodes/tokens")):
        r = await api.http.request(method, path, headers=api.tenant_admin, json={} if method == "POST" else None)
        assert (r.status_code, code(r)) == (403, "forbidden"), (method, path)
    assert (await api.http.delete("/v1/nodes/n1", headers=api.operator)).status_code == 204
    r = await api.http.get("/v1/nodes/n1", headers=api.operator)
    assert (r.status_code, code(r)) == (404, "not_found")
    r = await api.http.delete("/v1/nodes/n1", headers=api.operator)
    assert r.status_code == 404
