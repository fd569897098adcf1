#!/usr/bin/env python3
"""Continuous disk backup: bytes shipped against bytes the guest changed, the recovery point age,
and the guest freeze a backup costs (issue 15).

A ``space serve`` of its own (SQLite, a local directory object store). Two sandboxes run the same
agent-like workload side by side, one backed up every ``--every`` seconds, the other not (the
same-run baseline for the freeze). The workload, one phase a minute:

- ``install``: a package tree copied into the home directory (``/usr/lib/python3*``: thousands of
  small files, what a ``pip install`` leaves);
- ``clone``: 400 files of 8 KiB random bytes and one 20 MB archive of them (a ``git clone``);
- ``edits``: 30 files appended to every two seconds (an agent editing code).

Each sandbox runs a probe printing every wall-clock gap over 20 ms it sees (a sleep of 5 ms
between looks): the longest gaps of the backed-up one against the baseline's are what a backup
costs the guest. The row's ``backup`` is read every 2 s (``rpo_s``, ``links``); the node's own
report gives the bytes shipped. Targets: backup traffic ≤ 2x the bytes the guest changed; disk RPO
≤ 60 s under the default interval.

    sudo .venv/bin/python bench/backup.py [--every 45] [--minutes 3]

Prints a markdown table and saves bench/results/<date>-backup.json and .md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.lifecycle import given, summary  # noqa: E402
from tests.e2e.harness import create_sandbox, own_server, run, wait_operation  # noqa: E402

PROBE = r"""
import time
last = time.time()
while True:
    time.sleep(0.005)
    now = time.time()
    if now - last > 0.02:
        print(f"{now - last:.3f}", flush=True)
    last = now
