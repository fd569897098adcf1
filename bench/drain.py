#!/usr/bin/env python3
"""Draining a node: how long each sandbox's guest is frozen, and how long a move takes (issue 15).

Starts a cluster (1 API replica and 1 controller on PostgreSQL, 2 node agents joined over mutual
TLS, moto's S3: tests/e2e/cluster.py). For each workload, ``--per`` sandboxes are made on one node
(the other cordoned meanwhile), then that node is drained onto the other, one move at a time, and
back, ``--rounds`` times. Workloads:

- ``idle``: nothing but the probe;
- ``mem100``: a process holding 100 MB of touched random memory (it is in every checkpoint);
- ``disk1g``: 1 GB of random bytes written to the sandbox's disk before the first drain.

Every sandbox runs a probe: a Python loop that sleeps 10 ms and prints each wall-clock gap longer
than 50 ms it sees. A move freezes the guest from its checkpoint until the restore on the new node
runs it again: the longest gap a probe printed during a drain is the freeze *the guest saw*. Beside
it, per move, the controller's own timings (``moved`` event: checkpoint + upload, restore, total)
and the drain's wall time divided by the sandboxes it moved.

Target (issue 15): an idle sandbox's drain pauses its guest ≤ 2 s.

    sudo .venv/bin/python bench/drain.py [--per 3] [--rounds 2] [--workloads idle,mem100,disk1g]

Prints a markdown table and saves bench/results/<date>-drain.json and .md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.lifecycle import given, summary  # noqa: E402
from tests.e2e.cluster import cluster  # noqa: E402
from tests.e2e.harness import create_sandbox, run, wait_operation  # noqa: E402

MEMORY_MB = 512

PROBE = r"""
import os, sys, time
hold = os.urandom(int(sys.argv[1]) << 20) if int(sys.argv[1]) else b""
last = time.time()
while True:
    time.sleep(0.01)
    now = time.time()
    if now - last > 0.05:
        print(f"{now - last:.3f}", flush=True)
    last = now
