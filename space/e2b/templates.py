"""E2B's template build API on SPACE's templates: what ``Template.build``, ``Template.exists`` and
``Sandbox.create(<name>)`` call.

An E2B template is a SPACE template of the same name, and its tags SPACE's template tags (a tag
names the build, the digest, it was given to; ``name:tag`` creates from it while that build is the
template's current one). ``POST /v3/templates`` names the build (``buildID``; nothing stored, so any
replica answers the next call: the ``templateID`` it answers carries the build's tags,
``name:tag1,tag2``, and the SDK hands it back), ``POST /v2/templates/{id}/builds/{build}`` turns the
SDK's instructions into a SPACE template spec and starts a ``template.build`` operation recorded
under that build id (its result tagged), and ``GET /templates/{id}/builds/{build}/status`` reads
that operation and its log lines. ``/templates/tags`` assigns and removes tags,
``/templates/{id}/tags`` lists them. Templates are global in SPACE: building and tagging need an
admin key (403 otherwise).

The instructions, in order, become SPACE's spec:

- ``fromImage`` → ``image`` (pinned by digest, its config giving the defaults:
  :mod:`space.api.template_images`); E2B's own base image (``e2bdev/base``) and ``fromTemplate``
  → a template derived from a SPACE template;
- ``RUN cmd [user]`` → a ``run`` step, in the environment, working directory and user the
  ``ENV``, ``WORKDIR`` and ``USER`` before it set (as a Dockerfile's do); ``su`` runs it as a user
  other than root;
- ``COPY src dest [owner [mode]]`` → a ``run`` copy of the files the SDK uploaded for it
  (:mod:`space.e2b.template_files`), in its place among the ``RUN`` steps: a relative ``dest`` is
  under the ``WORKDIR`` before it (else the ``USER``'s home), files are owned by ``owner`` (else
  that user);
- the last ``ENV``s, ``WORKDIR`` and ``USER`` → the template's ``env``, ``workdir`` and ``user``;
- ``startCmd`` / ``readyCmd`` → ``start`` (``cmd``, ``ready.cmd``).

Not taken: templates' cpu and memory (SPACE sizes sandboxes, not templates: ignored). Credentials
sent with the build (``fromImageRegistry``) are refused: a private registry's login is the
operator's secret for its host (docs/api.md).
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any, Final

from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from space.api import templates as space_templates
from space.api.templates import _objects
from space.e2b import template_files
from space.e2b.control import Auth, E2BError, St
from space.e2b.edge import json_body
from space.errors import NotFound, SpaceError
from space.node.storage.pool import check_name
from space.node.templates.spec import in_context, with_instructions
from space.store.templates import check_tag

router = APIRouter()

#: E2B's own base image: its template is SPACE's ``base`` here.
E2B_BASE_IMAGES: Final = ("e2bdev/base", "e2bdev/base:latest", "docker.io/e2bdev/base")
#: Log entries a status answer carries at most (E2B's SDK expects pages and asks again).
LOG_PAGE: Final = 100
MAX_STEPS: Final = 256
#: E2B's "waiting" is a build named but not started; one started is "building" until it ends, even
#: before a controller has picked up its operation.
_STATUS: Final = {"pending": "building", "running": "building", "succeeded": "ready", "failed": "error",
                  "cancelled": "error"}


class BuildRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = Field(None, max_length=256)
    alias: str | None = Field(None, max_length=256)
    tags: list[str] | None = Field(None, max_length=64)


class Step(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: str = Field(..., max_length=16)
    args: list[Annotated[str, Field(max_length=65536)]] = Field(default_factory=list, max_length=512)
    files_hash: str | None = Field(None, alias="filesHash", max_length=128)
    force: bool | None = None


class BuildStart(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    from_image: str | None = Field(None, alias="fromImage", max_length=1024)
    from_template: str | None = Field(None, alias="fromTemplate", max_length=256)
    from_image_registry: dict[str, Any] | None = Field(None, alias="fromImageRegistry")
    force: bool = False
    steps: list[Step] = Field(default_factory=list, max_length=MAX_STEPS)
    start_cmd: str | None = Field(None, alias="startCmd", max_length=65536)
    ready_cmd: str | None = Field(None, alias="readyCmd", max_length=65536)


def template_name(given: str) -> str:
    """A ``name[:tag]`` as SPACE's template name (the tag dropped), or 400."""
    name = given.partition(":")[0]
    try:
        return check_name(name, "template name")
    except SpaceError:
        raise E2BError(400, f"invalid template name {given[:100]!r}: letters, digits, '.', '_' and '-'") from None


def tag_of(given: str, name: str) -> str:
    """A tag as E2B sends one, ``tag`` or ``name:tag`` (of template ``name``), or 400."""
    prefix, sep, tag = given.rpartition(":")
    if sep and prefix != name:
        raise E2BError(400, f"tag {given[:140]!r} does not name template {name}")
    try:
        return check_tag(tag)
    except SpaceError as exc:
        raise E2BError(400, exc.message) from None


