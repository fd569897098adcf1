#!/usr/bin/env python3
"""Bring your own key: what encrypting snapshots in object storage costs suspend and restore.

Two ``space serve`` of their own (SQLite, a local directory object store, no warm pool), started
once and kept for the whole run: ``plain`` (``--no-object-encryption``: artifacts shipped as they
are) and ``encrypted`` (the default: every artifact sealed under the tenant's key as it streams up,
opened as it streams down). The rounds alternate between them, plain then encrypted, one at a time
(never both at once: the machine's cores are shared), so that drift hits both sides alike.

One round on a server, for one size N:

1. a sandbox of the base template (512 MiB of memory, no scheduled snapshot);
2. ``head -c N MiB /dev/urandom > /home/user/blob`` (random: compression cannot hide it), ``sync``,
   its sha256;
3. a process started through the API that holds 50 MiB of random memory (it is in the memory
   image the suspend uploads);
4. ``POST /suspend`` → operation succeeded (**suspend**: a full checkpoint, shipped to object
   storage); the manifest it wrote is read back from the object store to check that the side is
   what it says (kind ``snapshot-encrypted`` or ``snapshot``);
5. ``POST /restore`` → operation succeeded (**restore**: fetched back, decrypted, restored);
   Before each, the host's dirty pages are written back (``sync``), on both sides alike.
6. the restore is checked, outside the timings: the blob's sha256 unchanged, the process still
   running and still holding its memory. A round whose restore is broken stops the benchmark;
7. the sandbox deleted.

**round trip** is suspend + restore of the same round. Bytes uploaded are the suspend's own
report (``uploaded_bytes``: the stored bytes, so the encrypted side's include its frames' tags).
Before the measured rounds each server does one warm-up round (its first suspend also publishes
the base template to object storage), kept in the JSON apart.

Target: encrypted p50 ≤ 1.10x plain p50, for suspend, restore and the round trip.

    sudo .venv/bin/python bench/byok.py [--rounds 5] [--sizes 10,200] [--quick]

Prints a markdown table and saves bench/results/<date>-byok.json and .md (``--quick``:
``<date>-byok-quick``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lifecycle import HOLD_MEMORY, MIB, POLICY_OFF, pct, summary  # noqa: E402
from tests.e2e.harness import Server, own_server, run, wait_for, wait_operation  # noqa: E402

MEMORY_MB = 512
HOLD_MB = 50
TARGET = 1.10
#: The sides, in the order every round runs them; the server flags that make each.
SIDES: dict[str, tuple[str, ...]] = {"plain": ("--no-object-encryption",), "encrypted": ()}
#: The manifest kind each side must write (space.node.storage.artifacts).
KIND = {"plain": "snapshot", "encrypted": "snapshot-encrypted"}
METRICS = ("suspend_ms", "restore_ms", "round_trip_ms")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


class RoundFailed(RuntimeError):
    """Something of a round went wrong: carries the server log's tail."""


class Side:
    """One server of the run and its client."""

    def __init__(self, name: str, srv: Server) -> None:
        self.name = name
        self.srv = srv
        self.api = srv.client(timeout=600)

    def fail(self, what: str, detail: Any = None) -> RoundFailed:
        return RoundFailed(f"[{self.name}] {what}: {json.dumps(detail, default=str)[:2000]}\n"
                           f"--- server log tail ---\n{self.srv.log_tail(6000)}")

    def sh(self, sid: str, script: str) -> str:
        code, out, err = run(self.api, sid, {"shell": script})
        if code != 0:
            raise self.fail(f"`{script}` exited {code}", {"stdout": out.decode(errors="replace")[-500:],
                                                          "stderr": err.decode(errors="replace")[-500:]})
        return out.decode()

    def act(self, path: str, what: str) -> tuple[float, dict[str, Any]]:
        """POST a lifecycle action and follow its operation: (end-to-end ms, operation)."""
        t0 = time.perf_counter()
        r = self.api.post(path)
        if r.status_code != 202:
            raise self.fail(f"{what}: POST {path} answered {r.status_code}", r.text)
        op = wait_operation(self.api, r.json()["operation"]["id"], timeout=900)
        ms = ms_since(t0)
        if op["status"] != "succeeded":
            raise self.fail(f"{what}: operation {op['id']} {op['status']}", op)
        return ms, op

    def create(self) -> str:
        r = self.api.post("/v1/sandboxes", json={"template": "base", "memory_mb": MEMORY_MB,
                                                  "snapshot_policy": POLICY_OFF})
        if r.status_code != 202:
            raise self.fail(f"create answered {r.status_code}", r.text)
        sid = str(r.json()["sandbox"]["id"])
        op = wait_operation(self.api, r.json()["operation"]["id"], timeout=300)
        if op["status"] != "succeeded":
            self.delete(sid)
            raise self.fail("create failed", op)
        return sid

    def delete(self, sid: str) -> None:
        r = self.api.delete(f"/v1/sandboxes/{sid}")
        if r.status_code == 202:
            wait_operation(self.api, r.json()["operation"]["id"], timeout=300)

    def manifest_kind(self, sid: str, snap: str) -> str:
        """The kind of the manifest the suspend wrote (its clear-text envelope)."""
        found = list((self.srv.data_dir / "objects").glob(f"tenants/*/sandboxes/{sid}/snapshots/{snap}/manifest.json"))
        if len(found) != 1:
            raise self.fail(f"snapshot {snap}: {len(found)} manifests in the object store")
        return str(json.loads(found[0].read_bytes()).get("kind"))

    def log_lines(self, level: str) -> list[str]:
        """The server log's lines of ``level`` (JSON or console rendering; errors with tracebacks)."""
        try:
            text = self.srv.log_path.read_text(errors="replace")
        except OSError:
            return []
        extra = "|Traceback|CRITICAL" if level == "error" else ""
        pat = re.compile(rf"\[{level}\b|\"level\": \"{level}\"|level={level}\b{extra}", re.I)
        return [line[:400] for line in text.splitlines() if pat.search(line)]