"""

WORKLOADS: dict[str, dict[str, Any]] = {
    "idle": {"hold_mb": 0, "disk_mb": 0},
    "mem100": {"hold_mb": 100, "disk_mb": 0},
    "disk1g": {"hold_mb": 0, "disk_mb": 1024},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gaps(api: httpx.Client, sid: str, cid: str, *, listen: float = 1.0) -> list[float]:
    """Every gap the probe printed so far: its stream from the start, read for ``listen`` seconds
    after the last output (a running command's stream never ends; keepalives come meanwhile)."""
    out = b""
    quiet_since = time.monotonic()
    with api.stream("GET", f"/v1/sandboxes/{sid}/commands/{cid}/events", params={"after": 0},
                    timeout=httpx.Timeout(60, read=listen)) as r:
        r.raise_for_status()
        with contextlib.suppress(httpx.ReadTimeout):  # quiet for ``listen`` s: all there is for now
            for line in r.iter_lines():
                if line.startswith("data:") and '"data"' in line:
                    out += base64.b64decode(json.loads(line[5:])["data"])
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > listen:
                    break
    return [float(x) for x in out.split()]


def drain(api: httpx.Client, node: str) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    r = api.post(f"/v1/nodes/{node}/drain", json={"parallel": 1})
    r.raise_for_status()
    op = wait_operation(api, r.json()["operation"]["id"], timeout=3600)
    if op["status"] != "succeeded":
        raise RuntimeError(f"drain of {node}: {op}")
    return op, time.monotonic() - t0


def moved_timings(api: httpx.Client, sid: str, after: int) -> tuple[dict[str, float], int]:
    events = api.get(f"/v1/sandboxes/{sid}/events", params={"after": after}).json()["events"]
    moved = [e for e in events if e["kind"] == "moved"]
    if not moved:
        raise RuntimeError(f"{sid}: no moved event after {after}")
    return dict(moved[-1]["data"].get("timings") or {}), max(e["id"] for e in events)


def bench_workload(api: httpx.Client, name: str, per: int, rounds: int) -> dict[str, Any]:
    w = WORKLOADS[name]
    for n in ("node-b",):
        api.post(f"/v1/nodes/{n}/cordon").raise_for_status()
    sids: list[str] = []
    cids: dict[str, str] = {}
    try:
        for _ in range(per):
            sids.append(create_sandbox(api, memory_mb=MEMORY_MB, disk_mb=max(2048, 2 * w["disk_mb"])))
    finally:
        api.post("/v1/nodes/node-b/uncordon").raise_for_status()
    try:
        for sid in sids:
            api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/probe.py"}, content=PROBE.encode())
            if w["disk_mb"]:
                fill = f"head -c {w['disk_mb']}M /dev/urandom > /home/user/big && sync"
                code, _, err = run(api, sid, {"shell": fill})
                assert code == 0, err
            r = api.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": ["python3", "/tmp/probe.py", str(w["hold_mb"])]})
            r.raise_for_status()
            cids[sid] = r.json()["id"]
        log(f"{name}: {len(sids)} sandboxes on node-a, probes started")
        time.sleep(2)  # the probes are up (and hold their memory) before the first drain
        frozen: list[float] = []
        total: list[float] = []
        ckpt: list[float] = []
        restore: list[float] = []
        per_sandbox: list[float] = []
        cursors = dict.fromkeys(sids, 0)
        src, dst = "node-a", "node-b"
        for i in range(rounds):
            before = {sid: len(gaps(api, sid, cids[sid])) for sid in sids}
            log(f"{name}: round {i + 1}/{rounds}, draining {src} ...")
            _, wall = drain(api, src)
            per_sandbox.append(wall / len(sids))
            for sid in sids:
                t, cursors[sid] = moved_timings(api, sid, cursors[sid])
                total.append(t.get("total_s", 0.0))
                ckpt.append(t.get("checkpoint_and_upload_s", 0.0))
                restore.append(t.get("restore_s", 0.0))
                seen = gaps(api, sid, cids[sid])[before[sid]:]
                frozen.append(max(seen, default=0.0))
            api.post(f"/v1/nodes/{src}/uncordon").raise_for_status()
            src, dst = dst, src
        api.post(f"/v1/nodes/{src}/uncordon").raise_for_status()
        return {"workload": name, "moves": len(total), "guest_frozen_s": summary(frozen),
                "guest_frozen_max_s": max(frozen, default=0.0),
                "move_total_s": summary(total), "checkpoint_and_upload_s": summary(ckpt),
                "restore_s": summary(restore), "drain_wall_per_sandbox_s": summary(per_sandbox)}
    finally:
        for sid in sids:
            r = api.delete(f"/v1/sandboxes/{sid}")
            if r.status_code == 202:
                wait_operation(api, r.json()["operation"]["id"], timeout=300)


def render(res: dict[str, Any]) -> str:
    rows = ["| workload | moves | guest frozen, p50 / max (s) | move total p50 (s) | checkpoint + upload p50 (s) "
            "| restore p50 (s) | drain wall per sandbox p50 (s) | target |",
            "|---|---|---|---|---|---|---|---|"]
    for w in res["workloads"]:
        f = w["guest_frozen_s"]
        rows.append(f"| {w['workload']} | {w['moves']} | {f['p50']:.2f} / {w['guest_frozen_max_s']:.2f} | "
                    f"{w['move_total_s']['p50']:.2f} | {w['checkpoint_and_upload_s']['p50']:.2f} | "
                    f"{w['restore_s']['p50']:.2f} | {w['drain_wall_per_sandbox_s']['p50']:.2f} | "
                    + ("≤ 2 s frozen |" if w["workload"] == "idle" else "|"))
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="idle,mem100,disk1g")
    ap.add_argument("--out", type=Path, default=None, metavar="STEM",
                    help="save STEM.json and STEM.md (default: bench/results/<date>-drain)")
    args = ap.parse_args()
    res: dict[str, Any] = {"date": dt.date.today().isoformat(), "args": given(args), "workloads": []}
    import anyio

    from tests.conftest import _ensure_local_postgres
    from tests.store.conftest import reset_postgres

    url = _ensure_local_postgres()
    anyio.run(reset_postgres, url)
    with tempfile.TemporaryDirectory(prefix="space-bench-drain-") as tmp, \
            cluster(Path(tmp), url, apis=1, controllers=1, nodes=2) as cl:
        api = cl.client(0, timeout=600)
        try:
            for name in (w for w in args.workloads.split(",") if w):
                res["workloads"].append(bench_workload(api, name, args.per, args.rounds))
        except BaseException:
            # The deployment's logs go with its scratch directory: what they end with, first.
            for proc in (*cl.apis, *cl.controllers):
                log(f"--- {proc.name} log tail ---\n{proc.log_tail(6000)}")
            raise
        finally:
            api.close()
    table = render(res)
    print(table)
    out = args.out or REPO / "bench" / "results" / f"{res['date']}-drain"
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    log(f"saved {out}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
