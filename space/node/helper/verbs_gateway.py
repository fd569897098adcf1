"""Privileged gateway verbs: the helper starts, watches and stops the node's egress gateway, which
it runs as its own unprivileged user (:mod:`space.node.network.gateway`); the agent talks to the running
gateway through its control socket only."""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from typing import Any

import structlog

from space.errors import Conflict
from space.node.helper.verbs import Call, HelperContext, verb
from space.node.helper.verbs_net import NodeNet
from space.node.network.gateway import GatewayProcess

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class NoArgs:
    pass


def _process(ctx: HelperContext) -> GatewayProcess:
    cfg = ctx.gateway
    if cfg is None:
        raise Conflict("this node runs no egress gateway")
    slot = NodeNet(ctx).saved_slot()  # none: the network was never set up (only stop makes sense)
    address = NodeNet.gateway_ip(slot) if slot is not None else "0.0.0.0"
    proxy, transparent, dns = ctx.gateway_ports
    return GatewayProcess(ctx.data_dir / "gateway", cfg.control, address=address,
                          proxy_port=proxy, transparent_port=transparent, dns_port=dns, ca_dir=cfg.ca_dir,
                          hosts_file=cfg.hosts_file, upstream_ca=cfg.upstream_ca, upstream_dns=cfg.upstream_dns,
                          sandbox_networks=(str(ctx.sandbox_network),), private_ceiling=cfg.private_ceiling,
                          user=cfg.user,
                          control_group=cfg.control_group)


@verb("gateway.ensure", NoArgs, cap=60)
async def gateway_ensure(ctx: HelperContext, _: NoArgs, call: Call) -> dict[str, Any]:
    """The gateway runs (adopted, or started) and answers on its control socket."""
    p = _process(ctx)
    if p.address == "0.0.0.0":
        raise Conflict("the node's network is not set up (net.setup first)")
    try:
        await p.ensure()
    finally:
        await p.client.close()
    _admit_agent(ctx)
    return {"pid": p.pid}


def _admit_agent(ctx: HelperContext) -> None:
    """The control socket belongs to the agent's group: an adopted gateway may have been started for
    an agent that ran as root (before an upgrade), whose group it got."""
    cfg = ctx.gateway
    if cfg is None or cfg.control_group is None:
        return
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(cfg.control)
        if stat.S_ISSOCK(st.st_mode) and st.st_gid != cfg.control_group:
            os.lchown(cfg.control, -1, cfg.control_group)
            log.info("gateway.control_regrouped", group=cfg.control_group)


@verb("gateway.alive", NoArgs, cap=10, audit=False)
async def gateway_alive(ctx: HelperContext, _: NoArgs, call: Call) -> dict[str, Any]:
    return {"alive": _process(ctx).alive()}


@verb("gateway.stop", NoArgs, cap=30)
async def gateway_stop(ctx: HelperContext, _: NoArgs, call: Call) -> dict[str, Any]:
    await _process(ctx).stop()
    return {}
