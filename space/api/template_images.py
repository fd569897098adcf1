"""A template spec that names a container image, made ready to digest: the reference pinned to the
digest of the image's linux/amd64 manifest, and the sandbox defaults the spec does not set taken
from the image's config, as a derived template takes its base's (``space.node.templates.spec``).

A node answers what the reference names now (its root helper asks the registry, one of the
operator's, with the operator's login for it if there is one: :mod:`space.controller.registry_auth`):
the control plane itself reaches no registry.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import PurePosixPath
from typing import Any

from space.api.state import AppState
from space.controller.registry_auth import registry_logins
from space.errors import SpaceError, Unavailable, ValidationFailed
from space.node.templates.spec import _USER, canonical_reference, check_build_fields, is_reference

#: What ``[base] image`` may be before it is pinned.
MAX_REFERENCE = 1024


async def pin_image(st: AppState, spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` (an image spec as a request sends it) with its image pinned and its defaults filled."""
    ref = spec.get("image")
    if isinstance(ref, str):
        ref = canonical_reference(ref)  # Docker Hub's short names in full
    if not isinstance(ref, str) or len(ref) > MAX_REFERENCE or not is_reference(ref):
        raise ValidationFailed("template spec field 'image' must be registry/repository:tag or "
                               "registry/repository@sha256:<64 hex>", field="image")
    nodes = await st.nodes.placeable_rows()
    if not nodes:
        raise Unavailable("no ready node to ask the registry what the image is")
    node = await st.nodes.client(nodes[0].id)
    logins = await registry_logins(st.credentials, st.operator_tenant, {"image": ref},
                                   target=f"template:{spec.get('name', '')}")
    try:
        found = await node.call("POST", "/v1/images/inspect", json_body={"image": ref, "auth": logins}, timeout=150)
    except SpaceError as exc:
        raise type(exc)(f"image {ref}: {exc.message}", **exc.details) from None
    return with_image_defaults(spec, str(found["image"]), dict(found.get("config") or {}))


def with_image_defaults(spec: dict[str, Any], pinned: str, config: dict[str, Any]) -> dict[str, Any]:
    """The spec with ``image`` = ``pinned`` and, where the spec is silent, the image config's user,
    env (the spec's own names win), working directory and start command (entrypoint then cmd)."""
    out = copy.deepcopy(spec)
    out["image"] = pinned
    if not out.get("user"):
        user = str(config.get("user") or "").partition(":")[0]
        if user and not _USER.fullmatch(user):
            raise ValidationFailed(f"the image runs as {user!r}, not a user name SPACE can name: set the "
                                   "template's user to one of the image's users", field="user")
        out["user"] = user or "root"
    env = {}
    for entry in config.get("env") or []:
        name, _, value = str(entry).partition("=")
        env[name] = value
    env.update(out.get("env") or {})
    if env:
        out["env"] = env
    workdir = str(config.get("workdir") or "")
    if not out.get("workdir") and workdir and workdir != "/":
        normal = str(PurePosixPath(workdir))
        if normal.startswith("/"):
            out["workdir"] = normal
    command = [str(a) for a in [*(config.get("entrypoint") or []), *(config.get("cmd") or [])]]
    if not out.get("start") and command:
        out["start"] = {"cmd": shlex.join(command)}
    try:
        check_build_fields(out)
    except ValidationFailed as exc:
        raise ValidationFailed(f"the image's config does not make a template: {exc.message}",
                               **exc.details) from None
    return out
