"""``python -m space.node.helper``: the node's root helper process.

It serves the allowlisted verbs on a unix socket that only the node agent's uid (and root, with
``--allow-root``) may use, until its ``--stop-fd`` reaches EOF (the agent closed its end, or died)
or its ``--parent-pid`` exits -- or, started with neither, SIGTERM or SIGINT: then it stops
accepting, cancels the verbs in flight (killing their children), waits for what they do on
cancellation and exits 0. Standard
library and structlog only, like :mod:`space.nodesup`: it must start fast and parse nothing but its
requests.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import grp
import ipaddress
import json
import os
import signal
from functools import partial
from pathlib import Path

import structlog

from space.egress_policy import DEFAULT_SANDBOX_NETWORK, parse_sandbox_network
from space.errors import InvalidRequest, SpaceError
from space.node.helper import build_sandbox, verbs
from space.node.helper.rpc import serve
from space.node.helper.verbs import DEFAULT_BUILD_MAX_BYTES, GatewayConfig, HelperContext
from space.runtime import cgroups

PR_SET_PDEATHSIG = 1

log = structlog.get_logger("space.node.helper")


def _group(value: str) -> int:
    if value.isdigit():
        return int(value)
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise argparse.ArgumentTypeError(f"no such group: {value}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m space.node.helper", description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--cache-dir", type=Path, required=True)
    p.add_argument("--socket", type=Path, required=True, help="the unix socket to serve on")
    p.add_argument("--agent-uid", type=int, required=True, help="the only uid allowed to call")
    p.add_argument("--socket-group", type=_group, default=None, help="group (name or gid) of the socket")
    p.add_argument("--allow-root", action="store_true", help="let root call too (tests, node teardown)")
    p.add_argument("--pool-root", type=Path, default=None, help="the btrfs pool (default <data-dir>/pool)")
    p.add_argument("--guest-dir", type=Path, default=None, help="the guest daemon mounted into sandboxes")
    p.add_argument("--gateway-ports", type=_ports, default=(3128, 3129, 3053),
                   help="proxy,transparent,dns ports of the egress gateway")
    p.add_argument("--gateway-config", type=_gateway, default=None, help="JSON: how to run the gateway")
    p.add_argument("--runsc", default="runsc")
    p.add_argument("--sandbox-network", type=_sandbox_network, default=DEFAULT_SANDBOX_NETWORK,
                   help="the deployment's sandbox address range (default 10.208.0.0/12); the node takes a /20")
    p.add_argument("--mirror", action="append", default=[], type=_mirror,
                   help="a Debian mirror template builds may debootstrap from (repeatable; default "
                        "http://deb.debian.org/debian)")
    p.add_argument("--registry", action="append", default=[], type=_registry,
                   help="a container registry template builds may pull images from, https://host[:port] "
                        "(http:// for one without TLS; repeatable; default none)")
    p.add_argument("--build-max-bytes", type=_positive, default=DEFAULT_BUILD_MAX_BYTES,
                   help="what one template build may write into its tree, in bytes (default 32 GiB)")
    p.add_argument("--image-policy", type=Path, default=None,
                   help="a containers-policy.json(5) images are pulled under (default: any image of a listed "
                        "registry); root's, not writable by others")
    p.add_argument("--signatures", type=Path, default=None,
                   help="a containers-registries.d(5) directory: where images' signatures are")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit with this process (the node agent that started the helper)")
    p.add_argument("--stop-fd", type=int, default=None,
                   help="an inherited pipe's read end: its EOF stops the helper (the agent, unprivileged "
                        "once it dropped root, cannot signal it)")
    return p


def _sandbox_network(value: str) -> ipaddress.IPv4Network:
    try:
        return parse_sandbox_network(value)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _ports(value: str) -> tuple[int, int, int]:
    parts = value.split(",")
    if len(parts) != 3 or not all(p.isdigit() and 0 < int(p) < 65536 for p in parts):
        raise argparse.ArgumentTypeError("three ports: proxy,transparent,dns")
    return int(parts[0]), int(parts[1]), int(parts[2])


def _mirror(value: str) -> str:
    from space.node.helper.verbs_template import MIRROR_RE

    if MIRROR_RE.fullmatch(value) is None:
        raise argparse.ArgumentTypeError(f"not an http(s):// or file:// URL: {value}")
    return value


def _registry(value: str) -> str:
    from space.node.helper.verbs_oci import MIRROR_RE, REGISTRY_RE

    mirror = MIRROR_RE.fullmatch(value)
    if REGISTRY_RE.fullmatch((mirror["url"] if mirror else value).rstrip("/")) is None:
        raise argparse.ArgumentTypeError(f"not an https:// (or http://) registry URL with a host, nor "
                                         f"NAME=URL (a mirror for NAME): {value}")
    return value.rstrip("/")


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"not a positive number of bytes: {value}")
    return int(value)


def _gateway(value: str) -> GatewayConfig:
    try:
        return GatewayConfig.from_json(json.loads(value))
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"bad gateway config: {exc}") from None


def _die_with_parent(parent: int) -> None:
    """SIGTERM when the agent that started us dies (it cannot signal us once it dropped root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the prctl
        raise SystemExit(0)


def _ignored(sig: signal.Signals) -> None:
    log.info("helper.signal_ignored", signal=sig.name, reason="the agent stops its helper")


async def _main(args: argparse.Namespace) -> None:
    verbs.load_all()
    ctx = HelperContext(data_dir=args.data_dir, cache_dir=args.cache_dir, pool_root=args.pool_root,
                        guest_dir=args.guest_dir, gateway_ports=args.gateway_ports, runsc=args.runsc,
                        agent_uid=args.agent_uid, gateway=args.gateway_config, mirrors=tuple(args.mirror),
                        registries=tuple(args.registry), sandbox_network=args.sandbox_network,
                        build_max_bytes=args.build_max_bytes, image_policy=args.image_policy,
                        signatures=args.signatures,
                        # once, at the start: a host whose cgroups cannot hold sandboxes stops here
                        cgroups=cgroups.host())
    if ctx.image_policy is not None or ctx.signatures is not None:
        # A policy the helper cannot use stops it here, not at the first build's pull.
        from space.node.helper import verbs_oci

        try:
            verbs_oci.image_policy(ctx)
            if ctx.signatures is not None:
                verbs_oci.signatures_dir(ctx, "")
        except SpaceError as exc:
            raise SystemExit(f"space helper: {exc.message}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    supervised = args.stop_fd is not None or args.parent_pid is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        # An agent's helper stops when its agent says so (the stop fd) or dies, never before: a
        # signal sent to every process of the agent's group (Ctrl-C in a terminal; a container
        # runtime stopping a container that shares the host's PID namespace) would otherwise take
        # the helper away while the agent still stops in order through it.
        loop.add_signal_handler(sig, partial(_ignored, sig) if supervised else stop.set)

    def stop_when_readable(fd: int) -> None:
        def fire() -> None:
            # Both a pidfd and a pipe at EOF stay readable: one wake-up is all this needs (left
            # registered, the loop spins at full CPU for as long as the stop takes).
            loop.remove_reader(fd)
            stop.set()
        loop.add_reader(fd, fire)

    if args.stop_fd is not None:
        os.set_blocking(args.stop_fd, False)
        os.set_inheritable(args.stop_fd, False)  # runsc, the gateway: none of their business
        stop_when_readable(args.stop_fd)  # the agent never writes: readable means EOF
    if args.parent_pid is not None:
        # The parent-death signal alone is not enough: the agent drops root after starting us, and
        # the kernel then drops its dying signal to a root process on the floor (permission check).
        try:
            parent = os.pidfd_open(args.parent_pid)
        except ProcessLookupError:
            return
        stop_when_readable(parent)
    # No build outlives the helper that ran it: what a dead one left is removed before serving.
    await build_sandbox.sweep(ctx)
    server = await serve(ctx, args.socket, agent_uid=args.agent_uid, allow_root=args.allow_root,
                         socket_gid=args.socket_group)
    log.info("helper.started", pid=os.getpid(), verbs=sorted(verbs.REGISTRY))
    await stop.wait()
    log.info("helper.stopping")
    server.close()
    await server.wait_closed()
    log.info("helper.stopped")


def main() -> None:
    from space import logs

    args = _parser().parse_args()
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid)
    logs.configure(os.environ.get("SPACE_LOG_LEVEL", "info"))
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
