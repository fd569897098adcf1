"""/v1/sandboxes/{id}/files: streamed download and upload, list, stat, mkdir, move, remove."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from space import paths
from space.api.auth import Principal, principal
from space.api.dataplane import passthrough, running_sandbox
from space.api.openapi import RAW_BODY
from space.api.state import AppState, app_state
from space.errors import InvalidRequest, PayloadTooLarge
from space.web import OctetStream

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/files")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]
PathQ = Annotated[str, Query(min_length=1, max_length=paths.MAX_PATH)]


class PathBody(BaseModel):
    path: str


class MoveBody(BaseModel):
    src: str
    dst: str


@router.get("", response_class=OctetStream)
async def download(sandbox_id: str, path: PathQ, who: Auth, st: St) -> StreamingResponse:
    p = paths.normalize(path)
    _, node = await running_sandbox(st, sandbox_id, who.tenant, read_only=who.read_only)
    resp = await node.open_stream("GET", f"/v1/sandboxes/{sandbox_id}/files", params={"path": p})
    return passthrough(resp, "application/octet-stream")


@router.put("", openapi_extra=RAW_BODY)
async def upload(sandbox_id: str, path: PathQ, request: Request, who: Auth, st: St) -> dict[str, Any]:
    who.require_write()
    p = paths.normalize(path)
    limit = st.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("bad Content-Length")
        if int(declared) > limit:
            raise PayloadTooLarge(f"upload of {declared} bytes exceeds the limit of {limit} bytes", limit=limit)
    _, node = await running_sandbox(st, sandbox_id, who.tenant)
    too_large = False

    async def body() -> AsyncIterator[bytes]:
        nonlocal too_large
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                too_large = True
                # Abort the upstream request: the guest discards its temporary file.
                raise PayloadTooLarge(f"upload exceeds the limit of {limit} bytes", limit=limit)
            yield chunk

    headers = {"content-type": "application/octet-stream"}
    if declared is not None:
        headers["content-length"] = declared
    try:
        res: dict[str, Any] = await node.call("PUT", f"/v1/sandboxes/{sandbox_id}/files", params={"path": p},
                                              content=body(), headers=headers, timeout=3600)
    except Exception:
        if too_large:
            raise PayloadTooLarge(f"upload exceeds the limit of {limit} bytes", limit=limit) from None
        raise
    return res


@router.get("/list")
async def list_dir(sandbox_id: str, path: PathQ, who: Auth, st: St,
                   depth: Annotated[int, Query(ge=1, le=32)] = 1) -> dict[str, Any]:
    _, node = await running_sandbox(st, sandbox_id, who.tenant, read_only=who.read_only)
    res: dict[str, Any] = await node.call("GET", f"/v1/sandboxes/{sandbox_id}/files/list",
                                          params={"path": paths.normalize(path), "depth": depth})
    return res


@router.get("/stat")
async def stat(sandbox_id: str, path: PathQ, who: Auth, st: St) -> dict[str, Any]:
    _, node = await running_sandbox(st, sandbox_id, who.tenant, read_only=who.read_only)
    res: dict[str, Any] = await node.call("GET", f"/v1/sandboxes/{sandbox_id}/files/stat",
                                          params={"path": paths.normalize(path)})
    return res


@router.post("/mkdir")
async def mkdir(sandbox_id: str, body: PathBody, who: Auth, st: St) -> dict[str, Any]:
    who.require_write()
    _, node = await running_sandbox(st, sandbox_id, who.tenant)
    res: dict[str, Any] = await node.call("POST", f"/v1/sandboxes/{sandbox_id}/files/mkdir",
                                          json_body={"path": paths.normalize(body.path)})
    return res


@router.post("/move")
async def move(sandbox_id: str, body: MoveBody, who: Auth, st: St) -> dict[str, Any]:
    who.require_write()
    _, node = await running_sandbox(st, sandbox_id, who.tenant)
    res: dict[str, Any] = await node.call(
        "POST", f"/v1/sandboxes/{sandbox_id}/files/move",
        json_body={"src": paths.normalize(body.src), "dst": paths.normalize(body.dst)},
    )
    return res


@router.delete("", status_code=204)
async def remove(sandbox_id: str, path: PathQ, who: Auth, st: St, recursive: bool = False) -> Response:
    who.require_write()
    _, node = await running_sandbox(st, sandbox_id, who.tenant)
    await node.call("DELETE", f"/v1/sandboxes/{sandbox_id}/files",
                    params={"path": paths.normalize(path), "recursive": str(recursive).lower()})
    return Response(status_code=204)
