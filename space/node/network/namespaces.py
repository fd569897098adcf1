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
    gateway's transparent port, and every DNS query (port 53, to any address) to the gateway's
    DNS port (3053: the gateway needs no privilege to bind it): nothing leaves unseen;
  * a packet whose source address is not the one given to its interface is dropped (no spoofing:
    the gateway tells sandboxes apart by source address);
  * from a sandbox interface the host accepts only the gateway's ports (and replies to the
    connections the host's port proxy opened) and rejects the rest (TCP
    with a reset, so a client fails at once instead of waiting out a timeout);
  * nothing is forwarded to or from a sandbox interface: not to another sandbox, the host's
    networks, private ranges or metadata addresses. IPv6 from sandboxes is dropped.

gVisor runs the sandbox's own network stack (netstack) on ``eth0``: the guest's packets never meet
the host kernel's socket layer. runsc removes the address from the interface it takes over, so
:meth:`Network.ready` puts it back before every start or restore (RUNTIME_NOTES), and a restore
takes the addressing of the namespace it lands in, so a fork or a move to another node simply gets
the new sandbox's address.

Every host change is a verb of the root helper (:mod:`space.node.helper.verbs_net`, which also
holds the nftables rules); this module keeps the agent's side: which sandbox has which index
(``net.json`` in its directory) and when to create, prepare and remove a network.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import structlog

from space.errors import RuntimeFailure, SpaceError
from space.node.helper.backend import Privileged
from space.node.helper.verbs_net import MAX_INDEX, NETNS_DIR, netns_names, node_tag

log = structlog.get_logger(__name__)

NET_FILE = "net.json"

#: Namespaces a node keeps made ahead of need (:meth:`Network.ready`).
SPARES = 2

__all__ = ["MAX_INDEX", "NET_FILE", "GatewayPorts", "Network", "SandboxNet", "node_tag"]


@dataclasses.dataclass(frozen=True)
class GatewayPorts:
    proxy: int = 3128
    transparent: int = 3129
    dns: int = 3053

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.proxy, self.transparent, self.dns)


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


class Network:
    """The agent's side of sandbox networking; the host changes are the helper's ``net.*`` verbs."""

    def __init__(self, data_dir: Path, priv: Privileged) -> None:
        self.data_dir = data_dir
        self.priv = priv
        self.tag = node_tag(data_dir)
        self.ns_prefix = f"space-{self.tag}-"
        self.ports = GatewayPorts()
        self._gateway_ip: str | None = None
        self._used: set[int] = set()
        #: Namespaces made ahead of need, addressed and admitted, that no sandbox owns yet: a new
        #: sandbox takes one instead of waiting for three host commands (~15 ms of a cold create,
        #: a fork or a restore). Not on disk: after a crash :meth:`sweep` removes them.
        self.spares_target = SPARES
        self._spares: list[SandboxNet] = []
        self._replenishing: asyncio.Task[None] | None = None

    # -- node-wide ------------------------------------------------------------------------------

    @property
    def gateway_ip(self) -> str:
        assert self._gateway_ip is not None, "Network.setup() first"
        return self._gateway_ip

    async def setup(self) -> None:
        """Idempotent: the gateway address and the node's nftables table."""
        res = await self.priv.call("net.setup")
        self._gateway_ip = res["gateway_ip"]
        self.ns_prefix = res["ns_prefix"]
        self.ports = GatewayPorts(**res["ports"])
        log.info("network.ready", gateway=self._gateway_ip, slot=res["slot"], tag=res["tag"])

    # -- per sandbox ----------------------------------------------------------------------------

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
            await self.priv.call("net.admit", {"indexes": [n.index for n in nets]})

    async def ready(self, sandbox_dir: Path) -> SandboxNet:
        """The sandbox's namespace, ready for a new instance: made once (or taken from the spares)
        and remembered in its directory, its ``eth0`` addressed (again, for one a former instance
        took over). Idempotent."""
        net = self.load(sandbox_dir)
        if net is None:
            net = await self._new()
            tmp = sandbox_dir / (NET_FILE + ".tmp")
            tmp.write_text(json.dumps(net.to_json()))
            os.replace(tmp, sandbox_dir / NET_FILE)
            return net  # made (or spared) addressed
        self._used.add(net.index)
        if not net.netns_path.exists():
            await self.priv.call("net.create", {"index": net.index})
        else:
            await self.prepare(net)
        return net

    async def _new(self) -> SandboxNet:
        self.keep_spares()
        while self._spares:
            spare = self._spares.pop()
            if spare.netns_path.exists():
                return spare
            self._used.discard(spare.index)  # removed under us (a teardown): not usable
        return await self._create()

    async def _create(self) -> SandboxNet:
        index = next((i for i in range(1, MAX_INDEX + 1) if i not in self._used), None)
        if index is None:
            raise RuntimeFailure(f"all {MAX_INDEX} sandbox networks of this node are in use")
        self._used.add(index)
        try:
            return SandboxNet.from_json(await self.priv.call("net.create", {"index": index}))
        except BaseException:
            self._used.discard(index)
            raise

    def keep_spares(self) -> None:
        """Make spares in the background until there are :attr:`spares_target` of them."""
        if self.spares_target <= 0 or (self._replenishing is not None and not self._replenishing.done()):
            return
        self._replenishing = asyncio.get_running_loop().create_task(self._replenish(), name="network.spares")

    async def _replenish(self) -> None:
        # Never the last free indexes: a sandbox must not be refused for a spare's sake.
        while (len(self._spares) < self.spares_target
               and MAX_INDEX - len(self._used) > self.spares_target):
            try:
                self._spares.append(await self._create())
            except SpaceError as exc:  # out of indexes (RuntimeFailure) or the helper refused
                log.warning("network.spare_failed", error=str(exc))
                return

    async def lease(self) -> SandboxNet:
        """A network of the node for something that is not a sandbox (a template build's steps),
        until :meth:`release`; nothing is written to disk (a crash leaves a namespace no sandbox
        owns, which :meth:`sweep` removes)."""
        return await self._create()

    async def release(self, net: SandboxNet) -> None:
        await self.priv.call("net.remove", {"index": net.index})
        self._used.discard(net.index)

    async def prepare(self, net: SandboxNet) -> None:
        """Address the namespace's ``eth0`` (again: runsc strips it from the link it takes)."""
        await self.priv.call("net.prepare", {"index": net.index})

    async def detach(self, sandbox_dir: Path) -> None:
        net = self.load(sandbox_dir)
        if net is None:
            return
        await self.priv.call("net.remove", {"index": net.index})
        (sandbox_dir / NET_FILE).unlink(missing_ok=True)
        self._used.discard(net.index)

    async def sweep(self, keep: set[str]) -> list[str]:
        """Remove this node's namespaces that no sandbox owns (left by a crash mid-create, or
        spares of an agent that stopped), and its own spares too."""
        await self._drop_spares()
        removed = []
        for name in netns_names():
            suffix = name.removeprefix(self.ns_prefix)
            if name.startswith(self.ns_prefix) and name not in keep and suffix.isdigit():
                await self.priv.call("net.remove", {"index": int(suffix)})
                removed.append(name)
        if removed:
            log.info("network.swept", namespaces=removed)
        return removed

    async def _drop_spares(self) -> None:
        if self._replenishing is not None:
            self._replenishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replenishing
            self._replenishing = None
        for spare in self._spares:
            self._used.discard(spare.index)
        self._spares.clear()

    async def teardown(self) -> None:
        """Remove everything this node added to the host's network."""
        await self._drop_spares()
        await self.priv.call("net.teardown")
