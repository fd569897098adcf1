"""/v1/sandboxes/{id}/policy: a sandbox's egress policy, read and changed while it runs; and the
checks every policy a tenant writes meets before it is stored (:func:`checked_policy`)."""

from __future__ import annotations

from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from space import egress_policy as rules
from space.api.auth import Principal, principal
from space.api.state import AppState, app_state
from space.controller.egress import egress_config, tenant_limits
from space.errors import InvalidState
from space.lifecycle import State
from space.store import Sandbox

log = structlog.get_logger("space.api.egress")

router = APIRouter(prefix="/v1")

Auth = Annotated[Principal, Depends(principal)]
St = Annotated[AppState, Depends(app_state)]

#: States in which the sandbox is on a node whose gateway must hear of a change at once; in the
#: others the next placement carries the new policy.
ON_NODE = (State.RUNNING, State.PAUSED)

class PolicyBody(BaseModel):
    allow: list[str] = Field(default_factory=list, max_length=rules.MAX_ENTRIES)
    deny: list[str] = Field(default_factory=list, max_length=rules.MAX_ENTRIES)
    default: str | None = Field(None, pattern="^(allow|deny)$")


def ceiling_for(st: AppState, tenant_ceiling: list[str] | None) -> tuple[rules.IPNetwork, ...]:
    """A tenant's ceiling: the operator's setting for it inside the deployment's (None: the
    deployment's own)."""
    if tenant_ceiling is None:
        return st.egress_ceiling
    return rules.narrow(rules.parse_ceiling(tenant_ceiling), st.egress_ceiling)


async def tenant_ceiling(st: AppState, tenant: str) -> tuple[rules.IPNetwork, ...]:
    return ceiling_for(st, (await tenant_limits(st.store, tenant))[1])


async def checked_policy(st: AppState, tenant: str, doc: dict[str, Any] | None) -> dict[str, Any]:
    """``doc`` normalized, or ``400 invalid_request`` naming a bad entry, or an allow CIDR that
    reaches only what no policy opens or private ranges outside the tenant's ceiling."""
    norm = rules.validate(doc)
    rules.check_reach(norm, await tenant_ceiling(st, tenant), st.sandbox_networks)
    return norm


def limits_view(docs: list[dict[str, Any]], ceiling: tuple[rules.IPNetwork, ...],
                sandbox_networks: tuple[rules.IPNetwork, ...]) -> dict[str, Any]:
    """What no policy of this sandbox opens, whatever it says (the gateway enforces it)."""
    clipped = [rules.reach_note(rule, verdict, ceiling)
               for doc in docs for rule, verdict in rules.reach_report(doc, ceiling, sandbox_networks)]
    return {
        "never": [f"{net} ({what})" for net, what in rules.NEVER]
                 + [f"{net} (sandbox networks)" for net in sandbox_networks] + ["the node's own addresses"],
        "private_ceiling": [str(n) for n in ceiling],
        "clipped": clipped,
    }


async def policy_view(st: AppState, sb: Sandbox) -> dict[str, Any]:
    tenant_doc, tenant_ceiling_raw = await tenant_limits(st.store, sb.tenant)
    own = dict(sb.egress or {})
    layers = [d for d in (tenant_doc, own) if d]
    ceiling = ceiling_for(st, tenant_ceiling_raw)
    return {
        "sandbox_id": sb.id,
        "policy": own,
        "tenant_policy": tenant_doc,
        # What the gateway enforces: the one policy there is, or both (each must allow).
        "effective": layers[0] if len(layers) == 1 else ({"all_of": layers} if layers else {}),
        "inherited": not own,
        "limits": limits_view(layers, ceiling, st.sandbox_networks),
        "secrets": list(sb.secrets or []),
    }


@router.get("/sandboxes/{sandbox_id}/policy")
async def get_policy(sandbox_id: str, who: Auth, st: St) -> dict[str, Any]:
    return await policy_view(st, await st.store.get_sandbox(sandbox_id, tenant=who.tenant))


@router.put("/sandboxes/{sandbox_id}/policy")
async def set_policy(sandbox_id: str, body: PolicyBody, who: Auth, st: St) -> dict[str, Any]:
    """Replace the sandbox's egress policy; a running sandbox's next connection obeys it."""
    who.require_write()
    sb = await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
    doc = await checked_policy(st, sb.tenant, body.model_dump(exclude_none=True))
    if sb.state in (State.TERMINATING, State.TERMINATED):
        raise InvalidState(f"sandbox {sandbox_id} is {sb.state}", state=str(sb.state), allowed=[])
    sb = await st.store.update_sandbox(sandbox_id, egress=doc)
    await push(st, sb, with_secrets=False)
    return await policy_view(st, sb)


async def push(st: AppState, sb: Sandbox, *, with_secrets: bool) -> None:
    """Send the sandbox's egress to its node's gateway, if it is on one now."""
    if sb.state not in ON_NODE or sb.node_id is None:
        return
    cfg = await egress_config(st.store, st.credentials, sb, with_secrets=with_secrets)
    if not with_secrets:
        cfg["secrets"] = None  # the node keeps the ones it holds
    node = await st.nodes.client(sb.node_id)
    await node.call("PUT", f"/v1/sandboxes/{sb.id}/egress", json_body=cfg, timeout=10)
    log.info("egress.pushed", sandbox=sb.id, node=sb.node_id, secrets=with_secrets)
