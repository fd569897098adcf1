"""/v1/nodes (admin only): the nodes the control plane schedules onto."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from space.api.auth import Principal, principal
from space.api.state import AppState, app_state
from space.errors import SpaceError, Unavailable
from space.node.api.client import NodeClient

router = APIRouter(prefix="/v1/nodes")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]


class RegisterNode(BaseModel):
    id: str = Field(..., min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
    url: str = Field(..., pattern=r"^(https?|unix)://")
    token: str = Field(..., min_length=16, max_length=512)


def node_view(n: Any) -> dict[str, Any]:
    return {"id": n.id, "url": n.url, "state": n.state, "capacity": n.capacity,
            "heartbeat_at": n.heartbeat_at.isoformat() if n.heartbeat_at else None}


@router.post("", status_code=201)
async def register_node(body: RegisterNode, who: Auth, st: St) -> JSONResponse:
    """Register (or re-register) a node; it must answer with its token before it is scheduled."""
    who.require_operator()
    probe = NodeClient(body.id, body.url, body.token, timeout=10)
    try:
        info = await probe.call("GET", "/v1/node")
    except SpaceError as exc:
        raise Unavailable(f"node {body.id} at {body.url} did not answer: {exc.message}") from None
    finally:
        await probe.aclose()
    row = await st.store.upsert_node(body.id, body.url, body.token, {"pool": info.get("pool")})
    await st.nodes.forget(body.id)  # a new url or token replaces the cached client
    return JSONResponse(node_view(row), status_code=201)


@router.get("")
async def list_nodes(who: Auth, st: St) -> dict[str, Any]:
    who.require_operator()
    return {"nodes": [node_view(n) for n in await st.store.list_nodes(None)]}
