"""The sandboxes' DNS server (UDP and TCP), answering by each sandbox's egress policy.

- Source address → sandbox; an unknown source gets REFUSED.
- A name the policy denies outright (``Policy.check_name(name, 0)``) gets NXDOMAIN, audited as
  ``dns.deny``.
- Otherwise the gateway resolves the name itself and answers A records, leaving out every address
  the policy would deny on **every** port: an address is kept when ``decide(name, p, [ip])`` allows
  it for some ``p`` among the ports the rules name, plus 0 standing for "any other port". DNS cannot
  know the port the sandbox will use, and the proxy checks the real port on connect anyway; what
  must not leak is an address no connection could be allowed to (blocked ranges, denied CIDRs).
  A name whose every address is left out gets NXDOMAIN (audited).
- AAAA: an empty answer unless the policy allows some IPv6 CIDR (the sandbox network is IPv4;
  without that, IPv6 answers only make clients try a route that does not exist).
- Other types: an empty answer. TTL 5 s so that a policy change bites quickly.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any, cast

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from space.gateway.journal import Journal
from space.gateway.policy import IPAddress, Policy
from space.gateway.registry import Registry, normalize_ip
from space.gateway.resolver import Resolver
from space.gateway.stats import Stats

TTL = 5
TCP_IDLE = 10.0
_LINGER0 = struct.pack("ii", 1, 0)


def permitted_somewhere(policy: Policy, name: str, ip: IPAddress) -> bool:
    """Whether a connection to ``ip`` (named ``name``) could be allowed on at least one port."""
    ports = {0} | {r.port for r in (*policy.allow, *policy.deny) if r.port}
    return any(policy.decide(name, p, [ip]).allowed for p in sorted(ports))


def allows_ipv6(policy: Policy) -> bool:
    return any(r.network is not None and r.network.version == 6 for r in policy.allow)


class DnsServer:
    def __init__(self, registry: Registry, resolver: Resolver, journal: Journal, stats: Stats) -> None:
        self.registry = registry
        self.resolver = resolver
        self.journal = journal
        self.stats = stats
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tcp_conns: dict[asyncio.StreamWriter, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), local_addr=(host, port))
        self._udp = transport
        self._tcp = await asyncio.start_server(self._serve_tcp, host, port)

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        for w in list(self._tcp_conns):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()

    def reset(self, ip: str) -> int:
        """Abort (RST) every DNS-over-TCP connection from ``ip``."""
        victims = [w for w, src in self._tcp_conns.items() if src == ip]
        for w in victims:
            w.transport.abort()
        return len(victims)

    def open_from(self, ip: str) -> int:
        return sum(1 for src in self._tcp_conns.values() if src == ip)

    # ---- answering ---------------------------------------------------------------------------------

    async def answer(self, wire: bytes, source: str) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None  # not DNS: no answer at all
        resp = dns.message.make_response(query)
        resp.flags |= dns.flags.RA
        self.stats.dns_queries += 1
        entry = self.registry.get(source)
        if entry is None:
            resp.set_rcode(dns.rcode.REFUSED)
            return _wire(resp)
        if len(query.question) != 1:
            resp.set_rcode(dns.rcode.FORMERR)
            return _wire(resp)
        q = query.question[0]
        name = q.name.to_text(omit_final_dot=True).lower()
        if q.rdclass != dns.rdataclass.IN:
            resp.set_rcode(dns.rcode.REFUSED)
            return _wire(resp)
        policy = entry.policy
        early = policy.check_name(name, 0)
        if early is not None and not early.allowed:
            self._deny(entry.tenant, entry.sandbox, name, q.rdtype, early.rule, early.reason)
            resp.set_rcode(dns.rcode.NXDOMAIN)
            return _wire(resp)
        if q.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            version = 4 if q.rdtype == dns.rdatatype.A else 6
            if version == 6 and not allows_ipv6(policy):
                return _wire(resp)
            ips = await self.resolver.resolve(name, version)
            if not ips and version == 4 and not await self.resolver.resolve(name, 6):
                resp.set_rcode(dns.rcode.NXDOMAIN)
                return _wire(resp)
            kept = [ip for ip in ips if permitted_somewhere(policy, name, ip)]
            if ips and not kept:
                self._deny(entry.tenant, entry.sandbox, name, q.rdtype, "blocked-range",
                           f"every address of {name} is denied ({', '.join(map(str, ips))})")
                resp.set_rcode(dns.rcode.NXDOMAIN)
                return _wire(resp)
            if kept:
                resp.answer.append(dns.rrset.from_text_list(q.name, TTL, dns.rdataclass.IN, q.rdtype,
                                                            [str(ip) for ip in kept]))
        return _wire(resp)

    def _deny(self, tenant: str, sandbox: str, name: str, rdtype: int, rule: str, reason: str) -> None:
        self.stats.dns_denied += 1
        self.journal.append(tenant, sandbox, "dns.deny", name, "nxdomain",
                            {"rule": rule, "reason": reason, "qtype": dns.rdatatype.to_text(rdtype)})

    # ---- transports --------------------------------------------------------------------------------

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        # The sandbox must never be left in TIME_WAIT (it blocks a checkpoint): every close of ours
        # is a reset. A client closes first normally, so nothing it still wanted is lost.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER0)
        peer = writer.get_extra_info("peername")
        source = normalize_ip(peer[0])
        self._tcp_conns[writer] = source
        try:
            while True:
                async with asyncio.timeout(TCP_IDLE):
                    head = await reader.readexactly(2)
                    wire = await reader.readexactly(struct.unpack("!H", head)[0])
                out = await self.answer(wire, source)
                if out is None:
                    break
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self._tcp_conns.pop(writer, None)
            writer.transport.abort()


def _wire(msg: Any) -> bytes:
    return bytes(msg.to_wire())


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.server.spawn(self._reply(data, addr))

    async def _reply(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        out = await self.server.answer(data, normalize_ip(str(addr[0])))
        if out is not None and self.transport is not None:
            if len(out) > 512:  # no EDNS bookkeeping here: truncate, the client retries over TCP
                q = dns.message.from_wire(data)
                r = dns.message.make_response(q)
                r.flags |= dns.flags.TC | dns.flags.RA
                out = _wire(r)
            self.transport.sendto(out, addr)

