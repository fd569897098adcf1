"""The lab's upstream server (run inside the lab's network namespace by tests/e2e/netlab.py).

HTTP on :80 and HTTPS on :443 on every address of the namespace. ``/echo``: what arrived, as JSON
(headers included, so an injected secret would come straight back: the gateway must redact it).
Every request is appended to the hits file with the local address it arrived at.
"""

from __future__ import annotations

import argparse
import json
import signal
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_lock = threading.Lock()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hits", required=True)
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    args = ap.parse_args()
    hits = Path(args.hits)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *a: Any) -> None:
            pass

        def do_GET(self) -> None:
            seen = {"local": self.connection.getsockname()[0], "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "tls": isinstance(self.connection, ssl.SSLSocket)}
            with _lock, hits.open("a") as f:
                f.write(json.dumps(seen) + "\n")
            body = json.dumps(seen).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    plain = ThreadingHTTPServer(("0.0.0.0", 80), Handler)
    tls = ThreadingHTTPServer(("0.0.0.0", 443), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.cert, args.key)
    tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
    for srv in (plain, tls):
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    hits.touch()  # the readiness signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.pause()


if __name__ == "__main__":
    main()
