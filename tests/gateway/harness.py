"""The egress gateway as a real subprocess (from .venv-gateway), upstream test servers, clients.

Everything stays on loopback: two "sandboxes" are client sockets bound to 127.0.0.2 and
127.0.0.3; upstream servers listen on 127.0.0.1; names come from a hosts file, so nothing else
resolves and a broken test cannot reach the internet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import gzip
import http.client
import ipaddress
import json
import os
import random
import signal
import socket
import ssl
import struct
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
GATEWAY_PY = REPO / ".venv-gateway" / "bin" / "python"
SB1, SB2, STRANGER = "127.0.0.2", "127.0.0.3", "127.0.0.9"
HOSTS = {"api.test": "127.0.0.1", "evil.test": "127.0.0.1", "other.test": "127.0.0.1",
         "metadata.test": "169.254.169.254", "private.test": "10.1.2.3", "v6.test": "2001:db8::5"}
NAMES = ("api.test", "evil.test", "other.test")


def free_port(udp_too: bool = False) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not udp_too:
            return port
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            try:
                u.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


# ---- a test CA for the upstream servers ------------------------------------------------------------


@dataclasses.dataclass
class UpstreamPKI:
    ca_cert: Path
    leaf_cert: Path
    leaf_key: Path


def make_pki(d: Path) -> UpstreamPKI:
    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "upstream test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
          .not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in NAMES]
    sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api.test")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pki = UpstreamPKI(d / "upstream-ca.pem", d / "leaf.pem", d / "leaf-key.pem")
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.leaf_cert.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    pki.leaf_key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return pki


# ---- upstream servers ------------------------------------------------------------------------------


class EchoHandler(BaseHTTPRequestHandler):
    """``/echo``: JSON of what arrived. ``/echo-header?name=H``: that header's value echoed in the
    body (plain and inside JSON) and in a response header. ``/close``: answers with Connection:
    close. ``/bytes?n=N``: N bytes."""

    protocol_version = "HTTP/1.1"
    hits: list[dict[str, Any]]

    def setup(self) -> None:
        super().setup()
        # Like any real server: no Nagle (headers and body go out as separate writes).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        seen = {"method": self.command, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                "tls": isinstance(self.connection, ssl.SSLSocket)}
        self.server.hits.append(seen)  # type: ignore[attr-defined]
        extra: dict[str, str] = {}
        close = False
        if url.path == "/echo-header":
            value = self.headers.get(q.get("name", "authorization"), "")
            body = (f"plain:{value}\n" + json.dumps({"value": value}) + "\n").encode()
            extra["X-Echo"] = value
            if q.get("gzip"):  # compressed whatever the client asked for
                body = gzip.compress(body)
                extra["Content-Encoding"] = "gzip"
        elif url.path == "/bytes":
            body = b"x" * int(q.get("n", "0"))
        else:
            body = json.dumps(seen).encode()
            close = url.path == "/close"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra.items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)


class Upstream:
    def __init__(self, pki: UpstreamPKI | None) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), EchoHandler)
        self.server.daemon_threads = True
        self.server.hits = []  # type: ignore[attr-defined]
        if pki is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(pki.leaf_cert, pki.leaf_key)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def hits(self) -> list[dict[str, Any]]:
        return self.server.hits  # type: ignore[attr-defined, no-any-return]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- the gateway process ---------------------------------------------------------------------------


class Gateway:
    def __init__(self, root: Path, pki: UpstreamPKI, *, hosts: dict[str, str] | None = None,
                 transparent: bool = False, upstream_dns: str | None = None) -> None:
        self.root = root
        self.pki = pki
        root.mkdir(parents=True, exist_ok=True)
        self.hosts_file = root / "hosts.json"
        self.hosts_file.write_text(json.dumps(hosts or HOSTS))
        self.control = str(root / "control.sock")
        self.confdir = root / "conf"
        self.journal = root / "journal"
        self.log_path = root / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.proxy_port = self.dns_port = self.transparent_port = 0
        self.transparent = transparent
        #: A real resolver (``IP:PORT``) instead of the hosts file.
        self.upstream_dns = upstream_dns

    @property
    def ca_cert(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def start(self) -> None:
        self.proxy_port, self.dns_port = free_port(), free_port(udp_too=True)
        argv = [str(GATEWAY_PY), "-m", "space.gateway", "--proxy", f"127.0.0.1:{self.proxy_port}",
                "--dns", f"127.0.0.1:{self.dns_port}", "--control", self.control, "--confdir", str(self.confdir),
                "--journal", str(self.journal), "--upstream-ca", str(self.pki.ca_cert), "--test-allow-loopback"]
        argv += ["--upstream-dns", self.upstream_dns] if self.upstream_dns else ["--hosts-file", str(self.hosts_file)]
        if self.transparent:
            self.transparent_port = free_port()
            argv += ["--transparent", f"127.0.0.1:{self.transparent_port}"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(self._answers, 30, f"the gateway's control socket ({self.log_tail()})")

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"gateway exited with {self.proc.returncode}: {self.log_tail()}")
        try:
            ok = bool(self.ctl({"op": "stats"}).get("ok"))
        except OSError:
            return False
        # The control socket comes up first; the proxy must listen too.
        with socket.socket() as s:
            return ok and s.connect_ex(("127.0.0.1", self.proxy_port)) == 0

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def ctl(self, req: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(20)
            s.connect(self.control)
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        out: dict[str, Any] = json.loads(buf)
        return out

    def put(self, ip: str, policy: dict[str, Any], secrets: list[dict[str, Any]] | None = None,
            sandbox: str | None = None) -> None:
        r = self.ctl({"op": "put", "ip": ip, "sandbox": sandbox or f"sb-{ip.rsplit('.', 1)[1]}", "tenant": "t1",
                      "policy": policy, "secrets": secrets or []})
        assert r["ok"], r

    def audit(self, after: int = 0) -> list[dict[str, Any]]:
        r = self.ctl({"op": "audit", "after": after, "limit": 10000})
        assert r["ok"], r
        return list(r["records"])

    # ---- clients ------------------------------------------------------------------------------------

    def http(self, src: str, url: str, headers: dict[str, str] | None = None,
             timeout: float = 10) -> http.client.HTTPResponse:
        """A plain-HTTP request through the proxy (absolute-form), from ``src``."""
        conn = http.client.HTTPConnection("127.0.0.1", self.proxy_port, timeout=timeout, source_address=(src, 0))
        conn.request("GET", url, headers=headers or {})
        resp = conn.getresponse()
        resp.read_body = resp.read()  # type: ignore[attr-defined]
        conn.close()
        return resp

    def client_context(self) -> ssl.SSLContext:
        """Trusts both the upstream test CA (passthrough) and the SPACE CA (interception)."""
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_verify_locations(cafile=str(self.ca_cert))
        return ctx

    def https(self, src: str, host: str, port: int, path: str = "/echo", headers: dict[str, str] | None = None,
              timeout: float = 10) -> tuple[int, bytes, dict[str, str], str]:
        """GET over a CONNECT tunnel: (status, body, headers, issuer CN of the cert the client saw)."""
        conn = http.client.HTTPSConnection("127.0.0.1", self.proxy_port, timeout=timeout,
                                           source_address=(src, 0), context=self.client_context())
        conn.set_tunnel(host, port)
        try:
            conn.request("GET", path, headers=headers or {})
            resp = conn.getresponse()
            body = resp.read()
            assert conn.sock is not None
            issuer = issuer_cn(conn.sock)
            return resp.status, body, {k.lower(): v for k, v in resp.getheaders()}, issuer
        finally:
            conn.close()

    def connect(self, src: str, host: str, port: int, timeout: float = 10) -> tuple[socket.socket, int, bytes]:
        """A raw CONNECT: (socket, status, the rest of the answer)."""
        s = socket.create_connection(("127.0.0.1", self.proxy_port), timeout=timeout, source_address=(src, 0))
        s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head else 0
        return s, status, rest


def issuer_cn(sock: Any) -> str:
    der = sock.getpeercert(binary_form=True)
    cert = x509.load_der_x509_certificate(der)
    attrs = cert.issuer.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


@contextlib.contextmanager
def running_gateway(root: Path, pki: UpstreamPKI) -> Iterator[Gateway]:
    gw = Gateway(root, pki)
    try:
        gw.start()
        yield gw
    finally:
        gw.stop()


# ---- a tiny DNS client -----------------------------------------------------------------------------

QTYPES = {"A": 1, "AAAA": 28, "TXT": 16}
RCODES = {0: "NOERROR", 2: "SERVFAIL", 3: "NXDOMAIN", 5: "REFUSED"}


def dns_query(server: tuple[str, int], name: str, qtype: str = "A", src: str = SB1,
              tcp: bool = False) -> tuple[str, list[str]]:
    """(rcode, addresses) for one query sent from ``src``."""
    qid = random.randrange(65536)
    q = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    q += struct.pack("!HH", QTYPES[qtype], 1)
    if tcp:
        with socket.create_connection(server, timeout=5, source_address=(src, 0)) as s:
            s.sendall(struct.pack("!H", len(q)) + q)
            head = _recv_exact(s, 2)
            data = _recv_exact(s, struct.unpack("!H", head)[0])
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(5)
            s.bind((src, 0))
            s.sendto(q, server)
            data, _ = s.recvfrom(65536)
    rid, flags, _qd, an = struct.unpack("!HHHH", data[:8])
    assert rid == qid
    rcode = RCODES.get(flags & 0xF, str(flags & 0xF))
    pos = 12
    while data[pos]:
        pos += data[pos] + 1
    pos += 5
    addrs: list[str] = []
    for _ in range(an):
        if data[pos] & 0xC0 == 0xC0:
            pos += 2
        else:
            while data[pos]:
                pos += data[pos] + 1
            pos += 1
        rtype, _cls, _ttl, rdlen = struct.unpack("!HHIH", data[pos:pos + 10])
        pos += 10
        rdata = data[pos:pos + rdlen]
        pos += rdlen
        if rtype in (1, 28):
            addrs.append(str(ipaddress.ip_address(rdata)))
    return rcode, addrs


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def tcp_state(local: tuple[str, int]) -> str | None:
    """The state of the TCP socket bound to ``local`` (from /proc/net/tcp), None if there is none."""
    states = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
              "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}
    want = f"{socket.htonl(int(ipaddress.IPv4Address(local[0]))):08X}:{local[1]:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if parts[1] == want:
            return states.get(parts[3], parts[3])
    return None