"""

PHASES = {
    "install": "d=/home/user/site-$(date +%s%N) && mkdir -p $d && cp -a /usr/lib/python3* $d/ && sync",
    "clone": ("mkdir -p /home/user/repo && cd /home/user/repo && for i in $(seq 400); do "
              "head -c 8192 /dev/urandom > f$i; done && tar cf pack.tar f* && head -c 16M /dev/urandom >> pack.tar "
              "&& sync"),
    "edits": ("mkdir -p /home/user/src && for i in $(seq 30); do touch /home/user/src/m$i.py; done; "
              "end=$(( $(date +%s) + 50 )); while [ $(date +%s) -lt $end ]; do "
              "for i in $(seq 30); do head -c 1024 /dev/urandom | base64 >> /home/user/src/m$i.py; done; "
              "sleep 2; done; sync"),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def home_bytes(api: httpx.Client, sid: str) -> int:
    code, out, err = run(api, sid, {"shell": "du -sb --apparent-size /home/user | cut -f1"})
    assert code == 0, err
    return int(out.strip() or 0)


def gaps(api: httpx.Client, sid: str, cid: str) -> list[float]:
    out = b""
    with api.stream("GET", f"/v1/sandboxes/{sid}/commands/{cid}/events", params={"after": 0},
                    timeout=httpx.Timeout(60, read=1.0)) as r:
        r.raise_for_status()
        with contextlib.suppress(httpx.ReadTimeout):
            for line in r.iter_lines():
                if line.startswith("data:") and '"data"' in line:
                    out += base64.b64decode(json.loads(line[5:])["data"])
    return [float(x) for x in out.split()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=float, default=45.0)
    ap.add_argument("--minutes", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, metavar="STEM",
                    help="save STEM.json and STEM.md (default: bench/results/<date>-backup)")
    args = ap.parse_args()
    phases = list(PHASES)[: args.minutes] if args.minutes <= len(PHASES) else list(PHASES)
    res: dict[str, Any] = {"date": dt.date.today().isoformat(), "args": given(args)}
    with tempfile.TemporaryDirectory(prefix="space-bench-backup-") as tmp, own_server(Path(tmp)) as srv, \
            srv.client(timeout=600) as api:
        policy = {"disk_every": None, "full_every": None}
        backed = create_sandbox(api, snapshot_policy={**policy, "backup_every": args.every}, disk_mb=4096)
        base = create_sandbox(api, snapshot_policy=policy, disk_mb=4096)
        try:
            cids = {}
            for sid in (backed, base):
                api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/probe.py"}, content=PROBE.encode())
                r = api.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": ["python3", "/tmp/probe.py"]})
                r.raise_for_status()
                cids[sid] = r.json()["id"]
            before = {sid: home_bytes(api, sid) for sid in (backed, base)}
            rpo: list[float] = []
            stop = threading.Event()

            def sample() -> None:
                with srv.client() as c:
                    while not stop.is_set():
                        b = c.get(f"/v1/sandboxes/{backed}").json().get("backup") or {}
                        if b.get("rpo_s") is not None:
                            rpo.append(float(b["rpo_s"]))
                        stop.wait(2.0)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t0 = time.monotonic()
            for name in phases:
                log(f"phase {name}")
                start = time.monotonic()
                for sid in (backed, base):
                    code, _, err = run(api, sid, {"shell": PHASES[name]})
                    assert code == 0, err
                # One phase a minute: the rest of it idle (the backup catches up meanwhile).
                while time.monotonic() - start < 60:
                    time.sleep(1)
            # The last changes shipped: one more interval.
            deadline = time.monotonic() + args.every + 30
            while time.monotonic() < deadline:
                b = api.get(f"/v1/sandboxes/{backed}").json().get("backup") or {}
                if b.get("disk_at") and dt.datetime.fromisoformat(b["disk_at"]).timestamp() > time.time() - 5:
                    break
                time.sleep(1)
            minutes = (time.monotonic() - t0) / 60
            stop.set()
            sampler.join(timeout=10)
            changed = home_bytes(api, backed) - before[backed]
            row = api.get(f"/v1/sandboxes/{backed}").json()
            shipped = int((row.get("backup") or {}).get("bytes_shipped") or 0)
            code, out, _ = run(api, backed, {"shell": "du -sxb / 2>/dev/null | cut -f1"})
            root = int(out.strip() or 0)
            g_backed, g_base = gaps(api, backed, cids[backed]), gaps(api, base, cids[base])
            res.update({
                "minutes": round(minutes, 2), "bytes_changed": changed, "bytes_shipped": shipped,
                "root_bytes": root, "ratio_shipped_to_changed": round(shipped / changed, 3) if changed else None,
                "links": (row.get("backup") or {}).get("links"), "rpo_s": summary(rpo) if rpo else None,
                "rpo_max_s": max(rpo, default=None),
                "guest_gap_backed_s": {"max": max(g_backed, default=0.0), "n_over_20ms": len(g_backed),
                                       "top": sorted(g_backed)[-5:]},
                "guest_gap_baseline_s": {"max": max(g_base, default=0.0), "n_over_20ms": len(g_base),
                                         "top": sorted(g_base)[-5:]},
            })
        finally:
            for sid in (backed, base):
                r = api.delete(f"/v1/sandboxes/{sid}")
                if r.status_code == 202:
                    wait_operation(api, r.json()["operation"]["id"], timeout=300)
    table = render(res)
    print(table)
    out = args.out or REPO / "bench" / "results" / f"{res['date']}-backup"
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    log(f"saved {out}.json and .md")
    return 0


def render(r: dict[str, Any]) -> str:
    mb = 1e6
    rpo = r.get("rpo_s") or {}
    return "\n".join([
        "| metric | value | baseline (same run) | target |",
        "|---|---|---|---|",
        f"| bytes the guest changed in {r['minutes']:.1f} min (MB) | {r['bytes_changed'] / mb:.1f} | "
        f"full root {r['root_bytes'] / mb:.0f} MB | |",
        f"| backup traffic (MB), {r['links']} links | {r['bytes_shipped'] / mb:.1f} | "
        f"{r['ratio_shipped_to_changed']}x the bytes changed | ≤ 2x |",
        f"| backup traffic per minute (MB) | {r['bytes_shipped'] / mb / r['minutes']:.1f} | | |",
        f"| disk RPO, p50 / max (s), every {r['args']['every']:g} s | {rpo.get('p50', 0):.1f} / "
        f"{r['rpo_max_s'] or 0:.1f} | | ≤ 60 |",
        f"| longest guest gap (ms) | {r['guest_gap_backed_s']['max'] * 1000:.0f} | "
        f"no backup: {r['guest_gap_baseline_s']['max'] * 1000:.0f} | no freeze beyond the snapshot |",
        f"| gaps over 20 ms | {r['guest_gap_backed_s']['n_over_20ms']} | "
        f"{r['guest_gap_baseline_s']['n_over_20ms']} | |",
    ]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
