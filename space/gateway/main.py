"""Start the gateway: mitmproxy (explicit and, optionally, transparent proxy), DNS, control socket.

    python -m space.gateway --proxy 10.201.0.1:3128 [--transparent 10.201.0.1:3129]
        --dns 10.201.0.1:3053 --control /run/space/gateway.sock [--control-fd N | --control-group GID]
        --confdir DIR --journal DIR [--upstream-dns IP[:PORT]] [--hosts-file FILE] [--upstream-ca FILE]
        [--sandbox-network CIDR]... [--private-ceiling CIDR]...

It runs in its own venv (``make gateway``: mitmproxy pins versions the main venv cannot share), as
its own unprivileged user when the node agent starts it (:mod:`space.node.network.gateway`): nothing here
needs privileges, DNS included (it listens on a high port; nftables redirects the sandboxes' port 53).
Prints one JSON ready line on stdout once everything listens; SIGTERM/SIGINT stop it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

from space.egress_policy import LOOPBACK, Fence, IPAddress, IPNetwork, parse_ceiling
from space.gateway.addon import Gateway
from space.gateway.ca import ensure_ca
from space.gateway.conns import Connections
from space.gateway.control import ControlServer
from space.gateway.dns import DnsServer
from space.gateway.journal import Journal
from space.gateway.registry import Registry
from space.gateway.resolver import Resolver, load_hosts
from space.gateway.stats import Stats

log = logging.getLogger("space.gateway")


def hostport(raw: str) -> tuple[str, int]:
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {raw!r}")
    return host.strip("[]"), int(port)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m space.gateway", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy", type=hostport, required=True, help="explicit HTTP proxy (absolute-form + CONNECT)")
    ap.add_argument("--transparent", type=hostport, help="TCP redirected here by nftables (SO_ORIGINAL_DST)")
    ap.add_argument("--dns", type=hostport, help="DNS server for the sandboxes (UDP and TCP)")
    ap.add_argument("--control", required=True, help="unix socket path for the node (mode 0660)")
    ap.add_argument("--control-fd", type=int,
                    help="the control socket, bound and listening already (by the node agent): serve on it")
    ap.add_argument("--control-group", type=int, help="group of the control socket bound here (default: ours)")
    ap.add_argument("--confdir", required=True, help="where the CA lives (mitmproxy's confdir)")
    ap.add_argument("--journal", required=True, help="audit journal directory")
    ap.add_argument("--upstream-dns", help="resolver to ask, IP[:PORT] (default: the system's)")
    ap.add_argument("--hosts-file", help="TEST ONLY: JSON {name: ip}; nothing else resolves")
    ap.add_argument("--upstream-ca", help="TEST ONLY: PEM of the CAs upstream servers are verified against")
    ap.add_argument("--sandbox-network", action="append", default=[], type=ipaddress.ip_network,
                    help="a range the node gives sandboxes addresses from: never a destination (repeatable)")
    ap.add_argument("--private-ceiling", action="append", default=[],
                    help="a private range (CIDR) policies may open on this node; none by default (repeatable)")
    ap.add_argument("--test-allow-loopback", action="store_true",
                    help="TEST ONLY: let policies allow 127.0.0.0/8 (gateway tests' upstreams live there)")
    ap.add_argument("--log-level", default="WARNING")
    return ap.parse_args(argv)


async def amain(args: argparse.Namespace) -> None:
    # mitmproxy is imported here: `space.gateway.main --help` and the typecheck need none of it.
    from mitmproxy import options
    from mitmproxy.addons import core, disable_h2c, errorcheck, next_layer, proxyserver, tlsconfig
    from mitmproxy.master import Master

    cert, _ = ensure_ca(args.confdir)
    hosts = load_hosts(args.hosts_file) if args.hosts_file else None
    fence = Fence(args.sandbox_network, allow_loopback=args.test_allow_loopback)
    ceiling: tuple[IPNetwork, ...] = parse_ceiling(args.private_ceiling)
    if args.test_allow_loopback:
        ceiling += LOOPBACK
    stats, registry = Stats(), Registry(fence, ceiling)
    journal = Journal(args.journal)
    journal.start()
    resolver = Resolver(hosts=hosts, upstream=args.upstream_dns)
    conns = Connections(stats)
    gateway = Gateway(registry, resolver, journal, stats, conns)

    opts = options.Options()
    master = Master(opts)
    ps = proxyserver.Proxyserver()
    conns.proxyserver = ps
    master.addons.add(core.Core(), ps, next_layer.NextLayer(), tlsconfig.TlsConfig(), disable_h2c.DisableH2C(),
                      errorcheck.ErrorCheck(), gateway)
    modes = [f"regular@{args.proxy[0]}:{args.proxy[1]}"]
    if args.transparent:
        modes.append(f"transparent@{args.transparent[0]}:{args.transparent[1]}")
    update: dict[str, Any] = {
        "mode": modes,
        "confdir": args.confdir,
        "connection_strategy": "lazy",  # decide (and learn the SNI) before connecting anywhere
        "upstream_cert": False,  # the client's cert is made from the name alone: no upstream probe
        "stream_large_bodies": "10m",
        "http3": False,
        "ssl_insecure": False,
    }
    if args.upstream_ca:
        update["ssl_verify_upstream_trusted_ca"] = args.upstream_ca
    opts.update(**update)

    dns = DnsServer(registry, resolver, journal, stats) if args.dns else None
    if dns is not None:
        await dns.start(*args.dns)
    control = ControlServer(registry, journal, stats, conns, gateway, dns)
    if args.control_fd is not None:
        await control.start(sock=socket.socket(fileno=args.control_fd))
    else:
        await control.start(args.control, group=args.control_group)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, master.shutdown)

    def ready() -> None:
        def hp(a: tuple[str, int] | None) -> str | None:
            return f"{a[0]}:{a[1]}" if a else None

        print(json.dumps({"event": "gateway.ready", "proxy": hp(args.proxy), "transparent": hp(args.transparent),
                          "dns": hp(args.dns), "control": args.control, "ca_cert": str(cert),
                          "pid": os.getpid()}), flush=True)

    gateway.on_running = ready

    async def watch_node_addresses() -> None:
        # The node's own addresses may change (DHCP, a new link): re-read them now and then.
        while True:
            with contextlib.suppress(OSError):
                fence.set_node_addresses(read_node_addresses())
            await asyncio.sleep(2)

    fence.set_node_addresses(read_node_addresses())
    watcher = asyncio.create_task(watch_node_addresses())
    try:
        await master.run()
    finally:
        watcher.cancel()
        await control.stop()
        if dns is not None:
            await dns.stop()
        await conns.close_all()
        await journal.close()
        if args.control_fd is None:  # a socket handed over is its binder's to remove
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.control)


def read_node_addresses(fib_trie: str = "/proc/net/fib_trie", if_inet6: str = "/proc/net/if_inet6") -> set[IPAddress]:
    """The host's own addresses: IPv4 (the ``/32 host LOCAL`` entries of the FIB) and IPv6."""
    found: set[IPAddress] = set()
    last: str | None = None
    with contextlib.suppress(FileNotFoundError), open(fib_trie) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "|--":
                last = parts[1]
            elif last and "/32 host LOCAL" in line:
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(last))
    with contextlib.suppress(FileNotFoundError), open(if_inet6) as f:
        for line in f:
            with contextlib.suppress(ValueError, IndexError):
                found.add(ipaddress.IPv6Address(bytes.fromhex(line.split()[0])))
    return found


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(amain(args))
