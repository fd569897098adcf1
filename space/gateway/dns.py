"""The sandboxes' DNS server (UDP and TCP), answering by each sandbox's egress policy.

- Source address → sandbox; an unknown source gets REFUSED.
- A name the policy denies outright (``Egress.check_name(name, 0)``: a deny rule, or an allowlist
  none of whose host patterns allows it), a name that is really an address in some spelling
  (``2130706433``, ``127.1``) and a host that is neither get NXDOMAIN, answered here and audited as
  ``dns.deny``: such a name is **never** sent upstream (a lookup of ``<data>.evil.tld`` would carry
  the data out).
- Otherwise the gateway resolves the name itself and answers A records, leaving out every address
  the policy would deny on **every** port: an address is kept when ``decide(name, p, [ip])`` allows
  it for some ``p`` among the ports the rules name, plus 0 standing for "any other port". DNS cannot
  know the port the sandbox will use, and the proxy checks the real port on connect anyway; what
  must not leak is an address no connection could be allowed to (blocked ranges, denied CIDRs).
  A name whose every address is left out gets NXDOMAIN (audited).
- AAAA: an empty answer unless the policy allows some IPv6 CIDR (the sandbox network is IPv4;
  without that, IPv6 answers only make clients try a route that does not exist).
- Other types: an empty answer. TTL 5 s so that a policy change bites quickly.
- Bounded work: at most ``MAX_INFLIGHT_PER_SOURCE`` queries of one sandbox and ``MAX_INFLIGHT`` in
  all are answered at once; a datagram beyond that gets REFUSED at once (counted in ``dns_busy``),
  without a task or an upstream query. At most ``MAX_TCP_PER_SOURCE`` TCP connections per sandbox
  (and ``MAX_TCP`` in all); one more is reset (``dns_tcp_refused``).
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

from space.egress_policy import Decision, classify_host
from space.gateway.journal import Journal
from space.gateway.registry import Registry, normalize_ip
from space.gateway.resolver import Resolver
from space.gateway.stats import Stats

TTL = 5
TCP_IDLE = 10.0
_LINGER0 = struct.pack("ii", 1, 0)
#: Queries being answered at once (each may wait on upstream DNS for seconds).
MAX_INFLIGHT_PER_SOURCE = 32
MAX_INFLIGHT = 512
MAX_TCP_PER_SOURCE = 8
MAX_TCP = 256


class Inflight:
    """Counts per source and in all; ``take`` says whether one more may start."""

    def __init__(self, per_source: int, total: int) -> None:
        self.per_source, self.total = per_source, total
        self.counts: dict[str, int] = {}
        self.n = 0

    def take(self, source: str) -> bool:
        mine = self.counts.get(source, 0)
        if mine >= self.per_source or self.n >= self.total:
            return False
        self.counts[source] = mine + 1
        self.n += 1
        return True

    def give(self, source: str) -> None:
        mine = self.counts.get(source, 0) - 1
        if mine > 0:
            self.counts[source] = mine
        else:
            self.counts.pop(source, None)
        self.n -= 1


def refused(wire: bytes) -> bytes | None:
    """A REFUSED answer to ``wire`` from its header and question alone (no message parse, no
    compression pointers followed): None if it is no query."""
    if len(wire) < 12 or wire[2] & 0x80:
        return None
    flags = 0x8000 | ((wire[2] & 0x79) << 8) | 0x80 | 5  # QR, its opcode and RD, RA, REFUSED
    question = b""
    if wire[4:6] == b"\0\1":  # one question: echoed, as resolvers match answers by it
        pos = 12
        while pos < len(wire) and wire[pos] and wire[pos] < 64:
            pos += wire[pos] + 1
        if pos + 5 <= len(wire) and wire[pos] == 0:
            question = wire[12:pos + 5]
    return wire[:2] + struct.pack("!HHHHH", flags, 1 if question else 0, 0, 0, 0) + question


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
        self.inflight = Inflight(MAX_INFLIGHT_PER_SOURCE, MAX_INFLIGHT)
        self.tcp = Inflight(MAX_TCP_PER_SOURCE, MAX_TCP)

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
        egress = entry.egress
        denial = egress.check_name(name, 0)
        if denial is None and not isinstance(classify_host(name), str):
            denial = Decision(False, "invalid-host", f"{name} is an address, not a name to look up")
        if denial is not None:
            self._deny(entry.tenant, entry.sandbox, name, q.rdtype, denial.rule, denial.reason)
            resp.set_rcode(dns.rcode.NXDOMAIN)
            return _wire(resp)
        if q.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            version = 4 if q.rdtype == dns.rdatatype.A else 6
            if version == 6 and not egress.allows_ipv6:
                return _wire(resp)
            ips = await self.resolver.resolve(name, version)
            if not ips and version == 4 and not await self.resolver.resolve(name, 6):
                resp.set_rcode(dns.rcode.NXDOMAIN)
                return _wire(resp)
            kept = [ip for ip in ips if egress.permitted_somewhere(name, ip)]
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
        if not self.tcp.take(source):
            self.stats.dns_tcp_refused += 1
            writer.transport.abort()
            return
        self._tcp_conns[writer] = source
        try:
            while True:
                async with asyncio.timeout(TCP_IDLE):
                    head = await reader.readexactly(2)
                    wire = await reader.readexactly(struct.unpack("!H", head)[0])
                if self.inflight.take(source):
                    try:
                        out = await self.answer(wire, source)
                    finally:
                        self.inflight.give(source)
                else:
                    self.stats.dns_busy += 1
                    out = refused(wire)
                if out is None:
                    break
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self._tcp_conns.pop(writer, None)
            self.tcp.give(source)
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
        server = self.server
        source = normalize_ip(str(addr[0]))
        if not server.inflight.take(source):
            # Over its share: answered at once from the header, no task, nothing asked upstream.
            server.stats.dns_busy += 1
            out = refused(data)
            if out is not None and self.transport is not None:
                self.transport.sendto(out, addr)
            return
        server.spawn(self._reply(data, addr, source))

    async def _reply(self, data: bytes, addr: tuple[str | Any, int], source: str) -> None:
        try:
            out = await self.server.answer(data, source)
        finally:
            self.server.inflight.give(source)
        if out is not None and self.transport is not None:
            if len(out) > 512:  # no EDNS bookkeeping here: truncate, the client retries over TCP
                q = dns.message.from_wire(data)
                r = dns.message.make_response(q)
                r.flags |= dns.flags.TC | dns.flags.RA
                out = _wire(r)
            self.transport.sendto(out, addr)