def one_round(side: Side, size_mb: int) -> dict[str, Any]:
    api = side.api
    sid = side.create()
    try:
        digest = side.sh(sid, f"head -c {size_mb * MIB} /dev/urandom > /home/user/blob && sync && "
                              "sha256sum /home/user/blob").split()[0]
        r = api.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": ["python3", "-c", HOLD_MEMORY, str(HOLD_MB * MIB)]})
        if r.status_code != 201:
            raise side.fail(f"starting the memory holder answered {r.status_code}", r.text)
        cid = r.json()["id"]
        wait_for(lambda: side.sh(sid, "cat /tmp/held 2>/dev/null || true").strip() == str(HOLD_MB * MIB),
                 120, f"the sandbox to hold {HOLD_MB} MiB")

        # The host's dirty pages written back first (the blob, the last round's objects): writeback
        # landing inside one side's timing is noise that has nothing to do with encryption.
        os.sync()
        s_ms, s_op = side.act(f"/v1/sandboxes/{sid}/suspend", "suspend")
        snap_id = str(s_op["result"]["snapshot"])
        kind = side.manifest_kind(sid, snap_id)
        if kind != KIND[side.name]:
            raise side.fail(f"the suspend wrote a manifest of kind {kind!r}, not {KIND[side.name]!r}")
        snap = api.get(f"/v1/snapshots/{snap_id}").json()
        arts = {a["name"]: a["size"] for a in (snap.get("details") or {}).get("artifacts") or []}

        os.sync()
        r_ms, r_op = side.act(f"/v1/sandboxes/{sid}/restore", "restore")

        # Intact: the file, the process, its memory.
        after = side.sh(sid, "sha256sum /home/user/blob").split()[0]
        if after != digest:
            raise side.fail(f"the blob's sha256 changed across suspend/restore: {digest} -> {after}")
        state = api.get(f"/v1/sandboxes/{sid}/commands/{cid}").json().get("state")
        if state != "running":
            raise side.fail(f"the {HOLD_MB} MiB process did not survive the restore", state)
        held = side.sh(sid, "cat /tmp/held").strip()
        if held != str(HOLD_MB * MIB):
            raise side.fail("the memory holder's marker changed", held)
        return {
            "size_mb": size_mb, "suspend_ms": s_ms, "restore_ms": r_ms, "round_trip_ms": s_ms + r_ms,
            "uploaded_bytes": int(s_op["result"].get("uploaded_bytes") or 0),
            "snapshot_size_bytes": int(snap.get("size_bytes") or 0),
            "rootfs_bytes": int(arts.get("rootfs.btrfs.zst", 0)),
            "image_bytes": sum(int(v) for k, v in arts.items() if k.startswith("checkpoint/")),
            "manifest_kind": kind, "blob_sha256": digest,
            "restore_timings": (r_op.get("result") or {}).get("timings") or {},
        }
    finally:
        side.delete(sid)