def _build_tags(template_id: str) -> list[str]:
    """The tags a ``templateID`` that :func:`request_build` answered carries."""
    name, sep, tags = template_id.partition(":")
    return [tag_of(t, name) for t in tags.split(",")] if sep else []


@router.post("/v3/templates", status_code=202)
async def request_build(body: BuildRequest, who: Auth, st: St) -> Response:
    who.require_operator()  # templates are global: an admin's
    given = body.name or body.alias or ""
    name = template_name(given)
    tags = list(dict.fromkeys([tag_of(t, name) for t in ([given] if ":" in given else []) + list(body.tags or [])]))
    build_id = str(uuid.uuid4())  # E2B's SDKs parse build ids as UUIDs
    template_id = f"{name}:{','.join(tags)}" if tags else name
    return json_body({"templateID": template_id, "buildID": build_id, "public": True, "names": [name],
                      "tags": tags, "aliases": [name]}, 202)


@router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
async def start_build(template_id: str, build_id: str, body: BuildStart, who: Auth, st: St) -> Response:
    who.require_operator()
    name = template_name(template_id)
    tags = _build_tags(template_id)
    if name in st.controller.template_specs:
        raise E2BError(409, f"template {name} is configured on this server (built from its own spec): "
                            "build under another name")
    archives = {step.files_hash: await template_files.archive_of(_objects(st), step.files_hash, i)
                for i, step in enumerate(body.steps, 1) if step.type.upper() == "COPY" and step.files_hash}
    spec = spec_of(body, archives)
    try:
        spec = await space_templates.resolve_spec(st, name, spec)
    except SpaceError as exc:  # a bad spec is E2B's 400; a registry or node that fails keeps its status
        raise E2BError(400 if exc.status in (400, 422) else exc.status, f"template {name}: {exc.message}",
                       exc.code) from None
    await space_templates.queue_build(st, name, spec, tenant=who.tenant, force=body.force,
                                      request={"e2b_build": build_id, **({"tags": tags} if tags else {})})
    return Response(status_code=202)


def spec_of(body: BuildStart, archives: dict[str, str] | None = None) -> dict[str, Any]:
    """The SPACE template spec (request form) of an E2B build's instructions; ``archives``: the
    blob (sha256) uploaded for each COPY's files hash."""
    if body.from_image_registry:
        raise E2BError(400, "registry credentials in the build (fromImageRegistry) are not taken: SPACE pulls "
                            "with the operator's login for the registry, a secret of format basic naming its host")
    spec: dict[str, Any] = {}
    if body.from_image and body.from_image not in E2B_BASE_IMAGES:
        spec["image"] = body.from_image
    else:
        spec["base_template"] = template_name(body.from_template) if body.from_template else "base"
    env: dict[str, str] = {}
    workdir: str | None = None
    user: str | None = None
    run: list[str | dict[str, str]] = []
    for i, step in enumerate(body.steps):
        kind = step.type.upper()
        if kind == "ENV":
            if len(step.args) % 2:
                raise E2BError(400, f"step {i + 1}: ENV takes name and value pairs")
            env.update(zip(step.args[::2], step.args[1::2], strict=True))
        elif kind == "WORKDIR" and len(step.args) == 1:
            workdir = step.args[0]
        elif kind == "USER" and len(step.args) == 1:
            user = step.args[0]
        elif kind == "RUN" and 1 <= len(step.args) <= 2:
            as_user = step.args[1] if len(step.args) == 2 else user
            # envd's words for a user that does not exist (E2B's SDK users match on them)
            missing = (f"failed to run command {step.args[0][:200]!r}: command failed: unauthenticated: "
                       f"invalid username: {as_user[:64]!r}") if as_user else None
            run.append(in_context(step.args[0], env, workdir, as_user, home_default=True, missing_user=missing))
        elif kind == "COPY" and 2 <= len(step.args) <= 4:
            archive = (archives or {}).get(step.files_hash or "")
            if archive is None:
                raise E2BError(400, f"step {i + 1}: COPY {step.args[0][:200]!r} has no uploaded files")
            owner, mode = (*step.args[2:], "", "")[:2]
            run.append({"archive": archive, "src": step.args[0], "dest": step.args[1], "owner": owner,
                        "mode": mode, "workdir": workdir or "", "user": user or ""})
        else:
            raise E2BError(400, f"step {i + 1}: {step.type[:16]!r} with {len(step.args)} argument(s) is not an "
                                "instruction SPACE builds (RUN, COPY, ENV, WORKDIR, USER)")
    start = ({"cmd": body.start_cmd, **({"ready": {"cmd": body.ready_cmd}} if body.ready_cmd else {})}
             if body.start_cmd else None)
    return with_instructions(spec, run=run, env=env, workdir=workdir, user=user, start=start)


