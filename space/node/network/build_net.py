"""The network of template build steps: a sandbox network of the node, leased for one build.

A build step (apt, pip, a ``run`` command) runs in a gVisor sandbox (``space.node.helper.
build_sandbox``) on one of the node's sandbox networks, exactly as a sandbox does: its own network
namespace and veth, every TCP connection and DNS query redirected to the node's egress gateway
(``space.node.network.namespaces``). The gateway knows the build's address with the **build egress policy**:

- the host of every Debian mirror the node builds from (``SPACE_BUILD_MIRRORS``, default
  ``http://deb.debian.org/debian``), ports 80 and 443;
- PyPI: ``pypi.org:443`` and ``files.pythonhosted.org:443``;
- whatever the operator adds with ``SPACE_BUILD_EGRESS`` (comma-separated egress rules, the syntax
  of a sandbox policy: ``github.com:443``, ``*.example.com``), for what a spec's ``run`` commands
  fetch;
- nothing else (``default: deny``; the gateway's blocked ranges hold as for any sandbox).

A build has no tenant: its decisions are journaled under the tenant ``_build``. The lease ends with
the build (the address leaves the gateway, the namespace is removed); a crash mid-build leaves a
namespace no sandbox owns, which the next start's sweep removes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

import structlog

from space.egress_policy import validate
from space.errors import SpaceError
from space.node.helper.verbs_template import DEFAULT_MIRROR
from space.node.network.egress import Egress

log = structlog.get_logger(__name__)

PYPI_HOSTS: Final = ("pypi.org:443", "files.pythonhosted.org:443")
#: The tenant a build's egress decisions are journaled under.
BUILD_TENANT: Final = "_build"


def env_list(name: str) -> tuple[str, ...]:
    """A comma-separated setting from the environment, as a tuple (empty when unset)."""
    return tuple(v.strip() for v in os.environ.get(name, "").split(",") if v.strip())


def build_mirrors() -> tuple[str, ...]:
    """The Debian mirrors builds may use (``SPACE_BUILD_MIRRORS``; default the Debian CDN)."""
    return env_list("SPACE_BUILD_MIRRORS") or (DEFAULT_MIRROR,)


def build_policy(mirrors: Sequence[str], extra: Sequence[str] = ()) -> dict[str, Any]:
    allow: list[str] = []
    for mirror in mirrors:
        host = urlsplit(mirror).hostname
        if host:  # a file:// mirror needs no network
            allow += [f"{host}:80", f"{host}:443"]
    allow += [*PYPI_HOSTS, *extra]
    policy: dict[str, Any] = validate({"allow": list(dict.fromkeys(allow)), "default": "deny"})
    return policy


class BuildNetwork:
    """Leases the node's sandbox networks to builds, registered with the gateway."""

    def __init__(self, egress: Egress, *, mirrors: Sequence[str], extra: Sequence[str] = ()) -> None:
        self.egress = egress
        self.policy = build_policy(mirrors, extra)

    @contextlib.asynccontextmanager
    async def lease(self, build: str, spec: dict[str, Any]) -> AsyncIterator[int]:
        """A network index for ``build``'s steps, its address allowed by the build policy."""
        network, gateway = self.egress.network, self.egress.gateway
        net = await network.lease()
        try:
            await gateway.client.call("put", ip=net.sandbox_ip, sandbox=build, tenant=BUILD_TENANT,
                                      policy=self.policy, secrets=[])
            log.info("build.network", build=build, index=net.index, ip=net.sandbox_ip)
            yield net.index
        finally:
            await asyncio.shield(self._release(build, net))

    async def _release(self, build: str, net: Any) -> None:
        try:
            await self.egress.gateway.client.call("delete", ip=net.sandbox_ip)
        except SpaceError as exc:  # a gateway that is gone holds nothing to forget
            log.warning("build.network_forget_failed", build=build, error=str(exc))
        await self.egress.network.release(net)
