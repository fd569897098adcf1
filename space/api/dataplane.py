"""Shared pieces of the data-plane routes (commands, files): find the sandbox and its node."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import structlog
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from space.api.state import AppState
from space.errors import InvalidState, RuntimeFailure, SpaceError, Timeout, Unavailable, from_wire
from space.lifecycle import WAKE, Action, State, allowed_actions, require
from space.node.api.client import NodeClient
from space.node.network.port_websocket import ClientSocket
from space.store import Operation, Sandbox

log = structlog.get_logger("space.api.dataplane")


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

    async def open_websocket(self, path: str, **kw: Any) -> ClientSocket:
        try:
            return await self._node.open_websocket(path, **kw)
        except RuntimeFailure as exc:
            raise await self._translate(exc) from None

    async def _translate(self, exc: RuntimeFailure) -> SpaceError:
        if not exc.details.get("sandbox_dead"):
            return exc
        cause = str(exc.details.get("cause") or "exited")
        state = await self._st.controller.sandbox_died(self._sb.id, cause, exc.message)
        if state == State.RESTORING:
            return InvalidState(f"{exc.message}; it is being recovered from its latest snapshot",
                                state=state.value, allowed=allowed_actions(state), cause=cause)
        return InvalidState(exc.message, state=state.value, allowed=allowed_actions(state), cause=cause)


#: How long a call waits for a paused sandbox to resume / a suspended one to be restored.
WAKE_TIMEOUT = {State.PAUSED: 60.0, State.SUSPENDED: 600.0, State.RESTORING: 600.0, State.MOVING: 600.0}
#: Kinds of operation that end an in-between state a call waits out (not asking for anything).
_SETTLING_OPS = {State.RESTORING: ("sandbox.restore", "sandbox.rollback", "sandbox.recover"),
                 State.MOVING: ("sandbox.move",)}
#: A sandbox's last-activity time is written at most this often per sandbox (it is a hint).
TOUCH_EVERY = 5.0
_touched: dict[str, float] = {}


async def running_sandbox(st: AppState, sandbox_id: str, tenant: str,
                          *, read_only: bool = False) -> tuple[Sandbox, SandboxNode]:
    """The tenant's sandbox, ready to talk to its guest: a paused one is resumed and a suspended
    one restored first (transparently, within a deadline) unless it was created with
    ``auto_resume`` off; other states answer 409.

    ``read_only``: the caller's key may only read. Waking a sandbox and counting as its activity
    (which holds off its idle pause) change it, so such a call does neither: a paused sandbox
    answers 409 as without ``auto_resume``. A sandbox being moved to another node is waited for
    (by readers too: waiting changes nothing), and the call goes to its new node."""
    sb = await st.store.get_sandbox(sandbox_id, tenant=tenant)
    if sb.state == State.MOVING:
        sb = await _wake(st, sb)
    if not read_only and ((sb.state in WAKE and sb.auto_resume) or sb.state == State.RESTORING):
        sb = await _wake(st, sb)
    require(sb.state, Action.EXEC)
    if not read_only:
        await _touch(st, sb.id)
    if sb.node_id is None:
        raise Unavailable(f"sandbox {sandbox_id} has no node yet")
    return sb, SandboxNode(st, sb, await st.nodes.client(sb.node_id))


async def _wake(st: AppState, sb: Sandbox) -> Sandbox:
    from space.api.lifecycle import enqueue_action  # the lifecycle routes import this module

    state = State(sb.state)
    deadline = time.monotonic() + WAKE_TIMEOUT[state]
    if state in _SETTLING_OPS:
        # Restored or moved by an operation under way: the call goes on once it has (a move: on
        # the new node).
        ops = await st.store.find_operations(target=sb.id, status=["pending", "running"])
        ops = [o for o in ops if o.kind in _SETTLING_OPS[state]]
        if not ops:
            return sb
        op = ops[0]
    else:
        action = WAKE[state]
        kind = f"sandbox.{action.value}"
        pending = await st.store.find_operations(target=sb.id, kind=kind, status=["pending", "running"])
        if pending:
            op = pending[0]
        else:
            request = {"snapshot": sb.snapshot_id, "node": None} if action == Action.RESTORE else {}
            _, op = await enqueue_action(st, sb.tenant, sb.id, action, kind, {**request, "wake": True})
    log.info("sandbox.wake", sandbox=sb.id, state=state.value, op=op.id)
    op = await wait_operation(st, op.id, deadline)
    if op.status == "failed":
        raise from_wire(500, {"error": {"code": op.error_code, "message": op.error_message}})
    if op.status != "succeeded":
        raise Timeout(f"sandbox {sb.id} did not become running in time ({state.value})")
    return await st.store.get_sandbox(sb.id)


async def wait_operation(st: AppState, op_id: str, deadline: float) -> Operation:
    """The operation once finished (or as it is at the deadline)."""
    done = st.controller.watch(op_id)
    try:
        while True:
            op = await st.store.get_operation(op_id)
            left = deadline - time.monotonic()
            if op.status in ("succeeded", "failed") or left <= 0:
                return op
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=min(left, 0.25))
    finally:
        st.controller.unwatch(op_id, done)


async def _touch(st: AppState, sandbox_id: str) -> None:
    now = time.monotonic()
    if now - _touched.get(sandbox_id, 0.0) < TOUCH_EVERY:
        return
    _touched[sandbox_id] = now
    if len(_touched) > 100_000:  # a bounded hint, not a registry
        _touched.clear()
    await st.store.touch_sandbox(sandbox_id, dt.datetime.now(dt.UTC))


def passthrough(resp: httpx.Response, media_type: str, headers: dict[str, str] | None = None, *,
                first: bytes = b"", status_code: int = 200) -> StreamingResponse:
    """Relay a node's streaming answer to the client byte for byte (after ``first``)."""

    async def body() -> AsyncIterator[bytes]:
        if first:
            yield first
        async for chunk in resp.aiter_raw():
            yield chunk

    return StreamingResponse(body(), status_code=status_code, media_type=media_type, headers=headers,
                             background=BackgroundTask(resp.aclose))
