"""What a node's gateway must know about a sandbox, computed by the control plane: the tenant, the
sandbox's own egress policy, its tenant's default policy (a layer under it: both must allow), the
tenant's ceiling (the private ranges the operator opened to it; None: the node's own) and its
resolved secrets.

Nodes get this with every call that puts a sandbox on them (create, warm claim, fork, restore) and
again whenever it changes (a policy set, a secret rotated, an agent that lost its secrets in a
restart). The gateway checks all of it again (:mod:`space.egress_policy`): the node's own ceiling
and its fence bound whatever arrives here. Secret values travel only here: control plane → node
agent → gateway memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from space.controller.fresh import FreshPerOwner
from space.store import Sandbox
from space.store.repo import Store

if TYPE_CHECKING:
    from space.credentials.manager import CredentialManager

log = structlog.get_logger(__name__)

#: Tenant defaults are at most this old when used (a change applies to new placements); the
#: tenants used lately are read again in the background (:class:`space.controller.fresh.Fresh`).
TENANT_DEFAULT_TTL = 1.0

_tenant_limits: FreshPerOwner[Store, str, tuple[dict[str, Any], list[str] | None]] = FreshPerOwner(
    "tenant_egress_limits", Store.tenant_egress_limits, ttl=TENANT_DEFAULT_TTL)


async def tenant_limits(store: Store, tenant: str) -> tuple[dict[str, Any], list[str] | None]:
    """The tenant's default egress policy and its ceiling (None: the deployment's)."""
    return await _tenant_limits.get(store, tenant)


async def tenant_default(store: Store, tenant: str) -> dict[str, Any]:
    return (await tenant_limits(store, tenant))[0]


def forget_tenant_default(tenant: str) -> None:
    _tenant_limits.forget(tenant)


async def egress_config(store: Store, credentials: CredentialManager | None, sb: Sandbox, *,
                        with_secrets: bool = True) -> dict[str, Any]:
    """The node's ``EgressConfig`` for ``sb`` (its secrets resolved, and audited, when asked)."""
    tenant_doc, ceiling = await tenant_limits(store, sb.tenant)
    secrets: list[dict[str, Any]] = []
    if with_secrets and sb.secrets and credentials is not None:
        secrets = [s.to_wire() for s in await credentials.resolve(sb)]
    return {"tenant": sb.tenant, "policy": dict(sb.egress or {}), "tenant_policy": tenant_doc, "ceiling": ceiling,
            "secrets": secrets}