@router.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(template_id: str, build_id: str, who: Auth, st: St,
                       logs_offset: Annotated[int, Query(alias="logsOffset", ge=0)] = 0) -> Response:
    who.require_operator()  # a build's log is the operator's (its commands' output), as the build is
    name = template_name(template_id)
    ops = [op for op in await st.store.find_operations(target=name, kind="template.build")
           if (op.request or {}).get("e2b_build") == build_id]
    if not ops:
        raise E2BError(404, f"build {build_id[:64]} of template {name} not found")
    op = ops[-1]
    lines = await st.store.get_operation_logs(op.id, after=logs_offset, limit=LOG_PAGE)
    entries = [{"timestamp": _ts(ln.at), "level": "info", "message": ln.line} for ln in lines]
    out: dict[str, Any] = {"templateID": name, "buildID": build_id, "status": _STATUS.get(op.status, "building"),
                           "logEntries": entries, "logs": [e["message"] for e in entries]}
    if op.status in ("failed", "cancelled"):
        out["reason"] = {"message": op.error_message or f"the build {op.status}"}
    return json_body(out)


def _ts(t: dt.datetime | None) -> str:
    return (t or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


@router.get("/templates/aliases/{alias}")
async def alias(alias: str, who: Auth, st: St) -> Response:
    name = template_name(alias)
    try:
        t = await st.store.get_template(name)
    except NotFound:
        raise E2BError(404, f"template {name} not found") from None
    if t.status != "ready":
        raise E2BError(404, f"template {name} is {t.status}")
    return json_body({"templateID": name, "public": True})


# -- tags --------------------------------------------------------------------------------------


class AssignTags(BaseModel):
    model_config = ConfigDict(extra="ignore")
    target: str = Field(..., max_length=300)
    tags: list[Annotated[str, Field(max_length=300)]] = Field(..., min_length=1, max_length=space_templates.MAX_TAGS)


class RemoveTags(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(..., max_length=300)
    tags: list[Annotated[str, Field(max_length=300)]] = Field(..., min_length=1, max_length=space_templates.MAX_TAGS)


@router.post("/templates/tags", status_code=201)
async def assign_tags(body: AssignTags, who: Auth, st: St) -> Response:
    """Give the build ``target`` (``name:tag``, or ``name``: its current build) more tags."""
    who.require_operator()
    name = template_name(body.target)
    source = body.target.partition(":")[2] if ":" in body.target else None
    tags = list(dict.fromkeys(tag_of(t, name) for t in body.tags))
    if source is not None:
        tagged = await st.store.get_template_tag(name, tag_of(source, name))
        digest, build = tagged.digest, tagged.build_id
    else:
        t = await st.store.get_template(name)
        if t.status != "ready" and not t.digest:
            raise E2BError(404, f"template {name} has no build yet")
        digest, build = t.digest, await _build_of(st, name, t.digest)
    await st.store.tag_template(name, tags, digest=digest, build_id=build)
    return json_body({"buildID": build_uuid(build), "tags": tags}, 201)


async def _build_of(st: St, name: str, digest: str) -> str:
    """The id of the build that made ``digest`` of template ``name`` (E2B's, else the operation's)."""
    for op in reversed(await st.store.find_operations(target=name, kind="template.build", status=["succeeded"])):
        if (op.result or {}).get("digest") == digest:
            return str((op.request or {}).get("e2b_build") or op.id)
    return digest[:64]  # a template no operation here built (saved, or from before)


def build_uuid(build_id: str) -> str:
    """A build id as E2B's SDKs take one (a UUID): E2B's own as they are, SPACE's (an operation's
    id) as the UUID derived from it, the same every time."""
    try:
        return str(uuid.UUID(build_id))
    except ValueError:
        return str(uuid.uuid5(_BUILD_NAMESPACE, build_id))


_BUILD_NAMESPACE: Final = uuid.UUID("5d0c3c55-9b57-4ad4-93b4-2f1e0a39a6c1")


@router.delete("/templates/tags", status_code=204)
async def remove_tags(body: RemoveTags, who: Auth, st: St) -> Response:
    who.require_operator()
    name = template_name(body.name)
    tags = [tag_of(t, name) for t in body.tags]
    await st.store.get_template(name)  # 404 for an unknown template
    if not await st.store.untag_template(name, tags):
        raise E2BError(404, f"template {name} has none of the tags {', '.join(tags)[:300]}")
    return Response(status_code=204)


@router.get("/templates/{template_id}/tags")
async def list_tags(template_id: str, who: Auth, st: St) -> Response:
    name = template_name(template_id)
    await st.store.get_template(name)  # 404 for an unknown template
    return json_body([{"tag": t.tag, "buildID": build_uuid(t.build_id), "createdAt": _ts(t.created_at)}
                      for t in await st.store.list_template_tags(name)])
