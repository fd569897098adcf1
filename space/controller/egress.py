"""What a node's gateway must know about a sandbox, computed by the control plane: the tenant, the
effective egress policy (the sandbox's own, else its tenant's default) and its resolved secrets.

Nodes get this with every call that puts a sandbox on them (create, warm claim, fork, restore) and
again whenever it changes (a policy set, a secret rotated, an agent that lost its secrets in a
restart). Secret values travel only here: control plane → node agent → gateway memory.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import structlog

from space.gateway.policy import effective
from space.store import Sandbox
from space.store.repo import Store

if TYPE_CHECKING:
    from space.credentials.manager import CredentialManager

log = structlog.get_logger(__name__)

#: Tenant defaults are read at most this often per tenant (a change applies to new sandboxes).
TENANT_DEFAULT_TTL = 1.0

_tenant_defaults: dict[str, tuple[float, dict[str, Any]]] = {}


async def tenant_default(store: Store, tenant: str) -> dict[str, Any]:
    hit = _tenant_defaults.get(tenant)
    now = time.monotonic()
    if hit is not None and hit[0] > now:
        return hit[1]
    doc = await store.tenant_egress(tenant)
    _tenant_defaults[tenant] = (now + TENANT_DEFAULT_TTL, doc)
    return doc


def forget_tenant_default(tenant: str) -> None:
    _tenant_defaults.pop(tenant, None)


async def egress_config(store: Store, credentials: CredentialManager | None, sb: Sandbox, *,
                        with_secrets: bool = True) -> dict[str, Any]:
    """The node's ``EgressConfig`` for ``sb`` (its secrets resolved, and audited, when asked)."""
    policy = effective(sb.egress, await tenant_default(store, sb.tenant))
    secrets: list[dict[str, Any]] = []
    if with_secrets and sb.secrets and credentials is not None:
        secrets = [s.to_wire() for s in await credentials.resolve(sb)]
    return {"tenant": sb.tenant, "policy": policy, "secrets": secrets}