def aggregate(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {m: summary([r[m] for r in rounds]) for m in METRICS}
    for key in ("uploaded_bytes", "rootfs_bytes", "image_bytes"):
        out[key] = summary([float(r[key]) for r in rounds])
    keys = sorted(set.intersection(*(set(r["restore_timings"]) for r in rounds))) if rounds else []
    out["restore_breakdown_ms_p50"] = {k: pct([float(r["restore_timings"][k]) for r in rounds], .5) for k in keys}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per size and side")
    ap.add_argument("--sizes", default="10,200", help="MiB written into the sandbox before each suspend")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 10 MiB only")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.sizes = 2, "10"
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    res: dict[str, Any] = {"date": dt.date.today().isoformat(), "args": vars(args), "commit": commit,
                           "memory_mb": MEMORY_MB, "hold_mb": HOLD_MB, "target_ratio_p50": TARGET}
    rounds: dict[str, dict[int, list[dict[str, Any]]]] = {s: {n: [] for n in sizes} for s in SIDES}
    warmup: dict[str, dict[str, Any]] = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="space-bench-byok-") as tmp, contextlib.ExitStack() as stack:
        sides: dict[str, Side] = {}
        for name, flags in SIDES.items():
            d = Path(tmp) / name
            d.mkdir()
            log(f"starting the {name} server {' '.join(flags)}")
            srv = stack.enter_context(own_server(d, *flags, "--warm-pool", "0"))
            sides[name] = Side(name, srv)
            stack.callback(sides[name].api.close)
        try:
            for name, side in sides.items():
                log(f"{name}: warm-up round ({sizes[0]} MiB)")
                warmup[name] = one_round(side, sizes[0])
            for i in range(args.rounds):
                for size in sizes:
                    for name, side in sides.items():
                        r = one_round(side, size)
                        rounds[name][size].append(r)
                        log(f"round {i + 1}/{args.rounds} {size} MiB {name}: suspend {r['suspend_ms']:.0f} ms, "
                            f"restore {r['restore_ms']:.0f} ms, uploaded {r['uploaded_bytes'] / MIB:.1f} MiB")
        finally:
            res["server_log_errors"] = {name: side.log_lines("error")[-20:] for name, side in sides.items()}
            res["server_log_warnings"] = {name: side.log_lines("warning")[-20:] for name, side in sides.items()}
            res["server_logs_bytes"] = {name: side.srv.log_path.stat().st_size if side.srv.log_path.exists() else 0
                                        for name, side in sides.items()}
    res["took_s"] = round(time.monotonic() - t_start, 1)
    res["warmup"] = warmup
    res["sizes"] = {}
    for size in sizes:
        agg = {name: aggregate(rounds[name][size]) for name in SIDES}
        ratios = {m: agg["encrypted"][m]["p50"] / agg["plain"][m]["p50"] for m in (*METRICS, "uploaded_bytes")}
        res["sizes"][str(size)] = {**agg, "ratio_p50": ratios,
                                   "within_target": {m: ratios[m] <= TARGET for m in METRICS},
                                   "rounds": {name: rounds[name][size] for name in SIDES}}
    table = render(res)
    print(table)
    out = REPO / "bench" / "results" / f"{res['date']}-byok{'-quick' if args.quick else ''}"
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    log(f"saved {out}.json and .md")
    return 0


def render(r: dict[str, Any]) -> str:
    def trio(s: dict[str, float], scale: float = 1.0, fmt: str = "{:.0f}") -> str:
        return " / ".join(fmt.format(s[k] / scale) for k in ("p50", "p90", "p99"))

    names = {"suspend_ms": "suspend (ms)", "restore_ms": "restore (ms)", "round_trip_ms": "suspend → restore (ms)"}
    lines = [f"Object encryption on suspend/restore: {r['args']['rounds']} rounds per size and side, "
             f"{r['memory_mb']} MiB sandbox holding {r['hold_mb']} MiB of random memory, commit {r['commit']}.",
             "",
             "| changed | metric | plain p50 / p90 / p99 | encrypted p50 / p90 / p99 | ratio p50 | target |",
             "|---|---|---|---|---|---|"]
    for size, d in r["sizes"].items():
        for m in METRICS:
            ok = "✓" if d["within_target"][m] else "✗"
            lines.append(f"| {size} MiB | {names[m]} | {trio(d['plain'][m])} | {trio(d['encrypted'][m])} | "
                         f"{d['ratio_p50'][m]:.3f}x | ≤ {r['target_ratio_p50']:.2f}x {ok} |")
        lines.append(f"| {size} MiB | uploaded (MiB) | {trio(d['plain']['uploaded_bytes'], MIB, '{:.2f}')} | "
                     f"{trio(d['encrypted']['uploaded_bytes'], MIB, '{:.2f}')} | "
                     f"{d['ratio_p50']['uploaded_bytes']:.4f}x | |")
    lines.append("")
    for size, d in r["sizes"].items():
        for name in SIDES:
            bd = ", ".join(f"{k} {v:.0f}" for k, v in d[name]["restore_breakdown_ms_p50"].items())
            lines.append(f"- {size} MiB {name}: uploads p50 root delta {d[name]['rootfs_bytes']['p50'] / MIB:.1f} MiB"
                         f" + memory image {d[name]['image_bytes']['p50'] / MIB:.1f} MiB; restore node side p50 ms: "
                         f"{bd or 'n/a'}")
    errs = {k: len(v) for k, v in r["server_log_errors"].items()}
    warns = {k: len(v) for k, v in r["server_log_warnings"].items()}
    lines.append(f"- server log lines, errors: {errs}, warnings: {warns} (last 20 of each in the JSON); "
                 f"took {r['took_s']:.0f} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
