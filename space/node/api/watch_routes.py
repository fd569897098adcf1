"""Directory watchers on the node API: thin routes over the guest daemon's ``watch.*`` requests.

A watcher's state (its inotify watches and the events nobody polled yet) lives in the guest, so any
control-plane replica can poll it; the guest drops a watcher nobody polled for ten minutes. This is
what E2B's CreateWatcher / GetWatcherEvents / RemoveWatcher (and, polled, its watch stream) sit on.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel

from space import paths
from space.node.sandboxes.manager import SandboxManager

#: Events one poll returns at most (the guest buffers up to 10,000 per watcher).
MAX_POLL = 10_000


class WatchRequest(BaseModel):
    path: str
    recursive: bool = False
    #: Attach each event's file entry (as ``GET .../files/stat`` answers it; null once it is gone).
    entry: bool = False


def watch_router(manager: SandboxManager) -> APIRouter:
    """Routes under ``/sandboxes/{id}/watchers``; the caller mounts them under ``/v1`` with its auth."""
    r = APIRouter()

    @r.post("/sandboxes/{sandbox_id}/watchers", status_code=201)
    async def create_watcher(sandbox_id: str, body: WatchRequest) -> dict[str, Any]:
        conn = await manager.guest(sandbox_id)
        res = await conn.request("watch.add", path=paths.normalize(body.path), recursive=body.recursive,
                                 entry=body.entry)
        return {"id": res["watcher"]}

    @r.get("/sandboxes/{sandbox_id}/watchers/{watcher_id}/events")
    async def watcher_events(sandbox_id: str, watcher_id: str,
                             limit: int = Query(MAX_POLL, ge=1, le=MAX_POLL, alias="max")) -> dict[str, Any]:
        """The events since the last poll (drained), ``overflowed`` if some were lost in between."""
        conn = await manager.guest(sandbox_id)
        res = await conn.request("watch.poll", watcher=watcher_id, max=limit)
        events, pending = res.get("events"), res.get("pending")  # the guest's word: checked
        return {"events": events if isinstance(events, list) else [], "overflowed": res.get("overflowed") is True,
                "pending": pending if type(pending) is int and pending >= 0 else 0}

    @r.delete("/sandboxes/{sandbox_id}/watchers/{watcher_id}", status_code=204)
    async def remove_watcher(sandbox_id: str, watcher_id: str) -> Response:
        conn = await manager.guest(sandbox_id)
        await conn.request("watch.remove", watcher=watcher_id)
        return Response(status_code=204)

    return r
