"""Per-sandbox network isolation on a node: one network namespace per sandbox, a veth whose other
end is the sandbox's only way out, and an nftables table that lets it reach the node's egress
gateway and nothing else.

Layout, per node (``tag`` is 4 hex digits derived from the node's data directory, so that several
node agents can share one host without colliding):

- the gateway address ``gateway_ip`` (the first address of the node's /20) on the loopback link;
  the gateway process listens there (proxy, transparent port, DNS);
- per sandbox, index ``i`` ≥ 1: network namespace ``space-<tag>-<i>`` holding ``eth0`` with
  ``sandbox_ip``/30 and a default route via ``host_ip``, the other end ``sv<tag><i>`` on the host;
- nftables table ``inet space_<tag>``:
  * every TCP connection a sandbox opens to anywhere but the gateway is redirected (DNAT) to the
    gateway's transparent port, and every DNS query to the gateway's DNS: nothing leaves unseen;
  * a packet whose source address is not the one given to its interface is dropped (no spoofing:
    the gateway tells sandboxes apart by source address);
  * from a sandbox interface the host accepts only the gateway's ports and rejects the rest (TCP
    with a reset, so a client fails at once instead of waiting out a timeout);
  * nothing is forwarded to or from a sandbox interface: not to another sandbox, the host's
    networks, private ranges or metadata addresses. IPv6 from sandboxes is dropped.

gVisor runs the sandbox's own network stack (netstack) on ``eth0``: the guest's packets never meet
the host kernel's socket layer. runsc removes the address from the interface it takes over, so
:meth:`Network.prepare` puts it back before every start or restore (RUNTIME_NOTES), and a restore
takes the addressing of the namespace it lands in, so a fork or a move to another node simply gets
the new sandbox's address.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import ipaddress
import json
import os
from pathlib import Path
from typing import Any

import structlog

from space.errors import RuntimeFailure
from space.node import privileged

log = structlog.get_logger(__name__)

#: Node slots are /20s of this range: 256 nodes per host, 1023 sandboxes per node.
SLOT_RANGE = ipaddress.IPv4Network("10.208.0.0/12")
SLOT_PREFIX = 20
MAX_INDEX = (1 << (32 - SLOT_PREFIX)) // 4 - 1
NET_FILE = "net.json"
NETNS_DIR = Path("/var/run/netns")


@dataclasses.dataclass(frozen=True)
class GatewayPorts:
    proxy: int = 3128
    transparent: int = 3129
    dns: int = 53


@dataclasses.dataclass(frozen=True)
class SandboxNet:
    index: int
    netns: str
    host_if: str
    host_ip: str
    sandbox_ip: str

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SandboxNet:
        return cls(**{f.name: doc[f.name] for f in dataclasses.fields(cls)})


def _netns_names() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def node_tag(data_dir: Path) -> str:
    return hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:4]


class Network:
    """The node's side of sandbox networking. Every host change goes through :mod:`privileged`."""

    def __init__(self, data_dir: Path, *, ports: GatewayPorts | None = None) -> None:
        self.data_dir = data_dir
        self.tag = node_tag(data_dir)
        self.ports = ports or GatewayPorts()
        self.table = f"space_{self.tag}"
        self.if_prefix = f"sv{self.tag}"
        self.ns_prefix = f"space-{self.tag}-"
        self._state_file = data_dir / "network.json"
        self.slot: ipaddress.IPv4Network | None = None
        self._used: set[int] = set()

    # -- node-wide ------------------------------------------------------------------------------

    @property
    def gateway_ip(self) -> str:
        assert self.slot is not None, "Network.setup() first"
        return str(self.slot.network_address + 1)

    async def setup(self) -> None:
        """Idempotent: the gateway address on loopback, the nftables table, and the
        kernel settings sandbox interfaces rely on."""
        self.slot = await self._choose_slot()
        gw = self.gateway_ip
        # On the loopback link: every kernel has it (this one has no dummy links), and a packet
        # from a sandbox's veth to a local address is delivered locally all the same.
        await privileged.run("ip", "addr", "replace", f"{gw}/32", "dev", "lo")
        await privileged.run("nft", "-f", "-", input=self._ruleset().encode())
        log.info("network.ready", gateway=gw, slot=str(self.slot), table=self.table)

    def _saved_slot(self) -> ipaddress.IPv4Network | None:
        try:
            return ipaddress.IPv4Network(json.loads(self._state_file.read_text())["slot"])
        except (FileNotFoundError, KeyError, ValueError):
            return None

    async def _choose_slot(self) -> ipaddress.IPv4Network:
        saved = self._saved_slot()
        if saved is not None:
            return saved
        taken = await self._routed_networks()
        slots: list[ipaddress.IPv4Network] = list(SLOT_RANGE.subnets(new_prefix=SLOT_PREFIX))
        start = int(self.tag, 16) % len(slots)
        for k in range(len(slots)):
            slot = slots[(start + k) % len(slots)]
            if not any(slot.overlaps(net) for net in taken):
                tmp = self._state_file.with_suffix(".tmp")
                tmp.write_text(json.dumps({"slot": str(slot)}))
                os.replace(tmp, self._state_file)
                return slot
        raise RuntimeFailure(f"no free sandbox network in {SLOT_RANGE} on this host")

    async def _routed_networks(self) -> list[ipaddress.IPv4Network]:
        res = await privileged.run("ip", "-4", "-o", "addr", "show")
        nets = []
        for line in res.text.splitlines():
            parts = line.split()
            if "inet" in parts:
                nets.append(ipaddress.IPv4Interface(parts[parts.index("inet") + 1]).network)
        return nets

    def _ruleset(self) -> str:
        gw, p, t = self.gateway_ip, self.ports, self.table
        sv = f'"{self.if_prefix}*"'
        # `table ...; delete table ...; table ... {}`: replaced atomically, elements re-added below.
        return f"""
table inet {t}
delete table inet {t}
table inet {t} {{
  set sandbox_src {{ type ifname . ipv4_addr; }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname {sv} ip daddr != {gw} udp dport 53 dnat ip to {gw}:{p.dns}
    iifname {sv} ip daddr != {gw} tcp dport 53 dnat ip to {gw}:{p.dns}
    iifname {sv} ip daddr != {gw} meta l4proto tcp dnat ip to {gw}:{p.transparent}
  }}
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname {sv} meta nfproto ipv6 drop
    iifname {sv} iifname . ip saddr != @sandbox_src drop
    iifname {sv} ip daddr {gw} tcp dport {{ {p.proxy}, {p.transparent}, {p.dns} }} accept
    iifname {sv} ip daddr {gw} udp dport {p.dns} accept
    iifname {sv} meta l4proto tcp reject with tcp reset
    iifname {sv} reject with icmpx admin-prohibited
    ip daddr {gw} iifname "lo" accept
    ip daddr {gw} drop
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname {sv} drop
    oifname {sv} drop
  }}
}}
"""

    # -- per sandbox ----------------------------------------------------------------------------

    def _net_for(self, index: int) -> SandboxNet:
        assert self.slot is not None
        base = self.slot.network_address + 4 * index
        return SandboxNet(index=index, netns=f"{self.ns_prefix}{index}", host_if=f"{self.if_prefix}{index}",
                          host_ip=str(base + 1), sandbox_ip=str(base + 2))

    def load(self, sandbox_dir: Path) -> SandboxNet | None:
        try:
            return SandboxNet.from_json(json.loads((sandbox_dir / NET_FILE).read_text()))
        except FileNotFoundError:
            return None

    def adopt(self, sandbox_dir: Path) -> SandboxNet | None:
        """A sandbox found on disk after a restart keeps its namespace and index."""
        net = self.load(sandbox_dir)
        if net is not None:
            self._used.add(net.index)
        return net

    async def readmit(self, nets: list[SandboxNet]) -> None:
        """After :meth:`setup` replaced the table: let the adopted sandboxes' addresses in again."""
        if nets:
            elements = ", ".join(f"{n.host_if} . {n.sandbox_ip}" for n in nets)
            await privileged.run("nft", "add", "element", "inet", self.table, "sandbox_src",
                                 f"{{ {elements} }}")

    async def attach(self, sandbox_dir: Path) -> SandboxNet:
        """The sandbox's namespace, made once and remembered in its directory (idempotent)."""
        net = self.load(sandbox_dir)
        if net is None:
            index = next((i for i in range(1, MAX_INDEX + 1) if i not in self._used), None)
            if index is None:
                raise RuntimeFailure(f"all {MAX_INDEX} sandbox networks of this node are in use")
            net = self._net_for(index)
            self._used.add(index)
            tmp = sandbox_dir / (NET_FILE + ".tmp")
            tmp.write_text(json.dumps(net.to_json()))
            os.replace(tmp, sandbox_dir / NET_FILE)
        else:
            self._used.add(net.index)
        if not net.netns_path.exists():
            await self._create(net)
        return net

    async def _create(self, net: SandboxNet) -> None:
        await privileged.run("ip", "netns", "add", net.netns)
        try:
            await privileged.run("ip", "-batch", "-", input=(
                f"link add {net.host_if} type veth peer name eth0 netns {net.netns}\n"
                f"link set {net.host_if} addrgenmode none\n"
                f"addr add {net.host_ip}/30 dev {net.host_if}\n"
                f"link set {net.host_if} up\n").encode())
            await privileged.run("nft", "add", "element", "inet", self.table, "sandbox_src",
                                 f"{{ {net.host_if} . {net.sandbox_ip} }}")
            await self.prepare(net)
        except BaseException:
            await asyncio.shield(self._remove(net))
            raise

    async def prepare(self, net: SandboxNet) -> None:
        """Address the namespace's ``eth0`` (again: runsc strips it from the link it takes)."""
        await privileged.run("ip", "-n", net.netns, "-batch", "-", input=(
            "link set eth0 addrgenmode none\n"
            f"addr replace {net.sandbox_ip}/30 dev eth0\n"
            "link set eth0 up\n"
            "link set lo up\n"
            f"route replace default via {net.host_ip} dev eth0\n").encode())

    async def detach(self, sandbox_dir: Path) -> None:
        net = self.load(sandbox_dir)
        if net is None:
            return
        await self._remove(net)
        (sandbox_dir / NET_FILE).unlink(missing_ok=True)
        self._used.discard(net.index)

    async def _remove(self, net: SandboxNet) -> None:
        # Deleting the namespace deletes eth0, and with it the host end of the pair.
        await privileged.run("ip", "netns", "del", net.netns, check=False)
        await privileged.run("ip", "link", "del", net.host_if, check=False)
        await privileged.run("nft", "delete", "element", "inet", self.table, "sandbox_src",
                             f"{{ {net.host_if} . {net.sandbox_ip} }}", check=False)

    async def sweep(self, keep: set[str]) -> list[str]:
        """Remove this node's namespaces that no sandbox owns (left by a crash mid-create)."""
        removed = []
        names = _netns_names()
        for name in names:
            if name.startswith(self.ns_prefix) and name not in keep:
                await self._remove(self._net_for(int(name.removeprefix(self.ns_prefix))))
                removed.append(name)
        if removed:
            log.info("network.swept", namespaces=removed)
        return removed

    async def teardown(self) -> None:
        """Remove everything this node added to the host's network."""
        self.slot = self.slot or self._saved_slot() or next(SLOT_RANGE.subnets(new_prefix=SLOT_PREFIX))
        await self.sweep(set())
        await privileged.run("nft", "delete", "table", "inet", self.table, check=False)
        await privileged.run("ip", "addr", "del", f"{self.gateway_ip}/32", "dev", "lo", check=False)
        self._state_file.unlink(missing_ok=True)
