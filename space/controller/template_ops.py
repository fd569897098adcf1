"""Operation handlers for templates made from sandboxes: ``template.save``.

Idempotent like every handler: the snapshot is taken only while its row is not ready, and the
node's save is idempotent (the same snapshot under the same name is the same template).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import structlog

from space.errors import InvalidState, SpaceError
from space.store import Operation

if TYPE_CHECKING:
    from space.controller.controller import Controller

log = structlog.get_logger("space.controller.templates")

#: Saving publishes the template's whole stream to object storage.
LONG = 3600.0


class TemplateOps:
    def __init__(self, controller: Controller) -> None:
        self.ctl = controller
        self.store = controller.store
        self.nodes = controller.nodes

    def handlers(self) -> dict[str, Any]:
        return {"template.save": self.save}

    def failure_handlers(self) -> dict[str, Any]:
        return {"template.save": self.save_failed}

    async def save(self, op: Operation) -> dict[str, Any]:
        name = op.target
        sb = await self.store.get_sandbox(str(op.request["sandbox_id"]))
        snap = await self.store.get_snapshot(str(op.request["snapshot"]))
        if snap.status != "ready":
            await self.store.append_operation_logs(op.id, [f"taking a disk snapshot of sandbox {sb.id}"])
            snap = await self.ctl.lifecycle._take(sb, snap)
        if snap.node_id is None:
            raise InvalidState(f"snapshot {snap.id} is on no node (a suspended sandbox's snapshot cannot be "
                               "saved as a template yet)", state=snap.status, allowed=[])
        node = await self.nodes.client(snap.node_id)
        await self.store.append_operation_logs(
            op.id, [f"saving snapshot {snap.id} of sandbox {sb.id} as template {name} on {node.node_id} "
                    "and publishing it to object storage"])
        await self.store.set_operation_progress(op.id, {"message": f"saving template {name}"})
        res = await node.call("POST", "/v1/templates/save",
                              json_body={"name": name, "sandbox_id": sb.id, "snapshot": snap.id}, timeout=LONG)
        digest = str(res["digest"])
        await self.store.upsert_template(name, digest=digest, status="ready", spec=dict(res.get("spec") or {}),
                                         size_bytes=res.get("size_bytes"))
        await self.store.append_operation_logs(op.id, [f"template {name} ready: {digest}"])
        log.info("template.saved", template=name, digest=digest, sandbox=sb.id, snapshot=snap.id)
        return {"template": name, "digest": digest, "snapshot": snap.id}

    async def save_failed(self, op: Operation, exc: SpaceError) -> None:
        if op.request.get("take"):
            await self.ctl.lifecycle.snapshot_failed(op, exc)
        with contextlib.suppress(SpaceError):
            t = await self.store.get_template(op.target)
            await self.store.upsert_template(op.target, digest=t.digest, status="failed", spec=t.spec,
                                             error=exc.message)
