"""Privileged network verbs: the node's nftables table, the gateway address, per-sandbox
namespaces and veth pairs (the layout is described in :mod:`space.node.network.namespaces`).

Every name and address is computed here from the node's tag (derived from the data directory the
helper was started with) and its slot (``<data>/network.json``, written only here); a caller only
ever names a sandbox network by its index, so it cannot make the helper touch another node's or
the host's interfaces, namespaces or tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import pwd
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from space.egress_policy import SANDBOX_SLOT_PREFIX
from space.errors import Conflict, RuntimeFailure
from space.node.helper import privileged
from space.node.helper.verbs import Call, HelperContext, check, verb

log = structlog.get_logger(__name__)

#: A node's slot is a /20 of the sandbox network (HelperContext.sandbox_network; a /12 holds 256
#: nodes per host), with 1023 sandboxes.
SLOT_PREFIX = SANDBOX_SLOT_PREFIX
MAX_INDEX = (1 << (32 - SLOT_PREFIX)) // 4 - 1
NETNS_DIR = Path("/var/run/netns")


def node_tag(data_dir: Path) -> str:
    return hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:4]


def netns_names() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


class NodeNet:
    """This node's names, from the helper's fixed context."""

    def __init__(self, ctx: HelperContext) -> None:
        self.tag = node_tag(ctx.data_dir)
        self.table = f"space_{self.tag}"
        self.if_prefix = f"sv{self.tag}"
        self.ns_prefix = f"space-{self.tag}-"
        self.proxy, self.transparent, self.dns = ctx.gateway_ports
        self.state_file = ctx.data_dir / "network.json"
        self.sandbox_network = ctx.sandbox_network

    def saved_slot(self) -> ipaddress.IPv4Network | None:
        try:
            return ipaddress.IPv4Network(json.loads(self.state_file.read_text())["slot"])
        except (FileNotFoundError, KeyError, ValueError):
            return None

    def slot(self) -> ipaddress.IPv4Network:
        slot = self.saved_slot()
        if slot is None:
            raise Conflict("the node's network is not set up (net.setup first)")
        return slot

    @staticmethod
    def gateway_ip(slot: ipaddress.IPv4Network) -> str:
        return str(slot.network_address + 1)

    def sandbox(self, index: int, slot: ipaddress.IPv4Network | None = None) -> dict[str, Any]:
        base = (slot or self.slot()).network_address + 4 * index
        return {"index": index, "netns": f"{self.ns_prefix}{index}", "host_if": f"{self.if_prefix}{index}",
                "host_ip": str(base + 1), "sandbox_ip": str(base + 2)}

    def ruleset(self, gw: str, gateway_uid: int | None = None) -> str:
        t, sv = self.table, f'"{self.if_prefix}*"'
        # `table ...; delete table ...; table ... {}`: replaced atomically, elements re-added after.
        # DNS to any address (the sandbox's resolver is the gateway address, port 53) goes to the
        # gateway's DNS port, which may be unprivileged: conntrack restores port 53 on the replies.
        # Connections the host opens to a sandbox (the node's port proxy) get their replies: a
        # packet in conntrack's *reply* direction of an entry whose first packet the host sent.
        # A sandbox cannot forge that: its own first packet (a SYN, or a bare ACK picked up
        # mid-stream) makes an entry whose original direction is the sandbox's, and the direction
        # is conntrack's record, not anything in the packet. Its new connections still meet the
        # rules below (only the gateway's ports).
        # The gateway's own user never opens a connection to a sandbox address (of this node or
        # another on the host): the gateway refuses it already (space.egress_policy's fence); this
        # holds even if it did not, since the replies would be accepted as those of a host-opened
        # connection. Only when the gateway has a user of its own (the port proxy's must pass).
        output = "" if gateway_uid is None else f"""
  chain output {{
    type filter hook output priority filter - 10; policy accept;
    meta skuid {gateway_uid} ip daddr {self.sandbox_network} ct state new meta l4proto tcp reject with tcp reset
    meta skuid {gateway_uid} ip daddr {self.sandbox_network} ct state new drop
  }}"""
        return f"""
