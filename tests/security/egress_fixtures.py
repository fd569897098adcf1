"""Test hosts for the egress probes, all on this machine: a DNS server that counts what it is asked,
TCP listeners on the node's own addresses, and a stand-in "metadata" host in a namespace of our own.

- :class:`CountingDns` is the gateway's upstream resolver (UDP and TCP on 127.0.0.1): it answers the
  names it is given and NXDOMAIN for every other, and records every question. "A denied name never
  reached upstream DNS" is then a count the test reads.
- :class:`NodeListener` accepts TCP on ``0.0.0.0:P`` and ``[::]:P`` (every address of the node, v4 and
  v6) and records every connection: whatever reaches it reached the node.
- :func:`metadata_host` makes a network namespace holding 169.254.169.254 and fd00:ec2::254 (this
  kernel has no ``dummy`` link type: they sit on the namespace's end of a veth pair), routes just
  those two addresses into it, and runs an HTTP server there that records every request: even a
  broken block sends nothing off the machine, and "the stand-in received nothing" is a fact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.waiting import wait_for

# ---- a counting DNS server -------------------------------------------------------------------------


def _qname(msg: bytes) -> tuple[str, int, int]:
    """(name, qtype, end of the question) of a query's first question."""
    pos, labels = 12, []
    while msg[pos]:
        n = msg[pos]
        labels.append(msg[pos + 1:pos + 1 + n].decode(errors="replace"))
        pos += n + 1
    qtype = struct.unpack("!H", msg[pos + 1:pos + 3])[0]
    return ".".join(labels).lower(), qtype, pos + 5


def _udp_and_tcp_on_one_port(attempts: int = 50) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket bound to the same free loopback port (DNS answers on both). The
    kernel picks the UDP port; that TCP port may be taken by someone else (CI ran into it), so
    another pair is tried."""
    for _ in range(attempts):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        tcp = socket.socket()
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            tcp.bind(("127.0.0.1", udp.getsockname()[1]))
        except OSError:
            udp.close()
            tcp.close()
            continue
        return udp, tcp
    raise RuntimeError(f"no loopback port free for both UDP and TCP in {attempts} tries")


class CountingDns:
    """Answers ``names`` (A records) and NXDOMAIN for the rest; ``asked`` lists every question.
    ``silent``: records and never answers (a slow upstream: every lookup stays in flight)."""

    def __init__(self, names: dict[str, str], *, silent: bool = False) -> None:
        self.names = {k.lower(): v for k, v in names.items()}
        self.silent = silent
        self.asked: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self.udp, self.tcp = _udp_and_tcp_on_one_port()
        self.port = int(self.udp.getsockname()[1])
        self.tcp.listen(16)
        self._stop = False
        for target in (self._serve_udp, self._serve_tcp):
            threading.Thread(target=target, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def questions(self, needle: str) -> list[tuple[str, int]]:
        with self._lock:
            return [q for q in self.asked if needle.lower() in q[0]]

    def answer(self, msg: bytes) -> bytes:
        name, qtype, end = _qname(msg)
        with self._lock:
            self.asked.append((name, qtype))
        addr = self.names.get(name)
        flags = 0x8180 | (0 if addr is not None else 3)  # QR RD RA, NOERROR or NXDOMAIN
        answers = b""
        if addr is not None and qtype == 1:
            answers = struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + ipaddress.IPv4Address(addr).packed
        head = msg[:2] + struct.pack("!HHHHH", flags, 1, 1 if answers else 0, 0, 0)
        return head + msg[12:end] + answers

    def _serve_udp(self) -> None:
        while not self._stop:
            try:
                msg, peer = self.udp.recvfrom(4096)
                out = self.answer(msg)
                if not self.silent:
                    self.udp.sendto(out, peer)
            except (OSError, IndexError, struct.error):
                if self._stop:
                    return

    def _serve_tcp(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5)
                    n = struct.unpack("!H", _recv(conn, 2))[0]
                    out = self.answer(_recv(conn, n))
                    conn.sendall(struct.pack("!H", len(out)) + out)
                except (OSError, IndexError, struct.error, ConnectionError):
                    pass

    def close(self) -> None:
        self._stop = True
        self.udp.close()
        self.tcp.close()


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


# ---- listeners on the node -------------------------------------------------------------------------


class NodeListener:
    """TCP on ``0.0.0.0:port`` and ``[::]:port`` (v6 only); every accepted connection is recorded and
    answered with a small HTTP 200 whose body is ``node-listener``."""

    def __init__(self) -> None:
        while True:  # one port free on both families
            self.v6 = socket.socket(socket.AF_INET6)
            self.v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            self.v6.bind(("::", 0))
            self.port = int(self.v6.getsockname()[1])
            self.v4 = socket.socket()
            try:
                self.v4.bind(("0.0.0.0", self.port))
                break
            except OSError:
                self.v4.close()
                self.v6.close()
        self.hits: list[tuple[str, str]] = []  # (peer, local address)
        self._lock = threading.Lock()
        for s in (self.v4, self.v6):
            s.listen(64)
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s: socket.socket) -> None:
        while True:
            try:
                conn, peer = s.accept()
            except OSError:
                return
            with self._lock:
                self.hits.append((str(peer[0]), str(conn.getsockname()[0])))
            with contextlib.suppress(OSError):
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 13\r\n\r\nnode-listener")
            conn.close()

    def seen(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.hits)

    def close(self) -> None:
        for s in (self.v4, self.v6):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def node_addresses() -> tuple[list[str], list[str]]:
    """The node's own non-loopback addresses: (IPv4 from the FIB, IPv6 from /proc/net/if_inet6)."""
    v4: list[str] = []
    last = None
    for line in Path("/proc/net/fib_trie").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "|--":
            last = parts[1]
        elif last and "/32 host LOCAL" in line and not last.startswith("127."):
            v4.append(last)
    v6: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            raw = line.split()[0]
            addr = ipaddress.IPv6Address(bytes.fromhex(raw))
            if not addr.is_loopback:
                v6.append(str(addr))
    return sorted(set(v4)), sorted(set(v6))


