"""Parts of `bench/run` that bring their own deployment instead of its `space serve`: ``cluster``
(replicated API and controllers on PostgreSQL: warm creates against `space serve` on SQLite,
concurrent bursts across replicas, exec over mutual TLS, leader failover; bench/cluster.py),
``drain`` (a node drained under idle, memory and disk workloads: the guest's freeze and each
move's parts; bench/drain.py), ``backup`` (continuous backup of a sandbox writing steadily:
traffic against the bytes changed, RPO, the guest's longest pause; bench/backup.py) and
``template_image`` (a template from a container image against skopeo + umoci alone, with a
registry of its own; bench/template_image.py).

Each script runs as a process of its own (it starts and stops its deployment), writes its JSON
where it is told, and its figures become rows of bench/run's one table (metric | p50 | p90 | p99 |
n | baseline p50 | ratio), with the script's own table kept beside them in the notes' place.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.lifecycle import table_row

REPO = Path(__file__).resolve().parents[1]

PARTS = ("cluster", "drain", "backup", "template_image")

#: Each part's script and its arguments, full and --quick.
SCRIPTS: dict[str, tuple[str, list[str], list[str]]] = {
    "cluster": ("bench/cluster.py", [], ["--rounds", "2", "--per-round", "5", "--bursts", "20", "--execs", "20",
                                        "--failovers", "1"]),
    "drain": ("bench/drain.py", [], ["--per", "2", "--rounds", "1", "--workloads", "idle"]),
    "backup": ("bench/backup.py", [], ["--minutes", "1"]),
    "template_image": ("bench/template_image.py", [], ["--runs", "1"]),
}


def run_all(parts: tuple[str, ...], *, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="space-bench-deployed-") as tmp:
        for part in parts:
            script, full, small = SCRIPTS[part]
            stem = Path(tmp) / part
            log(f"{part} ({script}, its own deployment) ...")
            done = subprocess.run([sys.executable, str(REPO / script), "--out", str(stem),
                                   *(small if quick else full)], cwd=REPO, stdout=subprocess.DEVNULL)
            if done.returncode != 0:
                # The other parts' figures still count: this one is reported as failed, with why
                # (the script printed its traceback and its deployment's log tails above).
                log(f"{part}: {script} failed (exit {done.returncode})")
                out[part] = {"failed": f"{script} exited with {done.returncode}; its output is in the run's log"}
                continue
            out[part] = json.loads(stem.with_suffix(".json").read_text())
    return out


def table_rows(res: dict[str, Any]) -> tuple[list[str], list[str]]:
    rows: list[str] = []
    notes: list[str] = []
    for part in PARTS:
        if (res.get(part) or {}).get("failed"):
            notes.append(f"{part}: FAILED, no figures ({res[part]['failed']})")
    res = {k: v for k, v in res.items() if not (k in PARTS and (v or {}).get("failed"))}
    if c := res.get("cluster"):
        w = c["warm"]
        rows.append(table_row("warm create → running via a replica, PostgreSQL (ms)", w["replica_postgres_ms"],
                              f"{w['serve_sqlite_ms']['p50']:.1f} (`space serve`, SQLite)", w["ratio_p50"]))
        for b in c["bursts"]:
            lat = b["latency_ms"]
            rows.append(table_row(f"{b['burst']} concurrent creates across 2 replicas, PostgreSQL (ms)", lat))
            notes.append(f"burst of {b['burst']} on PostgreSQL: p95 {lat['p95']:.1f} ms, {b['served_warm']}/"
                         f"{b['burst']} served warm, {b['creates_per_s']:.1f} creates/s (CubeSandbox: p95 90 ms at 50)")
        e = c["exec_node_api"]
        rows.append(table_row("exec `true` on the node API over mutual TLS (ms)", e["mtls_tcp_ms"],
                              f"{e['unix_socket_ms']['p50']:.2f} (unix socket)",
                              e["mtls_tcp_ms"]["p50"] / e["unix_socket_ms"]["p50"], fmt="{:.2f}"))
        f = c["leader_failover_s"]
        rows.append(f"| leader failover after SIGKILL (s) | {statistics.median(f):.2f} | | {max(f):.2f} | {len(f)} "
                    "| | |")
    if d := res.get("drain"):
        for w in d["workloads"]:
            rows.append(table_row(f"drain, {w['workload']}: the guest frozen per move (s)", w["guest_frozen_s"],
                                  fmt="{:.2f}"))
            rows.append(table_row(f"drain, {w['workload']}: one move in all (s)", w["move_total_s"],
                                  f"{w['checkpoint_and_upload_s']['p50']:.2f} checkpoint+upload, "
                                  f"{w['restore_s']['p50']:.2f} restore", fmt="{:.2f}"))
    if b := res.get("backup"):
        mb = 1e6
        rpo = b.get("rpo_s")
        if rpo:
            rows.append(table_row(f"continuous backup every {b['args']['every']:g} s: disk RPO (s)", rpo))
        rows.append(f"| continuous backup: traffic over {b['minutes']:.1f} min (MB) | {b['bytes_shipped'] / mb:.1f} "
                    f"| | | {b['links']} links | {b['bytes_changed'] / mb:.1f} (bytes the guest changed) "
                    f"| {b['ratio_shipped_to_changed']} |")
        rows.append(f"| continuous backup: the guest's longest gap (ms) | {b['guest_gap_backed_s']['max'] * 1000:.0f} "
                    f"| | | 1 | {b['guest_gap_baseline_s']['max'] * 1000:.0f} (no backup) | |")
    if t := res.get("template_image"):
        base = t["skopeo_umoci_ms"]
        rows.append(table_row("template from a container image: build → done (ms)", t["materialize_ms"],
                              f"{base['p50']:.0f} (skopeo copy + umoci unpack alone)", t["ratio_p50"]))
        rows.append(table_row("template from a container image: the same tag again (ms)", t["rebuild_same_tag_ms"]))
        rows.append(table_row("a sandbox of an image template, create → running (ms)", t["create_ms"]))
    return rows, notes