table inet {t}
delete table inet {t}
table inet {t} {{
  set sandbox_src {{ type ifname . ipv4_addr; }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname {sv} udp dport 53 dnat ip to {gw}:{self.dns}
    iifname {sv} tcp dport 53 dnat ip to {gw}:{self.dns}
    iifname {sv} ip daddr != {gw} meta l4proto tcp dnat ip to {gw}:{self.transparent}
  }}
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname {sv} meta nfproto ipv6 drop
    iifname {sv} iifname . ip saddr != @sandbox_src drop
    iifname {sv} ct direction reply ct state established,related accept
    iifname {sv} ip daddr {gw} tcp dport {{ {self.proxy}, {self.transparent}, {self.dns} }} accept
    iifname {sv} ip daddr {gw} udp dport {self.dns} accept
    iifname {sv} meta l4proto tcp reject with tcp reset
    iifname {sv} reject with icmpx admin-prohibited
    ip daddr {gw} iifname "lo" accept
    ip daddr {gw} drop
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname {sv} drop
    oifname {sv} drop
  }}{output}
}}
"""


@dataclass(frozen=True)
class NoArgs:
    pass


def _index_ok(v: int) -> bool:
    return 1 <= v <= MAX_INDEX


@dataclass(frozen=True)
class IndexArgs:
    index: int = field(metadata=check(_index_ok, f"an index in 1..{MAX_INDEX}"))


@dataclass(frozen=True)
class IndexesArgs:
    indexes: list[int] = field(metadata=check(_index_ok, f"indexes in 1..{MAX_INDEX}"))


async def _routed_networks() -> list[ipaddress.IPv4Network]:
    res = await privileged.run("ip", "-4", "-o", "addr", "show")
    nets = []
    for line in res.text.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.IPv4Interface(parts[parts.index("inet") + 1]).network)
    return nets


async def _choose_slot(n: NodeNet) -> ipaddress.IPv4Network:
    saved = n.saved_slot()
    if saved is not None and saved.subnet_of(n.sandbox_network):
        return saved
    if saved is not None and any(name.startswith(n.ns_prefix) for name in netns_names()):
        raise Conflict(f"this node's sandboxes use {saved}, outside the sandbox network {n.sandbox_network}: "
                       "drain the node before changing it")
    taken = await _routed_networks()
    slots: list[ipaddress.IPv4Network] = list(n.sandbox_network.subnets(new_prefix=SLOT_PREFIX))
    start = int(n.tag, 16) % len(slots)
    for k in range(len(slots)):
        slot = slots[(start + k) % len(slots)]
        if not any(slot.overlaps(net) for net in taken):
            tmp = n.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"slot": str(slot)}))
            os.replace(tmp, n.state_file)
            return slot
    raise RuntimeFailure(f"no free sandbox network in {n.sandbox_network} on this host")


def _describe(n: NodeNet, slot: ipaddress.IPv4Network) -> dict[str, Any]:
    return {"tag": n.tag, "slot": str(slot), "gateway_ip": n.gateway_ip(slot), "ns_prefix": n.ns_prefix,
            "ports": {"proxy": n.proxy, "transparent": n.transparent, "dns": n.dns}}


@verb("net.setup", NoArgs, cap=60)
async def net_setup(ctx: HelperContext, _: NoArgs, call: Call) -> dict[str, Any]:
    """Idempotent: the gateway address on loopback and the node's nftables table (replaced whole,
    so the caller re-admits its sandboxes with ``net.admit``)."""
    n = NodeNet(ctx)
    slot = await _choose_slot(n)
    gw = n.gateway_ip(slot)
    # On the loopback link: every kernel has it (this one has no dummy links), and a packet from a
    # sandbox's veth to a local address is delivered locally all the same.
    await privileged.run("ip", "addr", "replace", f"{gw}/32", "dev", "lo")
    await privileged.run("nft", "-f", "-", input=n.ruleset(gw, _gateway_uid(ctx)).encode())
    return _describe(n, slot)


def _gateway_uid(ctx: HelperContext) -> int | None:
    """The uid the node's gateway runs as, when it is a user of its own (not root, not the agent)."""
    name = ctx.gateway.user if ctx.gateway is not None else None
    if name is None:
        return None
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return None
    return None if uid in (0, ctx.agent_uid) else uid


@verb("net.describe", NoArgs, cap=10, audit=False)
async def net_describe(ctx: HelperContext, _: NoArgs, call: Call) -> dict[str, Any]:
    n = NodeNet(ctx)
    return _describe(n, n.slot())


