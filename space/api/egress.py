"""/v1/sandboxes/{id}/policy: a sandbox's egress policy, read and changed while it runs."""

from __future__ import annotations

from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from space.api.auth import Principal, principal
from space.api.state import AppState, app_state
from space.controller.egress import egress_config, tenant_default
from space.errors import InvalidState
from space.gateway import policy as rules
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


async def policy_view(st: AppState, sb: Sandbox) -> dict[str, Any]:
    tenant_doc = await tenant_default(st.store, sb.tenant)
    return {
        "sandbox_id": sb.id,
        "policy": sb.egress or {},
        # What the gateway enforces: the sandbox's own policy, else its tenant's default.
        "effective": rules.effective(sb.egress, tenant_doc),
        "inherited": not sb.egress,
        "secrets": list(sb.secrets or []),
    }


@router.get("/sandboxes/{sandbox_id}/policy")
async def get_policy(sandbox_id: str, who: Auth, st: St) -> dict[str, Any]:
    return await policy_view(st, await st.store.get_sandbox(sandbox_id, tenant=who.tenant))


@router.put("/sandboxes/{sandbox_id}/policy")
async def set_policy(sandbox_id: str, body: PolicyBody, who: Auth, st: St) -> dict[str, Any]:
    """Replace the sandbox's egress policy; a running sandbox's next connection obeys it."""
    who.require_write()
    doc = rules.validate(body.model_dump(exclude_none=True))
    sb = await st.store.get_sandbox(sandbox_id, tenant=who.tenant)
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
