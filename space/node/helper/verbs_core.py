"""Verbs about the helper itself and small root-owned writes that belong to no other group."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

from space.node.helper import verbs
from space.node.helper.verbs import Call, HelperContext, check, is_id, verb
from space.node.helper.verbs_net import NodeNet
from space.node.helper.verbs_runtime import open_dir
from space.node.network import rootfs as rootfs_net

#: A PEM certificate bundle is public, but it is written into a sandbox's root: keep it bounded.
MAX_CA_PEM = 64 * 1024


@dataclass(frozen=True)
class NoArgs:
    pass


@verb("helper.ping", NoArgs, cap=5, audit=False)
async def helper_ping(ctx: HelperContext, _: NoArgs, call: Call) -> dict[str, Any]:
    """Readiness, and which verbs this helper serves."""
    return {"pid": os.getpid(), "verbs": sorted(verbs.REGISTRY)}


@dataclass(frozen=True)
class ConfigureNetArgs:
    sandbox: str = field(metadata=check(is_id, "a sandbox id"))
    ca_pem: str | None = field(default=None, metadata=check(
        lambda v: len(v) <= MAX_CA_PEM and v.startswith("-----BEGIN CERTIFICATE-----"), "a PEM certificate"))


@verb("rootfs.configure_net", ConfigureNetArgs, cap=30)
async def rootfs_configure_net(ctx: HelperContext, a: ConfigureNetArgs, call: Call) -> dict[str, Any]:
    """The sandbox's resolver (the node's gateway) and the egress CA, written into its root before
    a cold boot (files there belong to the guest's root user, so only root may write them)."""
    gateway_ip = NodeNet.gateway_ip(NodeNet(ctx).slot())
    ca = a.ca_pem.encode() if a.ca_pem is not None else None
    # The root checked here is the one written: by descriptor (the agent owns sandboxes/<id>/).
    rootfs = open_dir(ctx.pool, "sandboxes", a.sandbox, "rootfs", subvolume=True, flags=os.O_RDONLY)
    try:
        await asyncio.to_thread(rootfs_net.configure, rootfs, gateway_ip, ca)
    finally:
        os.close(rootfs)
    return {}