# ---- the stand-in metadata host --------------------------------------------------------------------

META_V4, META_V6 = "169.254.169.254", "fd00:ec2::254"
#: A public-looking upstream (documentation range) that lives in the stand-in's namespace too, so
#: that an allowed connection also stays on this machine.
UPSTREAM_V4 = "198.51.100.7"

_STAND_IN = r"""
import json, socket, socketserver, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
hits = sys.argv[1]
lock = threading.Lock()
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        with lock, open(hits, "a") as f:
            f.write(json.dumps({"local": self.connection.getsockname()[0], "path": self.path}) + "\n")
        body = b"metadata-stand-in"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
class V4(ThreadingHTTPServer):
    def server_bind(self):  # HTTPServer's would look the address up in DNS (there is none here)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "stand-in", self.server_address[1]
class V6(V4):
    address_family = socket.AF_INET6
servers = [V4(("169.254.169.254", 80), H), V6(("fd00:ec2::254", 80), H), V4(("198.51.100.7", 80), H)]
for s in servers:
    s.daemon_threads = True
    threading.Thread(target=s.serve_forever, daemon=True).start()
open(hits, "a").close()
threading.Event().wait()
"""


@dataclasses.dataclass
class StandIn:
    netns: str
    hits_file: Path
    #: The namespace's own link address: a harmless address on this machine to dial.
    link: str

    def hits(self, local: str | None = None) -> list[dict[str, Any]]:
        try:
            out = [json.loads(x) for x in self.hits_file.read_text().splitlines() if x.strip()]
        except FileNotFoundError:
            return []
        return [h for h in out if local is None or h["local"] == local]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _route_free(net: str, family: str) -> bool:
    return _ip(family, "route", "show", net, check=False).stdout.strip() == ""


@contextlib.contextmanager
def metadata_host(root: Path) -> Iterator[StandIn]:
    """The stand-in: its two addresses routed into a namespace of ours for as long as it runs."""
    tag = secrets.token_hex(2)
    netns, host_if = f"spmeta-{tag}", f"spm{tag}"
    link = ("10.250.254.1", "10.250.254.2")  # the veth's own /30, on this machine only
    link6 = ("fd5e:ec2:ffff::1", "fd5e:ec2:ffff::2")
    root.mkdir(parents=True, exist_ok=True)
    stand = StandIn(netns=netns, hits_file=root / "meta-hits.jsonl", link=link[1])
    proc: subprocess.Popen[bytes] | None = None
    routed: list[tuple[str, str]] = []
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("addr", "add", f"{link[0]}/30", "dev", host_if)
        _ip("-6", "addr", "add", f"{link6[0]}/64", "dev", host_if, "nodad")
        _ip("link", "set", host_if, "up")
        for args in (("addr", "add", f"{link[1]}/30", "dev", "eth0"),
                     ("addr", "add", f"{META_V4}/32", "dev", "eth0"),
                     ("addr", "add", f"{UPSTREAM_V4}/32", "dev", "eth0"),
                     ("-6", "addr", "add", f"{link6[1]}/64", "dev", "eth0", "nodad"),
                     ("-6", "addr", "add", f"{META_V6}/128", "dev", "eth0", "nodad"),
                     ("link", "set", "eth0", "up"), ("link", "set", "lo", "up"),
                     ("route", "add", "default", "via", link[0]),
                     ("-6", "route", "add", "default", "via", link6[0])):
            _ip("-n", netns, *args)
        # Another test may route the same stand-in address for a while (tests/e2e/netlab.py): wait.
        for net, family, via in ((f"{META_V4}/32", "-4", link[1]), (f"{UPSTREAM_V4}/32", "-4", link[1]),
                                 (f"{META_V6}/128", "-6", link6[1])):
            wait_for(lambda n=net, f=family: _route_free(n, f), 600, f"the route to {net} to be free")
            _ip(family, "route", "add", net, "via", via, "dev", host_if)
            routed.append((net, family))
        log = open(root / "meta.log", "ab")  # noqa: SIM115 -- owned by the child
        proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", _STAND_IN, str(stand.hits_file)],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        wait_for(stand.hits_file.exists, 30, "the metadata stand-in")
        yield stand
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for net, family in routed:
            _ip(family, "route", "del", net, "dev", host_if, check=False)
        _ip("netns", "del", netns, check=False)
        _ip("link", "del", host_if, check=False)
