#!/usr/bin/env python3
"""Egress gateway benchmark (issue 5): what going through the gateway costs a sandbox's requests.

Everything on loopback, in one run: a local upstream (HTTP and HTTPS, the tests' echo server), the
gateway as a subprocess from .venv-gateway, clients bound to 127.0.0.2 (a registered "sandbox").
Each request kind is measured direct to the upstream and through the gateway, interleaved request
by request so both see the same machine noise:

- ``http``: plain HTTP on a kept-alive connection (absolute-form through the explicit proxy);
- ``tls``: HTTPS on a kept-alive connection (through the gateway: a CONNECT tunnel passed through);
- ``tls_inject``: the same with a secret for the host: TLS intercepted, header injected, the
  response redacted as it streams;
- ``*_new``: a new connection per request (TCP + TLS handshake included);
- ``throughput``: one large body, MB/s, direct vs each gateway path.

    bench/gateway.py [--quick] [--n 300] [--mb 64]      (or: bench/run --only gateway)
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import ssl
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lifecycle import summary  # noqa: E402
from tests.gateway.harness import SB1, Gateway, Upstream, make_pki  # noqa: E402

PARTS = ("gateway",)
TOKEN = "Bearer sk-bench-0123456789abcdef"


class Clients:
    def __init__(self, gw: Gateway, up: Upstream, ups: Upstream) -> None:
        self.gw, self.up, self.ups = gw, up, ups
        self.direct_ctx = ssl.create_default_context(cafile=str(gw.pki.ca_cert))
        self.gw_ctx = gw.client_context()

    def http_direct(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.up.port, timeout=30, source_address=(SB1, 0))

    def http_gw(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.gw.proxy_port, timeout=30, source_address=(SB1, 0))

    def tls_direct(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.ups.port, timeout=30, source_address=(SB1, 0),
                                           context=self.direct_ctx)

    def tls_gw(self, host: str) -> http.client.HTTPSConnection:
        c = http.client.HTTPSConnection("127.0.0.1", self.gw.proxy_port, timeout=30, source_address=(SB1, 0),
                                        context=self.gw_ctx)
        c.set_tunnel(host, self.ups.port)
        return c


def _get(conn: http.client.HTTPConnection, path: str) -> int:
    conn.request("GET", path)
    resp = conn.getresponse()
    n = 0
    while chunk := resp.read(1 << 20):
        n += len(chunk)
    if resp.status != 200:
        raise RuntimeError(f"GET {path}: {resp.status}")
    return n


def _latency(variants: dict[str, tuple[Callable[[], http.client.HTTPConnection], str]], n: int,
             reuse: bool) -> dict[str, list[float]]:
    """Per variant, ms per request; variants interleaved request by request."""
    conns: dict[str, http.client.HTTPConnection] = {}
    out: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for k, (make, path) in variants.items():  # warm-up (and the kept-alive connections)
            c = make()
            _get(c, path)
            if reuse:
                conns[k] = c
            else:
                c.close()
        for _ in range(n):
            for k, (make, path) in variants.items():
                t0 = time.perf_counter()
                c = conns[k] if reuse else make()
                _get(c, path)
                if not reuse:
                    c.close()
                out[k].append((time.perf_counter() - t0) * 1000)
    finally:
        for c in conns.values():
            c.close()
    return out


def _throughput(make: Callable[[], http.client.HTTPConnection], path: str, nbytes: int, reps: int) -> float:
    best = 0.0
    for _ in range(reps):
        c = make()
        t0 = time.perf_counter()
        got = _get(c, path)
        secs = time.perf_counter() - t0
        c.close()
        if got != nbytes:
            raise RuntimeError(f"got {got} bytes, wanted {nbytes}")
        best = max(best, nbytes / secs / 1e6)
    return best


def run_all(*, quick: bool = False, n: int | None = None, mb: int | None = None,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    n = n or (50 if quick else 300)
    mb = mb or (16 if quick else 64)
    with tempfile.TemporaryDirectory(prefix="space-gw-bench-") as tmp:
        root = Path(tmp)
        pki = make_pki(root / "pki")
        up, ups = Upstream(None), Upstream(pki)
        gw = Gateway(root / "gw", pki)
        try:
            gw.start()
            # other.test gets a secret (intercepted); api.test none (passed through).
            gw.put(SB1, {"allow": ["127.0.0.0/8", "api.test", "other.test"]},
                     [{"name": "bench", "secret_id": "s-bench", "hosts": ["other.test"], "header": "Authorization",
                       "value": TOKEN, "expires_at": None, "rate_limit": None}])
            cl = Clients(gw, up, ups)
            http_url = f"http://api.test:{up.port}/echo"
            log(f"gateway: latency, kept-alive connections (n={n}) ...")
            keep = _latency({"http_direct": (cl.http_direct, "/echo"), "http_gw": (cl.http_gw, http_url),
                             "tls_direct": (cl.tls_direct, "/echo"),
                             "tls_gw": (lambda: cl.tls_gw("api.test"), "/echo"),
                             "tls_inject_gw": (lambda: cl.tls_gw("other.test"), "/echo")}, n, reuse=True)
            log(f"gateway: latency, a new connection per request (n={n // 2}) ...")
            fresh = _latency({"http_new_direct": (cl.http_direct, "/echo"), "http_new_gw": (cl.http_gw, http_url),
                              "tls_new_direct": (cl.tls_direct, "/echo"),
                              "tls_new_gw": (lambda: cl.tls_gw("api.test"), "/echo"),
                              "tls_inject_new_gw": (lambda: cl.tls_gw("other.test"), "/echo")},
                             max(10, n // 2), reuse=False)
            nbytes = mb * 1_000_000
            big = f"/bytes?n={nbytes}"
            reps = 2 if quick else 3
            log(f"gateway: throughput, {mb} MB bodies ...")
            tput = {
                "http_direct": _throughput(cl.http_direct, big, nbytes, reps),
                "http_gw": _throughput(cl.http_gw, f"http://api.test:{up.port}{big}", nbytes, reps),
                "tls_direct": _throughput(cl.tls_direct, big, nbytes, reps),
                "tls_gw": _throughput(lambda: cl.tls_gw("api.test"), big, nbytes, reps),
                "tls_inject_gw": _throughput(lambda: cl.tls_gw("other.test"), big, nbytes, reps),
            }
            stats = gw.ctl({"op": "stats"})
        finally:
            gw.stop()
            up.close()
            ups.close()
    lat = {k: summary(v) for k, v in {**keep, **fresh}.items()}
    return {"latency_ms": lat, "throughput_mb_s": tput, "n": n, "mb": mb,
            "gateway_stats": {k: stats.get(k) for k in ("requests", "injected", "bytes", "denied")}}


ROWS = (
    ("http", "plain HTTP, kept-alive (ms)", "http_direct", "http_gw"),
    ("tls", "HTTPS via CONNECT, passthrough, kept-alive (ms)", "tls_direct", "tls_gw"),
    ("tls_inject", "HTTPS via CONNECT, intercepted + injected, kept-alive (ms)", "tls_direct", "tls_inject_gw"),
    ("http_new", "plain HTTP, new connection (ms)", "http_new_direct", "http_new_gw"),
    ("tls_new", "HTTPS via CONNECT, passthrough, new connection (ms)", "tls_new_direct", "tls_new_gw"),
    ("tls_inject_new", "HTTPS via CONNECT, intercepted + injected, new connection (ms)", "tls_new_direct",
     "tls_inject_new_gw"),
)


def table_rows(res: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rows for bench/run's table (metric | p50 | p90 | p99 | n | baseline p50 | ratio) and notes."""
    rows: list[str] = []
    lat = res["latency_ms"]
    for _, label, base, key in ROWS:
        s, b = lat[key], lat[base]
        rows.append(f"| gateway: {label} | {s['p50']:.2f} | {s['p90']:.2f} | {s['p99']:.2f} | {s['n']} "
                    f"| {b['p50']:.2f} (direct) | {s['p50'] / b['p50']:.2f} |")
    tp = res["throughput_mb_s"]
    for key, base, label in (("http_gw", "http_direct", "plain HTTP"), ("tls_gw", "tls_direct", "HTTPS passthrough"),
                             ("tls_inject_gw", "tls_direct", "HTTPS intercepted + redacted")):
        rows.append(f"| gateway: {label} download, {res['mb']} MB (MB/s) | {tp[key]:.0f} | | | best of runs "
                    f"| {tp[base]:.0f} (direct) | {tp[key] / tp[base]:.2f} |")
    notes = ["Gateway: loopback, upstream = Python's ThreadingHTTPServer (the same for direct and gateway); "
             "client = http.client bound to a registered sandbox address; requests interleaved."]
    return rows, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=None, help="requests per variant")
    ap.add_argument("--mb", type=int, default=None, help="body size for throughput")
    args = ap.parse_args()
    res = {"date": dt.datetime.now(dt.UTC).isoformat(), "parts": list(PARTS), "quick": args.quick,
           "gateway": run_all(quick=args.quick, n=args.n, mb=args.mb,
                              log=lambda m: print(m, file=sys.stderr, flush=True))}
    rows, notes = table_rows(res["gateway"])
    md = "\n".join(["| metric | p50 | p90 | p99 | n | baseline p50 | ratio |", "|---|---|---|---|---|---|---|",
                    *rows, "", *[f"- {n}" for n in notes]])
    print(md)
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat() + "-gateway" + ("-quick" if args.quick else "")
    (out / f"{stamp}.json").write_text(json.dumps(res, indent=2))
    (out / f"{stamp}.md").write_text(md + "\n")
    print(f"\nsaved bench/results/{stamp}.json and .md")


if __name__ == "__main__":
    main()
