"""/v1/sandboxes/{id}/commands: start, list, stream events, stdin, signals, resize."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from space import event_frames, ids
from space.api.auth import Principal, attach_token, check_attach_token, principal
from space.api.dataplane import passthrough, running_sandbox
from space.api.fields import Bool, Cursor, Int64, Number
from space.api.openapi import RAW_BODY
from space.api.state import AppState, app_state
from space.errors import InvalidRequest, Unauthorized
from space.web import EventStream, asked_wire, event_wire

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/commands")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]

MAX_STDIN = 16 * 1024 * 1024
STREAM_HEADERS = {"cache-control": "no-store", "x-accel-buffering": "no"}


class PtySize(BaseModel):
    rows: Annotated[Int64, Field(gt=0, le=1000)] = 24
    cols: Annotated[Int64, Field(gt=0, le=1000)] = 80


class StartCommand(BaseModel):
    cmd: list[str] | None = Field(None, min_length=1, max_length=4096)
    shell: str | None = Field(None, min_length=1, max_length=1 << 20)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = Field(None, max_length=64)
    pty: PtySize | None = None
    stdin: Bool = False
    timeout: Number | None = Field(None, gt=0, le=30 * 24 * 3600)


class SignalBody(BaseModel):
    signal: str | Int64 = "SIGTERM"


class ResizeBody(BaseModel):
    rows: Annotated[Int64, Field(gt=0, le=1000)]
    cols: Annotated[Int64, Field(gt=0, le=1000)]


#: The two forms of a command's event stream (docs/api.md, "Command events").
EVENT_CONTENT = {event_frames.SSE_MEDIA_TYPE: {"schema": {"type": "string"}},
                 event_frames.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}


@router.post("", status_code=201, responses={201: {
    "description": "The command started. With `Accept: text/event-stream` (or `application/x-space-events`: "
                   "frames, output unencoded) the answer is its event stream (as from `GET .../events`), led by "
                   "a `started` event holding this object: a run to its end in one request.",
    "content": EVENT_CONTENT}})
async def start_command(sandbox_id: str, body: StartCommand, who: Auth, st: St, request: Request) -> Response:
    who.require_write()
    if (body.cmd is None) == (body.shell is None):
        raise InvalidRequest("give exactly one of 'cmd' (argv list) or 'shell' (string)")
    _, node = await running_sandbox(st, sandbox_id, who.tenant)
    cid = ids.command_id()
    payload = body.model_dump(exclude_none=True)
    payload["id"] = cid
    res = await node.call("POST", f"/v1/sandboxes/{sandbox_id}/commands", json_body=payload)
    res["sandbox_id"] = sandbox_id
    res["attach_token"] = attach_token(st.secret, sandbox_id, cid)
    wire = asked_wire(request.headers.get("accept"))
    if wire is None:  # the command as JSON, unless the caller named an event stream
        return JSONResponse(res, status_code=201)
    # The node held the command's output for its first subscriber: this stream is it.
    events = await node.open_stream("GET", f"/v1/sandboxes/{sandbox_id}/commands/{cid}/events",
                                    params={"after": 0}, headers={"accept": wire.media_type})
    return passthrough(events, wire.media_type, STREAM_HEADERS, first=wire.event("started", res, None),
                       status_code=201)


@router.get("")
async def list_commands(sandbox_id: str, who: Auth, st: St) -> dict[str, Any]:
    _, node = await running_sandbox(st, sandbox_id, who.tenant, read_only=who.read_only)
    res: dict[str, Any] = await node.call("GET", f"/v1/sandboxes/{sandbox_id}/commands")
    return res


@router.get("/{cid}")
async def get_command(sandbox_id: str, cid: str, who: Auth, st: St) -> dict[str, Any]:
    _, node = await running_sandbox(st, sandbox_id, who.tenant, read_only=who.read_only)
    res: dict[str, Any] = await node.call("GET", f"/v1/sandboxes/{sandbox_id}/commands/{cid}")
    return res


@router.get("/{cid}/events", response_class=EventStream, responses={200: {
    "description": "The command's events from `after` on: SSE, or with `Accept: application/x-space-events` "
                   "frames whose output is unencoded bytes.",
    "content": EVENT_CONTENT}})
async def command_events(
    sandbox_id: str,
    cid: str,
    request: Request,
    st: St,
    token: str | None = None,
    after: Cursor | None = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    if token is not None:
        # The token of a command a key that may write started: its holder may wake the sandbox.
        if not check_attach_token(st.secret, sandbox_id, cid, token):
            raise Unauthorized("invalid attach token")
        sb = await st.store.get_sandbox(sandbox_id)
        tenant, read_only = sb.tenant, False
    else:
        who = await principal(request)
        tenant, read_only = who.tenant, who.read_only
    _, node = await running_sandbox(st, sandbox_id, tenant, read_only=read_only)
    start = after if after is not None else 0
    if last_event_id and last_event_id.strip().isdigit():
        start = max(start, int(last_event_id.strip()))
    wire = event_wire(request.headers.get("accept"))
    resp = await node.open_stream("GET", f"/v1/sandboxes/{sandbox_id}/commands/{cid}/events",
                                  params={"after": start}, headers={"accept": wire.media_type})
    return passthrough(resp, wire.media_type, STREAM_HEADERS)


@router.post("/{cid}/stdin", status_code=204, openapi_extra=RAW_BODY)
async def command_stdin(sandbox_id: str, cid: str, request: Request, who: Auth, st: St,
                        eof: bool = False) -> Response:
    who.require_write()
    _, node = await running_sandbox(st, sandbox_id, who.tenant)
    # At most MAX_STDIN bytes: space.api.limits refuses more as they arrive (or from the length).
    data = await request.body()
    await node.call("POST", f"/v1/sandboxes/{sandbox_id}/commands/{cid}/stdin", content=data,
                    params={"eof": str(eof).lower()})
    return Response(status_code=204)


@router.post("/{cid}/signal", status_code=204)
async def command_signal(sandbox_id: str, cid: str, body: SignalBody, who: Auth, st: St) -> Response:
    who.require_write()
    _, node = await running_sandbox(st, sandbox_id, who.tenant)
    await node.call("POST", f"/v1/sandboxes/{sandbox_id}/commands/{cid}/signal", json_body=body.model_dump())
    return Response(status_code=204)


@router.post("/{cid}/resize", status_code=204)
async def command_resize(sandbox_id: str, cid: str, body: ResizeBody, who: Auth, st: St) -> Response:
    who.require_write()
    _, node = await running_sandbox(st, sandbox_id, who.tenant)
    await node.call("POST", f"/v1/sandboxes/{sandbox_id}/commands/{cid}/resize", json_body=body.model_dump())
    return Response(status_code=204)
