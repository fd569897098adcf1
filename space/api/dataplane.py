"""Shared pieces of the data-plane routes (commands, files): find the sandbox and its node."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from space.api.state import AppState
from space.errors import Unavailable
from space.lifecycle import Action, require
from space.node.client import NodeClient
from space.store import Sandbox


async def running_sandbox(st: AppState, sandbox_id: str, tenant: str) -> tuple[Sandbox, NodeClient]:
    """The tenant's sandbox, which must be in a state that lets us talk to its guest (else 409)."""
    sb = await st.store.get_sandbox(sandbox_id, tenant=tenant)
    require(sb.state, Action.EXEC)
    if sb.node_id is None:
        raise Unavailable(f"sandbox {sandbox_id} has no node yet")
    return sb, await st.nodes.client(sb.node_id)


def passthrough(resp: httpx.Response, media_type: str, headers: dict[str, str] | None = None) -> StreamingResponse:
    """Relay a node's streaming answer to the client byte for byte."""

    async def body() -> AsyncIterator[bytes]:
        async for chunk in resp.aiter_raw():
            yield chunk

    return StreamingResponse(body(), media_type=media_type, headers=headers,
                             background=BackgroundTask(resp.aclose))
