#!/usr/bin/env python3
"""The replicated control plane against ``space serve``, in one run on one machine (issue 14).

Starts a ``space serve`` (SQLite, its own node over a unix socket) and a cluster (2 API replicas and
2 controllers on PostgreSQL, one node agent joined over mutual TLS, moto's S3: tests/e2e/cluster.py),
both with a warm pool of ``base``, and measures, alternating between them round by round:

- warm create → running, p50/p90/p99, through a replica vs through ``space serve`` (target: ≤ 1.3x);
- a burst of 20 and of 50 concurrent creates across both replicas with a full pool (p50/p95/p99,
  creates/s; CubeSandbox p95 90 ms / p99 137 ms at 50);
- an exec round trip (``true``, start → exit event) on the node API itself: over mutual TLS (the
  cluster's node, TCP) vs over the unix socket with a bearer token (serve's node) — the transport's
  cost (target: mTLS ≤ 1 ms more);
- leader failover: SIGKILL the leading controller, time until another holds the lease (≤ 5 s).

    sudo .venv/bin/python bench/cluster.py [--rounds 4] [--per-round 10] [--bursts 20,50] [--failovers 3]

Prints a markdown table and saves bench/results/<date>-cluster.json and .md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.lifecycle import given, pct, summary  # noqa: E402
from tests.e2e.cluster import Cluster, cluster  # noqa: E402
from tests.e2e.harness import Server, own_server, wait_operation  # noqa: E402

#: Every sandbox here is this size (serve and replica alike): 50 warm ones fit a node's pool budget.
MEMORY_MB = 256


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def set_pool(c: httpx.Client, size: int) -> int:
    """The pool at ``size``, or at the most the node's warm-pool memory budget allows; its size."""
    r = c.put("/v1/pools/base", json={"size": size, "memory_mb": MEMORY_MB})
    if r.status_code == 400 and "max_size" in r.json()["error"]:
        size = int(r.json()["error"]["max_size"])
        r = c.put("/v1/pools/base", json={"size": size, "memory_mb": MEMORY_MB})
    r.raise_for_status()
    return size


def ready(c: httpx.Client) -> int:
    pools = c.get("/v1/pools").json()["pools"]
    return sum(int(p["ready"]) for p in pools if p["template"] == "base" and p["memory_mb"] == MEMORY_MB)


