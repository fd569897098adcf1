"""/v1/templates: list, get, build."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from space import ids
from space.api import views
from space.api.auth import Principal, principal
from space.api.state import AppState, app_state
from space.errors import NotFound
from space.store import Operation

router = APIRouter(prefix="/v1/templates")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]


class BuildBody(BaseModel):
    force: bool = False


@router.get("")
async def list_templates(who: Auth, st: St) -> dict[str, Any]:
    return {"templates": [views.template(t) for t in await st.store.list_templates()]}


@router.get("/{name}")
async def get_template(name: str, who: Auth, st: St) -> dict[str, Any]:
    return views.template(await st.store.get_template(name))


@router.post("/{name}/build", status_code=202)
async def build_template(name: str, who: Auth, st: St, body: BuildBody | None = None) -> JSONResponse:
    who.require_admin()
    spec = st.controller.template_specs.get(name)
    if spec is None:
        try:
            spec = (await st.store.get_template(name)).spec
        except NotFound:
            raise NotFound(f"no template named {name!r} and no spec to build it from") from None
    op, tmpl = await queue_build(st, name, spec, tenant=who.tenant, force=bool(body and body.force))
    return JSONResponse({"template": views.template(tmpl), "operation": views.operation(op)}, status_code=202)


async def queue_build(st: AppState, name: str, spec: dict[str, Any], *, tenant: str,
                      force: bool = False) -> tuple[Operation, Any]:
    """One build per template at a time: a build already under way is returned, not doubled."""
    running = await st.store.find_operations(target=name, kind="template.build", status=["pending", "running"])
    if running:
        return running[0], await st.store.get_template(name)
    try:
        cur = await st.store.get_template(name)
        if cur.status != "ready" or force:
            cur = await st.store.upsert_template(name, digest=cur.digest, status="building", spec=spec)
    except NotFound:
        cur = await st.store.upsert_template(name, digest="", status="building", spec=spec)
    op = Operation(id=ids.operation_id(), tenant=tenant, kind="template.build", target=name, status="pending",
                   request={"spec": spec, "force": force})
    op, _ = await st.store.create_operation(op)
    st.controller.wake()
    return op, cur