@verb("net.admit", IndexesArgs, cap=60)
async def net_admit(ctx: HelperContext, args: IndexesArgs, call: Call) -> dict[str, Any]:
    """Let these sandbox networks' addresses in again (after ``net.setup`` replaced the table)."""
    n = NodeNet(ctx)
    if args.indexes:
        nets = [n.sandbox(i) for i in args.indexes]
        elements = ", ".join(f"{s['host_if']} . {s['sandbox_ip']}" for s in nets)
        await privileged.run("nft", "add", "element", "inet", n.table, "sandbox_src", f"{{ {elements} }}")
    return {}


async def _prepare(s: dict[str, Any]) -> None:
    await privileged.run("ip", "-n", s["netns"], "-batch", "-", input=(
        "link set eth0 addrgenmode none\n"
        f"addr replace {s['sandbox_ip']}/30 dev eth0\n"
        "link set eth0 up\n"
        "link set lo up\n"
        f"route replace default via {s['host_ip']} dev eth0\n").encode())


async def _remove(n: NodeNet, s: dict[str, Any]) -> None:
    # Deleting the namespace deletes eth0, and with it the host end of the pair.
    await privileged.run("ip", "netns", "del", s["netns"], check=False)
    await privileged.run("ip", "link", "del", s["host_if"], check=False)
    await privileged.run("nft", "delete", "element", "inet", n.table, "sandbox_src",
                         f"{{ {s['host_if']} . {s['sandbox_ip']} }}", check=False)


@verb("net.create", IndexArgs, cap=60)
async def net_create(ctx: HelperContext, args: IndexArgs, call: Call) -> dict[str, Any]:
    """The sandbox network ``index``: namespace, veth pair, addresses, anti-spoofing element.
    Idempotent: an existing namespace is kept as it is."""
    n = NodeNet(ctx)
    s = n.sandbox(args.index)
    if (NETNS_DIR / s["netns"]).exists():
        return s
    await privileged.run("ip", "netns", "add", s["netns"])
    try:
        await privileged.run("ip", "-batch", "-", input=(
            f"link add {s['host_if']} type veth peer name eth0 netns {s['netns']}\n"
            f"link set {s['host_if']} addrgenmode none\n"
            f"addr add {s['host_ip']}/30 dev {s['host_if']}\n"
            f"link set {s['host_if']} up\n").encode())
        await privileged.run("nft", "add", "element", "inet", n.table, "sandbox_src",
                             f"{{ {s['host_if']} . {s['sandbox_ip']} }}")
        await _prepare(s)
    except BaseException:
        await asyncio.shield(_remove(n, s))
        raise
    return s


@verb("net.prepare", IndexArgs, cap=60)
async def net_prepare(ctx: HelperContext, args: IndexArgs, call: Call) -> dict[str, Any]:
    """Address the namespace's ``eth0`` again: runsc strips the address from the link it takes."""
    s = NodeNet(ctx).sandbox(args.index)
    await _prepare(s)
    return s


@verb("net.remove", IndexArgs, cap=60)
async def net_remove(ctx: HelperContext, args: IndexArgs, call: Call) -> dict[str, Any]:
    """Idempotent: the sandbox network ``index`` is gone."""
    n = NodeNet(ctx)
    await _remove(n, n.sandbox(args.index))
    return {}


@verb("net.teardown", NoArgs, cap=120)
async def net_teardown(ctx: HelperContext, _: NoArgs, call: Call) -> dict[str, Any]:
    """Remove everything this node added to the host's network."""
    n = NodeNet(ctx)
    slot = n.saved_slot() or next(n.sandbox_network.subnets(new_prefix=SLOT_PREFIX))
    removed = []
    for name in netns_names():
        suffix = name.removeprefix(n.ns_prefix)
        if name.startswith(n.ns_prefix) and suffix.isdigit() and _index_ok(int(suffix)):
            await _remove(n, n.sandbox(int(suffix), slot))
            removed.append(name)
    await privileged.run("nft", "delete", "table", "inet", n.table, check=False)
    await privileged.run("ip", "addr", "del", f"{n.gateway_ip(slot)}/32", "dev", "lo", check=False)
    with contextlib.suppress(FileNotFoundError):
        n.state_file.unlink()
    return {"removed": removed}