def wait_ready(c: httpx.Client, n: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while ready(c) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the warm pool did not reach {n}: {c.get('/v1/pools').json()}")
        time.sleep(0.05)


def create(c: httpx.Client) -> tuple[float, str, bool]:
    t0 = time.perf_counter()
    r = c.post("/v1/sandboxes", json={"template": "base", "memory_mb": MEMORY_MB})
    if r.status_code not in (201, 202):
        raise RuntimeError(f"create: {r.status_code} {r.text}")
    if r.status_code == 202:
        op = wait_operation(c, r.json()["operation"]["id"], timeout=300)
        if op["status"] != "succeeded":
            raise RuntimeError(f"create: {op}")
    return (time.perf_counter() - t0) * 1000, r.json()["sandbox"]["id"], r.status_code == 201


def delete(c: httpx.Client, ids: list[str]) -> None:
    ops = []
    for sid in ids:
        r = c.delete(f"/v1/sandboxes/{sid}")
        if r.status_code == 202:
            ops.append(r.json()["operation"]["id"])
    for op in ops:
        wait_operation(c, op, timeout=300)


def warm_round(c: httpx.Client, n: int, pool: int) -> tuple[list[float], int]:
    out, cold = [], 0
    for _ in range(n):
        wait_ready(c, pool)
        ms, sid, warm = create(c)
        if warm:
            out.append(ms)
        else:
            cold += 1
        delete(c, [sid])
    return out, cold


def fill(c: httpx.Client, n: int, settle: float = 10.0) -> int:
    """Until ``n`` are ready or the pool stopped growing for ``settle`` s (a node keeps no more
    warm sandboxes than its memory holds); how many are ready."""
    best, since = ready(c), time.monotonic()
    while best < n and time.monotonic() - since < settle:
        time.sleep(0.1)
        now = ready(c)
        if now > best:
            best, since = now, time.monotonic()
    return best


def burst(clients: list[httpx.Client], k: int) -> dict[str, Any]:
    full = fill(clients[0], k)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(k) as ex:
        results = list(ex.map(lambda i: create(clients[i % len(clients)]), range(k)))
    wall = time.perf_counter() - t0
    lat = [r[0] for r in results]
    delete(clients[0], [r[1] for r in results])
    return {"burst": k, "pool_ready": full, "latency_ms": {**summary(lat), "p95": pct(lat, 0.95)},
            "served_warm": sum(r[2] for r in results), "creates_per_s": k / wall}


def exec_round_trips(node: httpx.Client, sid: str, n: int) -> list[float]:
    """``true`` started and its events read to their end (the exit event, then the stream's end), on
    one kept-alive connection, as the control plane's node client does. (Leaving a stream before its
    end closes the connection: the next call would pay a new handshake, which is measured apart.)"""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = node.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": ["true"], "user": "root"})
        r.raise_for_status()
        with node.stream("GET", f"/v1/sandboxes/{sid}/commands/{r.json()['id']}/events") as s:
            exited = False
            for line in s.iter_lines():
                exited = exited or line.startswith("event: exit")
            assert exited
        out.append((time.perf_counter() - t0) * 1000)
    return out


def new_connection_calls(make: Any, sid: str, n: int) -> list[float]:
    """A cheap node call on a connection of its own each time: the connection's setup (TCP + the
    mutual-TLS handshake, or a unix socket's connect) and one request."""
    out = []
    for _ in range(n):
        with make() as node:
            t0 = time.perf_counter()
            node.get(f"/v1/sandboxes/{sid}").raise_for_status()
            out.append((time.perf_counter() - t0) * 1000)
    return out


def serve_node_client(srv: Server) -> httpx.Client:
    from space.node.main import channel_dir_for

    token = (srv.data_dir / "node.token").read_text().strip()
    transport = httpx.HTTPTransport(uds=str(channel_dir_for(srv.data_dir) / "node.sock"))
    return httpx.Client(transport=transport, base_url="http://node", timeout=30,
                        headers={"authorization": f"Bearer {token}"})


def leader_failover(c: Cluster) -> float:
    from tests.e2e.test_cluster import _owner_pid, sql

    deadline = time.monotonic() + 60
    while True:
        rows = sql(c, "SELECT holder FROM leases WHERE name = 'leader'")
        try:
            holder = rows[0][0]
            pid = _owner_pid(c, holder)
            break
        except (AssertionError, IndexError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    victim = next(p for p in c.controllers if p.pid == pid)
    t0 = time.monotonic()
    victim.kill()
    while (sql(c, "SELECT holder FROM leases WHERE name = 'leader'") or [[holder]])[0][0] == holder:
        time.sleep(0.02)
    took = time.monotonic() - t0
    c.start_controller()
    return took


@contextlib.contextmanager
def deployments(work: Path) -> Iterator[tuple[Server, Cluster]]:
    import anyio

    from tests.conftest import _ensure_local_postgres
    from tests.store.conftest import reset_postgres

    url = _ensure_local_postgres()
    anyio.run(reset_postgres, url)
    with own_server(work / "serve") as srv, cluster(work / "cluster", url, nodes=1) as c:
        yield srv, c


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--bursts", default="20,50")
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--failovers", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, metavar="STEM",
                    help="save STEM.json and STEM.md (default: bench/results/<date>-cluster)")
    args = ap.parse_args()
    pool = 2
    res: dict[str, Any] = {"date": dt.date.today().isoformat(), "args": given(args)}
    with tempfile.TemporaryDirectory(prefix="space-bench-cluster-") as tmp:
        work = Path(tmp)
        (work / "serve").mkdir()
        (work / "cluster").mkdir()
        log("starting space serve and the cluster ...")
        with deployments(work) as (srv, cl):
            s = srv.client(timeout=600)
            a, b = cl.client(0, timeout=600), cl.client(1, timeout=600)
            try:
                set_pool(s, pool)
                set_pool(a, pool)
                serve_ms: list[float] = []
                replica_ms: list[float] = []
                rounds = []
                for i in range(args.rounds):
                    log(f"warm round {i + 1}/{args.rounds}")
                    sv, _ = warm_round(s, args.per_round, pool)
                    rp, _ = warm_round(a if i % 2 == 0 else b, args.per_round, pool)
                    serve_ms += sv
                    replica_ms += rp
                    rounds.append({"serve_p50": statistics.median(sv) if sv else None,
                                   "replica_p50": statistics.median(rp) if rp else None})
                sw, rw = summary(serve_ms), summary(replica_ms)
                res["warm"] = {"serve_sqlite_ms": sw, "replica_postgres_ms": rw, "rounds": rounds,
                               "ratio_p50": rw["p50"] / sw["p50"], "ratio_p90": rw["p90"] / sw["p90"]}
                set_pool(s, 0)

                res["bursts"] = []
                for k in (int(x) for x in args.bursts.split(",") if x):
                    log(f"burst of {k} across both replicas ...")
                    set_pool(a, k)
                    res["bursts"].append(burst([a, b], k))
                set_pool(a, 0)

                log("exec round trips on the node API: mutual TLS vs unix socket ...")
                _, sid_c, _ = create(a)
                _, sid_s, _ = create(s)
                with cl.node_client(cl.nodes[0]) as tls_node, serve_node_client(srv) as sock_node:
                    tls, sock, via_replica, tls_new, sock_new = [], [], [], [], []
                    for _ in range(max(1, args.execs // 10)):  # alternating blocks of ten
                        tls += exec_round_trips(tls_node, sid_c, 10)
                        sock += exec_round_trips(sock_node, sid_s, 10)
                        via_replica += exec_round_trips(b, sid_c, 10)
                        tls_new += new_connection_calls(lambda: cl.node_client(cl.nodes[0]), sid_c, 10)
                        sock_new += new_connection_calls(lambda: serve_node_client(srv), sid_s, 10)
                delete(a, [sid_c])
                delete(s, [sid_s])
                t, u, v = summary(tls), summary(sock), summary(via_replica)
                tn, un = summary(tls_new), summary(sock_new)
                res["exec_node_api"] = {"mtls_tcp_ms": t, "unix_socket_ms": u,
                                        "mtls_extra_p50_ms": t["p50"] - u["p50"],
                                        "via_replica_ms": v, "replica_extra_p50_ms": v["p50"] - t["p50"],
                                        "new_connection_mtls_ms": tn, "new_connection_unix_ms": un}

                log("leader failover ...")
                res["leader_failover_s"] = [round(leader_failover(cl), 3) for _ in range(args.failovers)]
            finally:
                for c in (s, a, b):
                    c.close()
    out = args.out or REPO / "bench" / "results" / f"{res['date']}-cluster"
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    md = render(res)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


def render(res: dict[str, Any]) -> str:
    w = res["warm"]
    rows = ["| metric | p50 | p90 | p99 | baseline (same run) | ratio / target |", "|---|---|---|---|---|---|"]
    r, sv = w["replica_postgres_ms"], w["serve_sqlite_ms"]
    rows.append(f"| warm create → running via replica, PostgreSQL (ms) | {r['p50']:.1f} | {r['p90']:.1f} | "
                f"{r['p99']:.1f} | serve on SQLite {sv['p50']:.1f} / {sv['p90']:.1f} / {sv['p99']:.1f} | "
                f"{w['ratio_p50']:.2f}x p50 (≤ 1.3) |")
    for bst in res["bursts"]:
        lat = bst["latency_ms"]
        rows.append(f"| {bst['burst']} concurrent creates, pool {bst['pool_ready']} ready (ms) | {lat['p50']:.1f} | "
                    f"p95 {lat['p95']:.1f} | {lat['p99']:.1f} | {bst['served_warm']}/{bst['burst']} warm, "
                    f"{bst['creates_per_s']:.1f}/s | CubeSandbox p95 90 / p99 137 at 50 |")
    e = res["exec_node_api"]
    rows.append(f"| exec `true` on the node API over mutual TLS (ms) | {e['mtls_tcp_ms']['p50']:.2f} | "
                f"{e['mtls_tcp_ms']['p90']:.2f} | {e['mtls_tcp_ms']['p99']:.2f} | unix socket "
                f"{e['unix_socket_ms']['p50']:.2f} | {e['mtls_extra_p50_ms']:+.2f} ms p50 (≤ 1) |")
    if "via_replica_ms" in e:
        v, tn, un = e["via_replica_ms"], e["new_connection_mtls_ms"], e["new_connection_unix_ms"]
        rows.append(f"| exec `true` through a replica to that node (ms) | {v['p50']:.2f} | {v['p90']:.2f} | "
                    f"{v['p99']:.2f} | on the node directly {e['mtls_tcp_ms']['p50']:.2f} | "
                    f"{e['replica_extra_p50_ms']:+.2f} ms p50 |")
        rows.append(f"| a node call on a new connection, mutual TLS (ms) | {tn['p50']:.2f} | {tn['p90']:.2f} | "
                    f"{tn['p99']:.2f} | unix socket {un['p50']:.2f} | {tn['p50'] - un['p50']:+.2f} ms p50 |")
    f = res["leader_failover_s"]
    rows.append(f"| leader failover after SIGKILL (s) | {statistics.median(f):.2f} | max {max(f):.2f} | | "
                f"{len(f)} runs | ≤ 5 (OpenComputer < 15) |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
