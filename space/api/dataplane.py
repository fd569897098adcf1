"""Shared pieces of the data-plane routes (commands, files): find the sandbox and its node."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from space.api.state import AppState
from space.errors import InvalidState, RuntimeFailure, SpaceError, Unavailable
from space.lifecycle import Action, State, allowed_actions, require
from space.node.client import NodeClient
from space.store import Sandbox


class SandboxNode:
    """The node of one sandbox, as the data plane talks to it: a node that finds the sandbox dead
    makes the sandbox ``failed`` right away (with the reason), and the caller gets the 409 that every
    later call would get too."""

    def __init__(self, st: AppState, sb: Sandbox, node: NodeClient) -> None:
        self._st, self._sb, self._node = st, sb, node

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return await self._node.call(method, path, **kw)
        except RuntimeFailure as exc:
            raise await self._translate(exc) from None

    async def open_stream(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return await self._node.open_stream(method, path, **kw)
        except RuntimeFailure as exc:
            raise await self._translate(exc) from None

    async def _translate(self, exc: RuntimeFailure) -> SpaceError:
        if not exc.details.get("sandbox_dead"):
            return exc
        await mark_dead(self._st, self._sb.id, exc.message, self._sb.state)
        return InvalidState(exc.message, state=State.FAILED.value, allowed=allowed_actions(State.FAILED),
                            cause=exc.details.get("cause"))


async def mark_dead(st: AppState, sandbox_id: str, message: str, expect: str) -> None:
    with contextlib.suppress(SpaceError):  # someone else moved it first: theirs stands
        await st.store.set_sandbox_state(sandbox_id, State.FAILED, expect=[State(expect)],
                                         error_code=RuntimeFailure.code, error_message=message)


async def running_sandbox(st: AppState, sandbox_id: str, tenant: str) -> tuple[Sandbox, SandboxNode]:
    """The tenant's sandbox, which must be in a state that lets us talk to its guest (else 409)."""
    sb = await st.store.get_sandbox(sandbox_id, tenant=tenant)
    require(sb.state, Action.EXEC)
    if sb.node_id is None:
        raise Unavailable(f"sandbox {sandbox_id} has no node yet")
    return sb, SandboxNode(st, sb, await st.nodes.client(sb.node_id))


def passthrough(resp: httpx.Response, media_type: str, headers: dict[str, str] | None = None) -> StreamingResponse:
    """Relay a node's streaming answer to the client byte for byte."""

    async def body() -> AsyncIterator[bytes]:
        async for chunk in resp.aiter_raw():
            yield chunk

    return StreamingResponse(body(), media_type=media_type, headers=headers,
                             background=BackgroundTask(resp.aclose))
