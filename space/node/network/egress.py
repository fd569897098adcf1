"""What the node's gateway knows about each sandbox: its address, tenant, egress policy and the
secrets it may have injected.

Policy and tenant are kept in the sandbox's directory (``egress.json``), so they follow it through
node restarts; secrets are held in memory only (here and in the gateway) and never touch the node's
disk. A sandbox with no entry in the gateway (a warm one nobody has claimed yet) gets no egress at
all: the gateway refuses unknown sources.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import structlog

from space.egress_policy import parse_ceiling, validate
from space.errors import SpaceError
from space.node.network.gateway import GatewayHandle
from space.node.network.namespaces import Network, SandboxNet

log = structlog.get_logger(__name__)

EGRESS_FILE = "egress.json"


class Egress:
    def __init__(self, network: Network, gateway: GatewayHandle) -> None:
        self.network = network
        self.gateway = gateway
        self._secrets: dict[str, list[dict[str, Any]]] = {}

    def ca_cert(self) -> bytes | None:
        """The deployment's egress CA certificate, which sandboxes trust for intercepted TLS."""
        try:
            return (self.gateway.ca_dir / "mitmproxy-ca-cert.pem").read_bytes()
        except FileNotFoundError:
            return None

    def load(self, sandbox_dir: Path) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = json.loads((sandbox_dir / EGRESS_FILE).read_text())
            return doc
        except FileNotFoundError:
            return None

    def configure(self, sandbox_id: str, sandbox_dir: Path, *, tenant: str, policy: dict[str, Any] | None,
                  secrets: list[dict[str, Any]] | None, tenant_policy: dict[str, Any] | None = None,
                  ceiling: list[str] | None = None) -> None:
        """Record a sandbox's egress (``secrets`` None: keep the ones it has)."""
        doc = {"tenant": tenant, "policy": validate(policy), "tenant_policy": validate(tenant_policy),
               "ceiling": None if ceiling is None else [str(n) for n in parse_ceiling(ceiling)]}
        tmp = sandbox_dir / (EGRESS_FILE + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, sandbox_dir / EGRESS_FILE)
        if secrets is not None:
            self._secrets[sandbox_id] = list(secrets)

    async def apply(self, sandbox_id: str, sandbox_dir: Path, net: SandboxNet | None) -> None:
        """Tell the gateway what the sandbox may do (takes effect on its next connection)."""
        doc = self.load(sandbox_dir)
        if doc is None or net is None:
            return
        await self.gateway.client.call(
            "put", ip=net.sandbox_ip, sandbox=sandbox_id, tenant=doc["tenant"], policy=doc["policy"],
            tenant_policy=doc.get("tenant_policy") or {}, ceiling=doc.get("ceiling"),
            secrets=self._secrets.get(sandbox_id, []))

    async def forget(self, sandbox_id: str, net: SandboxNet | None) -> None:
        self._secrets.pop(sandbox_id, None)
        if net is None:
            return
        try:
            await self.gateway.client.call("delete", ip=net.sandbox_ip)
        except SpaceError as exc:  # a gateway that is gone holds nothing to forget
            log.warning("egress.forget_failed", sandbox=sandbox_id, error=str(exc))

    async def reset(self, sandbox_id: str, net: SandboxNet | None) -> None:
        """Abort the sandbox's connections through the gateway (before a checkpoint: gVisor cannot
        save an established TCP connection, nor one in TIME_WAIT)."""
        if net is not None:
            await self.gateway.client.call("reset", ip=net.sandbox_ip)

    def missing_secrets(self, sandbox_ids: list[str]) -> list[str]:
        """Sandboxes whose secrets this agent no longer holds (it restarted): the control plane
        pushes them again."""
        return [sid for sid in sandbox_ids if sid not in self._secrets]
