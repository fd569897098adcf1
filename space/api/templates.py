"""/v1/templates: list, get, build (from a stored spec or one sent with the request), save a sandbox
as a template, and the file blobs template specs refer to."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from space import ids
from space.api import views
from space.api.auth import Principal, principal
from space.api.fields import Bool
from space.api.openapi import RAW_BODY
from space.api.snapshots import live_snapshot
from space.api.state import AppState, app_state
from space.api.template_images import pin_image
from space.errors import (
    Conflict,
    InvalidRequest,
    InvalidState,
    NotFound,
    PayloadTooLarge,
    SpaceError,
    Unavailable,
    ValidationFailed,
)
from space.lifecycle import Action, require
from space.node.storage.pool import check_name
from space.node.templates import spec as template_spec
from space.node.templates.store import spec_digest, validate_spec
from space.objstore import ObjectStore
from space.store import Operation, new_snapshot
from space.store.templates import check_tag

router = APIRouter(prefix="/v1/templates")

#: Tags one request may give or take.
MAX_TAGS = 64

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]


class BuildBody(BaseModel):
    force: Bool = False
    #: A spec from a space-template.toml (template_spec.from_toml); without it, the stored one.
    spec: dict[str, Any] | None = None
    #: Tags the build's result gets (``name:tag`` names it from then on, until the tag moves).
    tags: list[str] = Field(default_factory=list, max_length=MAX_TAGS)


class SaveBody(BaseModel):
    name: str
    sandbox_id: str
    #: A ready snapshot of the sandbox; without it, a disk snapshot is taken first.
    snapshot: str | None = None


@router.get("")
async def list_templates(who: Auth, st: St) -> dict[str, Any]:
    return {"templates": [views.template(t) for t in await st.store.list_templates()]}


def _objects(st: AppState) -> ObjectStore:
    objects = st.controller.lifecycle.objects
    if objects is None:
        raise Unavailable("this deployment has no object store for template files")
    return objects


@router.get("/blobs/{sha256}")
async def get_blob(sha256: str, who: Auth, st: St) -> dict[str, Any]:
    """Whether a file blob is stored (so a client uploads only what is missing)."""
    size = await _objects(st).size(template_spec.blob_key(sha256))
    if size is None:
        raise NotFound(f"blob {sha256} is not stored", sha256=sha256)
    return {"sha256": sha256, "size_bytes": size}


@router.put("/blobs/{sha256}", openapi_extra=RAW_BODY)
async def put_blob(sha256: str, request: Request, who: Auth, st: St) -> dict[str, Any]:
    """Store a file of a template spec under its sha256 (checked); bounded by MAX_BLOB_BYTES."""
    who.require_operator()
    key = template_spec.blob_key(sha256)
    objects = _objects(st)
    limit = template_spec.MAX_BLOB_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"a template file is limited to {limit} bytes", limit=limit)
    size = await objects.size(key)
    if size is not None:
        return {"sha256": sha256, "size_bytes": size, "stored": False}
    # Spooled to a file first: only bytes that match their name reach the object store.
    too_large = PayloadTooLarge(f"a template file is limited to {limit} bytes", limit=limit)
    async with spooled(request, limit, too_large) as (tmp, digest, size):
        if digest != sha256:
            raise InvalidRequest(f"the body's sha256 is {digest}, not {sha256}", field="sha256")
        await objects.put_file(key, tmp)
    return {"sha256": sha256, "size_bytes": size, "stored": True}


@contextlib.asynccontextmanager
async def spooled(request: Request, limit: int, too_large: Exception) -> AsyncIterator[tuple[Path, str, int]]:
    """The request's body in a temporary file (removed after): (path, sha256 hex, size). More than
    ``limit`` bytes raise ``too_large``, as the body streams."""
    fd, tmp_name = tempfile.mkstemp(prefix="space-blob-")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                digest.update(chunk)
                f.write(chunk)
        yield tmp, digest.hexdigest(), size
    finally:
        with contextlib.suppress(OSError):
            await asyncio.to_thread(os.unlink, tmp)


@router.get("/{name}")
async def get_template(name: str, who: Auth, st: St) -> dict[str, Any]:
    return views.template(await st.store.get_template(name))


@router.get("/{name}/tags")
async def list_tags(name: str, who: Auth, st: St) -> dict[str, Any]:
    """The template's tags: each names one build (its digest); ``name:tag`` creates from it."""
    await st.store.get_template(name)  # 404 for an unknown template
    return {"tags": [views.template_tag(t) for t in await st.store.list_template_tags(name)]}


@router.post("/{name}/build", status_code=202)
async def build_template(name: str, who: Auth, st: St, body: BuildBody | None = None) -> JSONResponse:
    who.require_operator()
    spec: dict[str, Any] | None
    if body is not None and body.spec is not None:
        spec = await resolve_spec(st, name, body.spec)
    else:
        spec = st.controller.template_specs.get(name)
        if spec is None:
            try:
                spec = (await st.store.get_template(name)).spec
            except NotFound:
                raise NotFound(f"no template named {name!r} and no spec to build it from") from None
        if template_spec.is_saved(spec) and body is not None and body.force:
            raise InvalidRequest(f"template {name!r} was saved from a sandbox: it cannot be rebuilt")
    tags = [check_tag(t) for t in (body.tags if body is not None else [])]
    op, tmpl = await queue_build(st, name, spec, tenant=who.tenant, force=bool(body and body.force),
                                 request={"tags": tags} if tags else None)
    return JSONResponse({"template": views.template(tmpl), "operation": views.operation(op)}, status_code=202)


