"""The logins template builds pull container images with: for every registry a spec's images come
from (its own and its bases'), the operator's registry secret for that host, if any
(:meth:`space.credentials.manager.CredentialManager.registry_login`).

They go to the node with the one request that needs them (an image's inspection, a template's
materialization), and from the node agent to its root helper on a descriptor: never into a spec,
a template, a log or a file of the node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from space.node.templates.spec import REFERENCE_RE

if TYPE_CHECKING:
    from space.credentials.manager import CredentialManager

Logins = dict[str, dict[str, str]]


def image_registries(spec: dict[str, Any]) -> list[str]:
    """The registries (``host[:port]``) of the images ``spec`` is built from, its bases' included."""
    found: list[str] = []
    current: Any = spec
    while isinstance(current, dict):
        image = current.get("image")
        m = REFERENCE_RE.fullmatch(image) if isinstance(image, str) else None
        if m is not None and m["registry"] not in found:
            found.append(m["registry"])
        base = current.get("base_template")
        current = base.get("spec") if isinstance(base, dict) else None
    return found


async def registry_logins(credentials: CredentialManager | None, tenant: str, spec: dict[str, Any], *,
                          target: str) -> Logins:
    """``{registry: {"username", "password"}}`` for the registries of ``spec`` that have a login."""
    out: Logins = {}
    if credentials is None:
        return out
    for registry in image_registries(spec):
        login = await credentials.registry_login(tenant, registry, target=target)
        if login is not None:
            out[registry] = {"username": login[0], "password": login[1]}
    return out
