"""/v1/nodes: the nodes the control plane schedules onto, the join tokens that admit them, and the
join itself.

Everything here but ``POST /v1/nodes/join`` needs an operator admin key. The join needs a join
token and nothing else (a token admits nodes and can do nothing else): it is checked before
anything is parsed or signed. The node sends a certificate request made with its own key; the
cluster CA signs it for the address the node advertises, and the node serves its API over mutual
TLS with that certificate from then on.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from space.api import views
from space.api.auth import Principal, join_token, principal
from space.api.fields import Int64
from space.api.state import AppState, app_state
from space.cluster.pki import MAX_CSR_BYTES, PKIError, public_key_sha256
from space.controller.moves import DRAIN_PARALLEL, MAX_DRAIN_PARALLEL, start_drain
from space.errors import InvalidRequest, NotFound, Unavailable
from space.store.models import JoinToken, Node

router = APIRouter(prefix="/v1/nodes")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]

NODE_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,49}$"


def node_view(n: Node) -> dict[str, Any]:
    cap = n.capacity or {}
    return {
        "id": n.id, "url": n.url, "state": n.state, "version": n.version,
        # Taken out of placement by an operator (cordon, drain): what runs there runs on.
        "cordoned": bool(n.cordoned), "schedulable": n.state == "ready" and not n.cordoned,
        "heartbeat_at": n.heartbeat_at.isoformat() if n.heartbeat_at else None,
        "created_at": n.created_at.isoformat() if n.created_at else None,
        "identity": "certificate" if n.certificate else "token",
        # The node's last heartbeat as it was (cpus, memory_mb, pool, templates, warm, ...).
        "capacity": cap,
        "load": {"sandboxes": cap.get("sandboxes"), "committed_cpu": cap.get("committed_cpu"),
                 "committed_memory_mb": cap.get("committed_memory_mb"), "loadavg": cap.get("loadavg")},
    }


def token_view(t: JoinToken) -> dict[str, Any]:
    return {"id": t.id, "description": t.description, "created_by": t.created_by,
            "created_at": t.created_at.isoformat(), "expires_at": t.expires_at.isoformat(),
            "revoked_at": t.revoked_at.isoformat() if t.revoked_at else None,
            "uses": t.uses, "max_uses": t.max_uses,
            "last_used_at": t.last_used_at.isoformat() if t.last_used_at else None}


@router.get("")
async def list_nodes(who: Auth, st: St) -> dict[str, Any]:
    who.require_operator()
    return {"nodes": [node_view(n) for n in await st.store.list_nodes(None)]}


# -- join tokens (before /{node_id}: "tokens" is no node) ----------------------------------------


class CreateToken(BaseModel):
    ttl_seconds: Annotated[Int64, Field(ge=1, le=365 * 86400)] = 86400
    description: str = Field("", max_length=256)
    #: At most what the store's column holds (a 32-bit integer).
    max_uses: Annotated[Int64, Field(ge=1, le=(1 << 31) - 1)] | None = None


@router.post("/tokens", status_code=201)
async def create_token(body: CreateToken, who: Auth, st: St) -> dict[str, Any]:
    """A join token; its text is in this answer only (the control plane keeps its hash)."""
    who.require_operator()
    if st.cluster_ca is None:
        raise Unavailable("this control plane holds no cluster CA, so no node can join it")
    row, text = await st.store.create_join_token(ttl=dt.timedelta(seconds=body.ttl_seconds),
                                                 description=body.description, created_by=who.key_id,
                                                 max_uses=body.max_uses)
    return {**token_view(row), "token": text, "ca_fingerprint": st.cluster_ca.fingerprint}


@router.get("/tokens")
async def list_tokens(who: Auth, st: St) -> dict[str, Any]:
    who.require_operator()
    return {"tokens": [token_view(t) for t in await st.store.list_join_tokens()]}


@router.delete("/tokens/{token_id}")
async def revoke_token(token_id: str, who: Auth, st: St) -> dict[str, Any]:
    who.require_operator()
    return token_view(await st.store.revoke_join_token(token_id))


# -- the join -------------------------------------------------------------------------------------


class Join(BaseModel):
    node_id: str = Field(..., pattern=NODE_ID)
    #: Where the control plane will reach the node: https://HOST:PORT, HOST its certificate's name.
    advertise_url: str = Field(..., max_length=300)
    csr: str = Field(..., max_length=MAX_CSR_BYTES)
    version: str | None = Field(None, max_length=64)


def advertised_host(url: str) -> tuple[str, str]:
    """``(normalized url, host)`` of an advertise URL: ``https://HOST:PORT`` and nothing more."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidRequest(f"advertise_url {url[:100]!r} is not a URL") from None
    host = (parts.hostname or "").lower()
    if parts.scheme != "https" or not host or port is None or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username or parts.password:
        raise InvalidRequest(f"advertise_url must be https://HOST:PORT, got {url[:100]!r}")
    try:
        shown = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        shown = host
    return f"https://{shown}:{port}", host


