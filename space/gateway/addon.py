"""The mitmproxy addon: egress decisions, credential injection and redaction, the audit trail.

Where a decision is made:

- a CONNECT (``http_connect``): once per tunnel; a denied one is answered 403;
- a transparent TLS connection (``tls_clienthello``, by SNI); a denied one is reset;
- a plain-HTTP request (``requestheaders``, explicit or transparent), each request; a denied one
  is answered 403 without any upstream attempt;
- inside a tunnel, each request again against the tunnel's checked address (a policy change
  applies to the next request);
- every upstream connection (``server_connect``): it goes to the address that was checked (never a
  second resolution); a connection nothing checked yet is checked there.

Every decision is :class:`space.egress_policy.Egress`'s: a host that is an address in any spelling
is decided as that address, and a name the policy settles by itself (a deny rule, an allowlist
without it) is denied before any lookup, so nothing about it reaches upstream DNS.

TLS is intercepted only for a tunnel whose host one of the sandbox's secrets names; everything
else passes through untouched. A secret goes only to the tunnel's host (a request naming another
host inside the tunnel gets 421) and only over TLS verified for that host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import http

from space.egress_policy import Decision, IPAddress, canonical, classify_host
from space.gateway.conns import Conn, Connections, Target
from space.gateway.journal import Journal
from space.gateway.redact import Redactor, StreamRedactor, needles_of, textual
from space.gateway.registry import Entry, Registry, normalize_ip
from space.gateway.resolver import Resolver
from space.gateway.stats import Stats

log = logging.getLogger("space.gateway")

#: Responses up to this size are buffered and redacted after decoding; larger ones (and every
#: identity-encoded one) are redacted as they stream.
MAX_BUFFERED = 10 << 20


class Gateway:
    def __init__(self, registry: Registry, resolver: Resolver, journal: Journal, stats: Stats,
                 conns: Connections) -> None:
        self.registry = registry
        self.resolver = resolver
        self.journal = journal
        self.stats = stats
        self.conns = conns
        self.on_running: Callable[[], None] | None = None

    def running(self) -> None:
        """mitmproxy's servers listen now (it calls this after setting them up)."""
        if self.on_running is not None:
            self.on_running()

    # ---- helpers -----------------------------------------------------------------------------------

    async def check(self, entry: Entry, host: str, port: int) -> tuple[Decision, IPAddress | None]:
        """Decide on ``host`` (resolving it only when the name alone does not settle it); the address
        to connect to when allowed. An address in any spelling is never looked up as a name."""
        egress = entry.egress
        early = egress.check_name(host, port)
        if early is not None:
            return early, None
        target = classify_host(host)  # check_name refused what does not parse
        if not isinstance(target, str):
            d = egress.decide(host, port)
            return d, (canonical(target) if d.allowed else None)
        ips = await self.resolver.resolve(target, 4)
        if not ips and egress.allows_ipv6:
            ips = await self.resolver.resolve(target, 6)
        d = egress.decide(target, port, ips)
        return d, (ips[0] if d.allowed else None)

    def audit(self, entry: Entry, action: str, target: str, result: str, **details: Any) -> None:
        self.journal.append(entry.tenant, entry.sandbox, action, target, result, details)

    def deny(self, flow: http.HTTPFlow, entry: Entry | None, host: str, port: int, d: Decision) -> None:
        self.stats.denied += 1
        if entry is not None:
            self.audit(entry, "egress.deny", f"{host}:{port}", "denied", rule=d.rule, reason=d.reason)
        self.respond(flow, 403, f"SPACE egress policy denied {host}:{port}: {d.reason}\n")

    @staticmethod
    def respond(flow: http.HTTPFlow, status: int, text: str, **headers: str) -> None:
        flow.response = http.Response.make(status, text.encode(), {
            "Content-Type": "text/plain; charset=utf-8", "X-Space-Egress": "denied", **headers})
        flow.metadata["space_generated"] = True

    def lookup(self, client: Any) -> tuple[Conn | None, Entry | None]:
        conn = self.conns.get(client.id)
        return conn, (self.registry.get(conn.ip) if conn is not None else None)

    # ---- connections -------------------------------------------------------------------------------

    def client_connected(self, client: Any) -> None:
        conn = self.conns.attach(client)
        ip = conn.ip if conn is not None else normalize_ip(str(client.peername[0]))
        if conn is None or self.registry.get(ip) is None:
            # Not a sandbox this gateway knows: refused with a reset (SO_LINGER 0 is set).
            self.stats.refused += 1
            client.error = f"unknown source address {ip}"
            return
        self.stats.connections += 1

    def client_disconnected(self, client: Any) -> None:
        self.conns.detach(client)

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        conn, entry = self.lookup(flow.client_conn)
        host, port = flow.request.host, flow.request.port
        self.stats.requests += 1
        if conn is None or entry is None:
            self.deny(flow, None, host, port, Decision(False, "unknown", "unknown sandbox"))
            return
        d, ip = await self.check(entry, host, port)
        if ip is None:
            self.deny(flow, entry, host, port, d)
            return
        conn.tunnel = Target(host=host, port=port, ip=ip)
        conn.pending[(host, port)] = ip
        conn.intercept = bool(entry.secrets_for(host))
        self.audit(entry, "egress.allow", f"{host}:{port}", "allowed", rule=d.rule, ip=str(ip), via="connect",
                   intercept=conn.intercept)

    async def tls_clienthello(self, data: Any) -> None:
        conn, entry = self.lookup(data.context.client)
        if conn is None or entry is None:
            data.ignore_connection = True
            return
        if conn.transparent and conn.tunnel is None:
            orig = data.context.server.address
            sni = data.client_hello.sni
            host = sni or str(orig[0])
            self.stats.requests += 1
            d, ip = await self.check(entry, host, int(orig[1]))
            if ip is None:
                self.stats.denied += 1
                self.audit(entry, "egress.deny", f"{host}:{orig[1]}", "denied", rule=d.rule, reason=d.reason)
                self.conns.abort(conn)
                data.ignore_connection = True
                return
            conn.tunnel = Target(host=host, port=int(orig[1]), ip=ip)
            conn.pending[(str(orig[0]), int(orig[1]))] = ip
            conn.intercept = bool(sni) and bool(entry.secrets_for(host))
            self.audit(entry, "egress.allow", f"{host}:{orig[1]}", "allowed", rule=d.rule, ip=str(ip),
                       via="transparent", intercept=conn.intercept)
        if conn.tunnel is not None and conn.intercept:
            data.ignore_connection = False
            # Upstream TLS is verified for the host the secret was matched against.
            data.context.server.sni = conn.tunnel.host
        else:
            data.ignore_connection = True

    # ---- requests ----------------------------------------------------------------------------------

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        conn, entry = self.lookup(flow.client_conn)
        if conn is None:
            return
        req = flow.request
        if entry is None:
            self.deny(flow, None, req.host, req.port, Decision(False, "unknown", "unknown sandbox"))
            return
        t = conn.tunnel
        if t is not None:
            # mitmproxy sends every request of a tunnel to the tunnel's host; the Host header must
            # name it too, or a shared front end could route the request (and the credential)
            # to another of its tenants.
            named = host_only(req.host_header) if req.host_header else t.host
            if named.lower().rstrip(".") != t.host.lower().rstrip("."):
                self.stats.denied += 1
                self.audit(entry, "egress.deny", f"{named}:{req.port}", "denied", rule="tunnel",
                           reason=f"request for {named} inside a tunnel to {t.host}")
                self.respond(flow, 421, f"SPACE egress: this connection goes to {t.host}, not {named}\n")
                return
            d = entry.egress.decide(t.host, t.port, [t.ip])
            if not d.allowed:
                self.deny(flow, entry, t.host, t.port, d)
                return
            if conn.intercept and flow.client_conn.tls_established:
                self.inject(flow, conn, entry, t.host)
            return
        # A plain-HTTP request: explicit proxy (absolute-form) or transparent (by Host header).
        host = host_only(req.host_header) if conn.transparent and req.host_header else req.host
        port = req.port
        self.stats.requests += 1
        d, ip = await self.check(entry, host, port)
        if ip is None:
            self.deny(flow, entry, host, port, d)
            return
        conn.pending[(req.host, port)] = ip
        self.audit(entry, "egress.allow", f"{host}:{port}", "allowed", rule=d.rule, ip=str(ip), via="http",
                   method=req.method)

    def inject(self, flow: http.HTTPFlow, conn: Conn, entry: Entry, host: str) -> None:
        secrets = entry.secrets_for(host)
        if not secrets:
            return
        target = f"{host}:{conn.tunnel.port if conn.tunnel else flow.request.port}"
        for s in secrets:
            if s.expired():
                self.stats.expired += 1
                self.audit(entry, "secret.expired", target, "denied", name=s.name, secret_id=s.secret_id)
                self.respond(flow, 403, f"SPACE credential {s.name} has expired\n")
                return
        for s in secrets:
            if not self.registry.take(conn.ip, s):
                self.stats.rate_limited += 1
                self.audit(entry, "secret.rate_limited", target, "denied", name=s.name, secret_id=s.secret_id,
                           rate_limit=s.rate_limit)
                self.respond(flow, 429, f"SPACE credential {s.name} is over its rate limit ({s.rate_limit}/min)\n",
                             **{"Retry-After": "60"})
                return
        for s in secrets:
            flow.request.headers[s.header] = s.value  # replaces whatever the sandbox sent
            self.audit(entry, "secret.inject", target, "injected", name=s.name, secret_id=s.secret_id,
                       header=s.header)
        self.stats.injected += 1
        flow.metadata["space_needles"] = needles_of(secrets)
        # Ask for an uncompressed answer: an echo of the secret is then redactable as it streams.
        if "accept-encoding" in flow.request.headers:
            flow.request.headers["accept-encoding"] = "identity"

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        resp = flow.response
        if resp is None or flow.metadata.get("space_generated"):
            return
        needles: list[bytes] | None = flow.metadata.get("space_needles")
        if not needles:
            resp.stream = True  # nothing to look at: never buffer
            return
        red = Redactor.of(needles)
        for name in list(resp.headers.keys()):
            values = resp.headers.get_all(name)
            redacted = [red.redact_text(v) for v in values]
            if redacted != values:
                resp.headers.set_all(name, redacted)
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        try:
            length: int | None = int(resp.headers.get("content-length", ""))
        except ValueError:
            length = None
        if encoding in ("", "identity") or (length is not None and length > MAX_BUFFERED):
            resp.stream = StreamRedactor(red, escapes=textual(resp.headers.get("content-type")))
        # else: buffered, redacted after decoding in ``response``

    def response(self, flow: http.HTTPFlow) -> None:
        resp = flow.response
        needles: list[bytes] | None = flow.metadata.get("space_needles")
        if resp is None or not needles or resp.stream or flow.metadata.get("space_generated"):
            return
        red = Redactor.of(needles)
        escapes = textual(resp.headers.get("content-type"))
        try:
            body = resp.get_content(strict=True) or b""
        except ValueError:
            resp.raw_content = red.mask(resp.raw_content or b"", escapes=escapes)
            return
        masked = red.mask(body, escapes=escapes)
        if masked != body:
            resp.set_content(masked)

    # ---- upstream connections ----------------------------------------------------------------------

    async def server_connect(self, data: Any) -> None:
        conn, entry = self.lookup(data.client)
        server = data.server
        if conn is None or entry is None or conn.denied:
            server.error = "SPACE egress: connection not allowed"
            return
        addr = (str(server.address[0]), int(server.address[1]))
        ip = conn.pending.pop(addr, None)
        t = conn.tunnel
        if ip is None and t is not None and (addr == (t.host, t.port) or conn.transparent):
            d = entry.egress.decide(t.host, t.port, [t.ip])
            if d.allowed:
                ip = t.ip
            else:
                self.stats.denied += 1
                self.audit(entry, "egress.deny", f"{t.host}:{t.port}", "denied", rule=d.rule, reason=d.reason)
                server.error = f"SPACE egress policy denied {t.host}:{t.port}: {d.reason}"
                return
        if ip is None:
            # Nothing decided this connection yet (raw TCP in transparent mode, a reconnect).
            self.stats.requests += 1
            d, ip = await self.check(entry, addr[0], addr[1])
            if ip is None:
                self.stats.denied += 1
                self.audit(entry, "egress.deny", f"{addr[0]}:{addr[1]}", "denied", rule=d.rule, reason=d.reason)
                server.error = f"SPACE egress policy denied {addr[0]}:{addr[1]}: {d.reason}"
                return
            self.audit(entry, "egress.allow", f"{addr[0]}:{addr[1]}", "allowed", rule=d.rule, ip=str(ip),
                       via="connect-time")
        conn.swapped[server.id] = addr
        server.address = (str(ip), addr[1])

    def _restore(self, data: Any) -> None:
        conn = self.conns.get(data.client.id)
        orig = conn.swapped.pop(data.server.id, None) if conn is not None else None
        if orig is not None:
            # mitmproxy matches reusable connections by the name: give it back once connected
            # (its setattr guard refuses any change on an open connection, hence object's).
            object.__setattr__(data.server, "address", orig)

    def server_connected(self, data: Any) -> None:
        self._restore(data)

    def server_connect_error(self, data: Any) -> None:
        self._restore(data)

    # ---- after a policy change ---------------------------------------------------------------------

    def recheck(self, entry: Entry) -> int:
        """Reset the sandbox's open tunnels that its (new) policy no longer allows."""
        n = 0
        for conn in self.conns.of_ip(entry.ip):
            t = conn.tunnel
            if t is None:
                continue
            d = entry.egress.decide(t.host, t.port, [t.ip])
            if not d.allowed:
                self.stats.denied += 1
                self.audit(entry, "egress.deny", f"{t.host}:{t.port}", "reset", rule=d.rule,
                           reason=f"policy changed: {d.reason}")
                self.conns.abort(conn)
                n += 1
        return n


def host_only(hostport: str) -> str:
    """``example.com:8080`` → ``example.com``; ``[2001:db8::1]:443`` → ``2001:db8::1``."""
    if hostport.startswith("["):
        return hostport[1:].split("]", 1)[0]
    return hostport.rsplit(":", 1)[0] if hostport.count(":") == 1 else hostport
