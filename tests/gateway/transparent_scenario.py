"""Transparent mode, run inside a private network namespace (``unshare -n``) by test_transparent.py.

nftables there redirects the "sandbox's" (127.0.0.2) TCP to the upstream ports into the gateway's
transparent port, as the node's rules will; the gateway learns the original destination with
SO_ORIGINAL_DST and the name from the Host header or the TLS SNI. Prints one JSON object of results.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gateway.harness import SB1, Gateway, Upstream, issuer_cn, make_pki

TOKEN = "Bearer sk-transparent-0123456789"


def http_get(dst: tuple[str, int], host: str) -> tuple[int, bytes]:
    with socket.create_connection(dst, timeout=10, source_address=(SB1, 0)) as s:
        s.sendall(f"GET /echo HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


def tls_get(gw: Gateway, dst: tuple[str, int], sni: str) -> dict[str, Any]:
    try:
        with socket.create_connection(dst, timeout=10, source_address=(SB1, 0)) as raw, \
                gw.client_context().wrap_socket(raw, server_hostname=sni) as s:
            issuer = issuer_cn(s)
            s.sendall(f"GET /echo HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        body = json.loads(data.partition(b"\r\n\r\n")[2])
        return {"status": int(data.split(b" ", 2)[1]), "issuer": issuer, "headers": body["headers"]}
    except (OSError, ssl.SSLError) as e:
        return {"error": type(e).__name__}


def main(root: Path) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    pki = make_pki(root / "pki")
    up, ups = Upstream(None), Upstream(pki)
    gw = Gateway(root / "gw", pki, transparent=True)
    out: dict[str, Any] = {}
    try:
        gw.start()
        rules = (f"table ip space_test {{\n chain out {{\n  type nat hook output priority -100;\n"
                 f"  ip saddr {SB1} tcp dport {{ {up.port}, {ups.port} }} redirect to :{gw.transparent_port}\n"
                 " }\n}\n")
        subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True)
        gw.put(SB1, {"allow": ["127.0.0.0/8", "api.test", "other.test"], "deny": ["evil.test"]},
               [{"name": "tok", "secret_id": "s1", "hosts": ["other.test"], "header": "Authorization",
                 "value": TOKEN}])
        out["http_allowed"] = http_get(("127.0.0.1", up.port), f"api.test:{up.port}")[0]
        out["http_denied"] = http_get(("127.0.0.1", up.port), "evil.test")
        out["http_denied"] = [out["http_denied"][0], out["http_denied"][1].decode()]
        out["tls_passthrough"] = tls_get(gw, ("127.0.0.1", ups.port), "api.test")
        out["tls_intercepted"] = tls_get(gw, ("127.0.0.1", ups.port), "other.test")
        out["tls_denied"] = tls_get(gw, ("127.0.0.1", ups.port), "evil.test")
        # The sandbox dials an address where nothing listens, naming api.test: the gateway goes
        # where *it* resolved api.test, never to the address the sandbox picked.
        out["tls_sni_elsewhere"] = tls_get(gw, ("127.0.0.7", ups.port), "api.test")
        out["audit"] = [(r["action"], r["target"], r["details"].get("via")) for r in gw.audit()]
    finally:
        gw.stop()
        up.close()
        ups.close()
        out["log"] = gw.log_tail(3000)
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