async def known_spec(st: AppState, name: str) -> dict[str, Any] | None:
    """The spec template ``name`` is (or is being) made from: the stored one, else the configured one."""
    with contextlib.suppress(NotFound):
        row = await st.store.get_template(name)
        if row.spec:
            return dict(row.spec)
    spec = st.controller.template_specs.get(name)
    return dict(spec) if spec is not None else None


async def resolve_spec(st: AppState, name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """A request spec as the nodes take it: named ``name``, its base template (if named) embedded
    with that template's current spec and digest, validated (422 naming the field)."""
    try:
        check_name(name, "template name")
    except SpaceError:
        raise ValidationFailed(f"invalid template name {name!r}", field="name") from None
    spec = {**raw, "name": name}
    if template_spec.is_image(spec):
        spec = await pin_image(st, spec)
    if template_spec.is_saved(spec):
        raise ValidationFailed("a saved template cannot be built: save one with POST /v1/templates",
                               field="from_snapshot")
    base = spec.get("base_template")
    if isinstance(base, str):
        if base == name:
            raise ValidationFailed("a template cannot derive from itself", field="base.template")
        base_spec = await known_spec(st, base)
        if base_spec is None:
            raise ValidationFailed(f"base template {base!r} does not exist", field="base.template")
        spec = template_spec.resolve_base(spec, base_spec, spec_digest(base_spec))
    return validate_spec(spec)


async def resolve_reference(st: AppState, ref: str) -> str:
    """The template a sandbox of ``ref`` starts from: ``name``, or ``name:tag`` when the tag names
    the template's current build (sandboxes start from a template's current build; a tag left on
    an earlier one is a 409 naming both digests). 404 for an unknown template or tag."""
    name, sep, tag = ref.partition(":")
    if not sep:
        return ref
    check_tag(tag)
    tagged = await st.store.get_template_tag(name, tag)
    current = await st.store.get_template(name)
    if tagged.digest != current.digest:
        raise Conflict(f"tag {tag!r} of template {name} names an earlier build ({tagged.digest[:16]}); sandboxes "
                       f"start from a template's current build ({current.digest[:16]} now): build that tag's "
                       "template again, or move the tag", template=name, tag=tag, digest=tagged.digest)
    return name


async def queue_build(st: AppState, name: str, spec: dict[str, Any], *, tenant: str,
                      force: bool = False, request: dict[str, Any] | None = None) -> tuple[Operation, Any]:
    """One build per template at a time: a build already under way is returned, not doubled.
    ``request``: more for the operation's request (what a caller finds it by)."""
    running = await st.store.find_operations(target=name, kind="template.build", status=["pending", "running"])
    if running:
        op = running[0]
        if any(op.request.get(k) != v for k, v in (request or {}).items()):
            # Its result would not carry what this one asks for (its tags, its E2B build id).
            raise Conflict(f"template {name} is being built (operation {op.id}); build again when it ends",
                           template=name, operation=op.id)
        return op, await st.store.get_template(name)
    try:
        cur = await st.store.get_template(name)
        if cur.status != "ready" or force:
            cur = await st.store.upsert_template(name, digest=cur.digest, status="building", spec=spec)
    except NotFound:
        cur = await st.store.upsert_template(name, digest="", status="building", spec=spec)
    op = Operation(id=ids.operation_id(), tenant=tenant, kind="template.build", target=name, status="pending",
                   request={"spec": spec, "force": force, **(request or {})})
    op, _ = await st.store.create_operation(op)
    st.controller.wake()
    return op, cur


@router.post("", status_code=202)
async def save_template(body: SaveBody, who: Auth, st: St) -> JSONResponse:
    """Save a sandbox (a snapshot of it) as template ``name``: operation ``template.save``."""
    # Templates are global (every tenant can create sandboxes of them): admins only.
    who.require_operator()
    check_name(body.name, "template name")
    if body.name in st.controller.template_specs:
        raise Conflict(f"template {body.name!r} is configured on this server (built from its spec); "
                       "save under another name", template=body.name)
    sb = await st.store.get_sandbox(body.sandbox_id, tenant=who.tenant)
    for kind in ("template.build", "template.save"):
        if await st.store.find_operations(target=body.name, kind=kind, status=["pending", "running"]):
            raise Conflict(f"template {body.name!r} is being built or saved already", template=body.name)
    op = Operation(id=ids.operation_id(), tenant=sb.tenant, kind="template.save", target=body.name,
                   status="pending", request={"sandbox_id": sb.id})
    if body.snapshot is not None:
        snap = await live_snapshot(st, body.snapshot, who.tenant)
        if snap.sandbox_id != sb.id:
            raise InvalidRequest(f"snapshot {snap.id} belongs to sandbox {snap.sandbox_id}, not {sb.id}")
        if snap.status != "ready":
            raise InvalidState(f"snapshot {snap.id} is {snap.status}", state=snap.status, allowed=["ready"])
        op.request["snapshot"] = snap.id
        op, _ = await st.store.create_operation(op)
    else:
        require(sb.state, Action.SNAPSHOT)
        op.request["take"] = True
        _, created, _ = await st.store.create_snapshot(new_snapshot(sb, "disk", "manual"), op)
        assert created is not None
        op = created
    try:
        cur = await st.store.get_template(body.name)
        tmpl = await st.store.upsert_template(body.name, digest=cur.digest, status="building", spec=cur.spec)
    except NotFound:
        tmpl = await st.store.upsert_template(body.name, digest="", status="building", spec={})
    st.controller.wake()
    return JSONResponse({"template": views.template(tmpl), "operation": views.operation(op)}, status_code=202)