@router.post("/join", status_code=201)
async def join(body: Join, st: St, token: Annotated[str, Depends(join_token)]) -> dict[str, Any]:
    """Admit a node: ``Authorization: Bearer <join token>``; the node's CSR signed for its
    advertised host. Answers the node certificate and the cluster CA's. (The token was checked
    before the body was read, by AuthenticateFirst; here again, and once more as it is counted.)"""
    if st.cluster_ca is None:
        raise Unavailable("this control plane holds no cluster CA, so no node can join it")
    url, host = advertised_host(body.advertise_url)
    csr = body.csr.encode()
    try:
        certificate = st.cluster_ca.sign_node(csr, node_id=body.node_id, hosts=[host])
    except PKIError as e:
        raise InvalidRequest(f"the node's certificate request: {e}") from None
    row = await st.store.join_node(token, node_id=body.node_id, url=url, certificate=certificate.decode(),
                                   key_sha256=public_key_sha256(csr), version=body.version, capacity={})
    await st.nodes.forget(body.node_id)  # this replica's client; the others' follow the row
    st.nodes.invalidate_rows()
    return {"node": node_view(row), "certificate": certificate.decode(),
            "ca_certificate": st.cluster_ca.cert_pem.decode()}


# -- one node -----------------------------------------------------------------------------------


@router.get("/{node_id}")
async def get_node(node_id: str, who: Auth, st: St) -> dict[str, Any]:
    who.require_operator()
    return node_view(await st.store.get_node(node_id))


@router.delete("/{node_id}", status_code=204)
async def remove_node(node_id: str, who: Auth, st: St) -> None:
    """Forget a node (409 ``node_busy`` while sandboxes are on it). It may join again with a token."""
    who.require_operator()
    try:
        await st.store.remove_node(node_id)
    except NotFound:
        raise NotFound(f"node {node_id} not found") from None
    await st.nodes.forget(node_id)
    st.nodes.invalidate_rows()


# -- cordon, drain, uncordon ----------------------------------------------------------------------


@router.post("/{node_id}/cordon")
async def cordon(node_id: str, who: Auth, st: St) -> dict[str, Any]:
    """Place nothing new on the node (its warm pool is let go); what runs there runs on."""
    who.require_operator()
    row = await st.store.set_node_cordoned(node_id, True)
    st.nodes.invalidate_rows()
    return node_view(row)


@router.post("/{node_id}/uncordon")
async def uncordon(node_id: str, who: Auth, st: St) -> dict[str, Any]:
    """Put the node back into placement (a drain under way stops, what it moved stays moved)."""
    who.require_operator()
    row = await st.store.set_node_cordoned(node_id, False)
    st.nodes.invalidate_rows()
    return node_view(row)


class DrainBody(BaseModel):
    #: Sandboxes moved at once.
    parallel: Annotated[Int64, Field(ge=1, le=MAX_DRAIN_PARALLEL)] = DRAIN_PARALLEL


@router.post("/{node_id}/drain", status_code=202)
async def drain(node_id: str, who: Auth, st: St, body: DrainBody | None = None) -> JSONResponse:
    """Cordon the node and move every sandbox off it (running ones with their processes, paused ones
    stay paused; suspended ones need nothing): operation ``node.drain``, its progress the count. A
    drain already under way is answered, not doubled."""
    who.require_operator()
    body = body or DrainBody()
    row, op, created = await start_drain(st.store, node_id, tenant=who.tenant, parallel=body.parallel)
    if created:
        st.nodes.invalidate_rows()
        st.controller.wake()
    return JSONResponse({"node": node_view(row), "operation": views.operation(op)}, status_code=202)
