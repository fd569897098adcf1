"""Creation benchmarks (issue 4): warm pool vs cold create vs the bare runtime, sustained creation
with the pool refilling, and a burst of concurrent creates.

Every figure is measured through the public API of the server ``bench/run`` started, against
baselines measured in the same run:

- ``warm``: POST /v1/sandboxes → 201 with the sandbox running (a warm pool of ``base``), and the
  same until a first ``true`` has run in it; against a cold create (a size no pool keeps: POST →
  operation succeeded) and against ``runsc create`` + ``runsc start`` of the same bundle and root
  filesystem, called directly.
- ``sustained``: create + delete in a loop for ``seconds`` with the pool refilling; creates/s, the
  share the pool served, latency percentiles.
- ``concurrent``: ``burst`` creates at once (threads), each until its sandbox runs, repeated from a
  refilled pool (5 bursts, 2 with --quick); p50/p99 over all of them and how many the pool served,
  against the same burst once with no pool.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import subprocess
import time
from typing import Any

from bench.lifecycle import Bench, ms_since, summary, table_row
from tests.e2e.harness import wait_operation

PARTS = ("warm", "sustained", "concurrent")
POOL = 2
COLD_MEMORY = 768  # a size no pool keeps: creates of it boot cold


def set_pool(b: Bench, size: int, memory_mb: int = 512) -> None:
    r = b.c.put("/v1/pools/base", json={"size": size, "memory_mb": memory_mb})
    if r.status_code != 200:
        raise b.fail(f"PUT /v1/pools/base size={size}", r.text)


def ready(b: Bench, memory_mb: int = 512) -> int:
    for p in b.get("/v1/pools")["pools"]:
        if p["template"] == "base" and p["memory_mb"] == memory_mb:
            return int(p["ready"])
    return 0


def wait_ready(b: Bench, n: int, timeout: float = 120.0, *, settled: bool = False) -> None:
    """Until ``n`` warm sandboxes are ready; with ``settled`` also until the node has finished
    removing deleted sandboxes (``runsc delete`` takes ~1 s of CPU in the background)."""
    deadline = time.monotonic() + timeout
    trash = b.pool / "trash"
    while ready(b) < n or (settled and trash.exists() and any(trash.iterdir())):
        if time.monotonic() > deadline:
            raise b.fail(f"the warm pool did not reach {n} ready", b.get("/v1/pools"))
        time.sleep(0.02)


def _create(b: Bench, **body: Any) -> tuple[float, str, bool]:
    """One create until the sandbox runs: (ms, id, served warm)."""
    t0 = time.perf_counter()
    r = b.c.post("/v1/sandboxes", json={"template": "base", **body})
    if r.status_code not in (201, 202):
        raise b.fail(f"create {body}", r.text)
    out = r.json()
    if r.status_code == 202:
        op = wait_operation(b.c, out["operation"]["id"], timeout=300)
        if op["status"] != "succeeded":
            raise b.fail("cold create", op)
    return ms_since(t0), str(out["sandbox"]["id"]), r.status_code == 201


def _first_exec(b: Bench, sid: str) -> None:
    r = b.c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": ["true"], "user": "root"})
    if r.status_code != 201:
        raise b.fail("exec", r.text)
    with b.c.stream("GET", f"/v1/sandboxes/{sid}/commands/{r.json()['id']}/events") as s:
        for line in s.iter_lines():
            if line.startswith("event: exit"):
                return
    raise b.fail("exec", "no exit event")


def _runsc_create_start(b: Bench, sid: str, n: int) -> list[float]:
    """``runsc create`` + ``runsc start`` of the bundle SPACE used for ``sid`` (guest daemon as
    PID 1 on pipes we hold, as the node's shim does), each on a fresh btrfs snapshot of the same
    template, timed until ``start`` returns; removed after each round."""
    sb = b.get(f"/v1/sandboxes/{sid}")
    inst = sb["instance_id"]
    spec = json.loads((b.srv.data_dir / "bundles" / inst / "config.json").read_text())  # the helper's
    template = next(p for p in sorted((b.pool / "templates").glob("base@*")) if p.is_dir())
    out: list[float] = []
    for _ in range(n):
        tag = secrets.token_hex(4)
        root, bundle = b.scratch / f"bench-root-{tag}", b.scratch / f"bench-bundle-{tag}"
        new_id = f"zbench{secrets.token_hex(10)}"
        subprocess.run(["btrfs", "-q", "subvolume", "snapshot", str(template), str(root)], check=True,
                       capture_output=True)
        bundle.mkdir()
        spec["root"]["path"] = str(root)
        spec["linux"]["cgroupsPath"] = f"/space/{new_id}"
        (bundle / "config.json").write_text(json.dumps(spec))
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        try:
            t0 = time.perf_counter()
            with open(bundle / "runsc.log", "wb") as err:
                subprocess.run(["runsc", *b.runsc_flags, "create", "--bundle", str(bundle), new_id],
                               stdin=to_r, stdout=from_w, stderr=err, check=True)
            subprocess.run(["runsc", *b.runsc_flags, "start", new_id], check=True, capture_output=True)
            out.append(ms_since(t0))
        finally:
            subprocess.run(["runsc", *b.runsc_flags, "delete", "--force", new_id], capture_output=True, check=False)
            for fd in (to_r, to_w, from_r, from_w):
                os.close(fd)
            b.drop_subvolume(root)
            subprocess.run(["rm", "-rf", str(bundle)], check=False)
    return out


def bench_warm(b: Bench, n: int) -> dict[str, Any]:
    warm_ms: list[float] = []
    warm_exec_ms: list[float] = []
    cold_ms: list[float] = []
    cold_fallbacks = 0
    set_pool(b, POOL)
    with b.sandboxes() as ids:
        for i in range(n):
            # A full pool and a settled node: the create alone (bench_sustained has the busy case).
            wait_ready(b, POOL, settled=True)
            ms, sid, warm = _create(b)
            if not warm:
                ids.append(sid)
                cold_fallbacks += 1
                continue
            warm_ms.append(ms)
            b.delete([sid])
            if i % 2 == 0 and len(cold_ms) < max(5, n // 3):
                ms, cid, _ = _create(b, memory_mb=COLD_MEMORY)
                cold_ms.append(ms)
                b.delete([cid])
        for _ in range(max(5, n // 4)):  # create → first exec, on its own so deletes stay out of it
            wait_ready(b, POOL, settled=True)
            t0 = time.perf_counter()
            _, sid, _ = _create(b)
            _first_exec(b, sid)
            warm_exec_ms.append(ms_since(t0))
            b.delete([sid])
        set_pool(b, 0)
        _, ref, _ = _create(b, memory_mb=COLD_MEMORY)  # whose bundle the bare runtime boots
        ids.append(ref)
        raw = _runsc_create_start(b, ref, max(5, n // 3))
    w, c, r = summary(warm_ms), summary(cold_ms), summary(raw)
    return {"warm_create_ms": w, "warm_create_exec_ms": summary(warm_exec_ms), "cold_create_ms": c,
            "runsc_create_start_ms": r, "cold_fallbacks": cold_fallbacks,
            "ratio_warm_vs_cold_p50": w["p50"] / c["p50"], "ratio_warm_vs_runsc_p50": w["p50"] / r["p50"],
            "ratio_cold_vs_runsc_p50": c["p50"] / r["p50"]}


def bench_sustained(b: Bench, seconds: float, pool: int) -> dict[str, Any]:
    """Create as fast as one client can for ``seconds``, deleting each sandbox right after (so the
    node holds a bounded number), while the pool of ``pool`` refills."""
    set_pool(b, pool)
    wait_ready(b, pool)
    lat: list[float] = []
    warm = 0
    deletes: list[str] = []
    t_end = time.monotonic() + seconds
    t0 = time.monotonic()
    try:
        while time.monotonic() < t_end:
            ms, sid, was_warm = _create(b)
            lat.append(ms)
            warm += was_warm
            r = b.c.delete(f"/v1/sandboxes/{sid}")
            if r.status_code == 202:
                deletes.append(r.json()["operation"]["id"])
        elapsed = time.monotonic() - t0
    finally:
        for op in deletes:
            wait_operation(b.c, op, timeout=300)
        set_pool(b, 0)
    return {"seconds": elapsed, "creates": len(lat), "creates_per_s": len(lat) / elapsed,
            "warm_share": warm / len(lat) if lat else 0.0, "pool": pool, "latency_ms": summary(lat)}


def _burst(b: Bench, k: int) -> tuple[list[float], int, list[str]]:
    with concurrent.futures.ThreadPoolExecutor(k) as ex:
        results = list(ex.map(lambda _: _create(b), range(k)))
    return [r[0] for r in results], sum(r[2] for r in results), [r[1] for r in results]


def bench_concurrent(b: Bench, k: int, pool: int, bursts: int) -> dict[str, Any]:
    """``bursts`` times ``k`` creates at once, each from a full pool of ``pool``; then the same
    burst once with no pool (the baseline: cold creates side by side). One burst is too few to
    compare revisions by: its p50 moved 1.6x between runs of one revision."""
    lat: list[float] = []
    per_burst: list[float] = []
    warm = 0
    for _ in range(bursts):
        set_pool(b, pool)
        wait_ready(b, pool)
        one, served, ids = _burst(b, k)
        b.delete(ids)
        lat += one
        warm += served
        per_burst.append(round(summary(one)["p50"], 1))
    set_pool(b, 0)
    cold_lat, _, ids = _burst(b, k)
    b.delete(ids)
    s, c = summary(lat), summary(cold_lat)
    return {"burst": k, "pool": pool, "bursts": bursts, "with_pool_ms": s, "burst_p50_ms": per_burst,
            "served_warm": warm, "no_pool_ms": c,
            "ratio_p50": s["p50"] / c["p50"], "ratio_p99": s["p99"] / c["p99"]}


def run_all(b: Bench, parts: tuple[str, ...], *, quick: bool, log: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "warm" in parts:
        log("warm create ...")
        out["warm"] = bench_warm(b, 10 if quick else 40)
    if "sustained" in parts:
        log("sustained creation ...")
        out["sustained"] = bench_sustained(b, 15 if quick else 60, pool=4)
    if "concurrent" in parts:
        log("concurrent creates ...")
        out["concurrent"] = bench_concurrent(b, 8 if quick else 20, pool=20 if not quick else 8,
                                             bursts=2 if quick else 5)
    return out


def table_rows(res: dict[str, Any]) -> tuple[list[str], list[str]]:
    rows: list[str] = []
    notes: list[str] = []
    if "warm" in res:
        w = res["warm"]
        rows.append(table_row("create, warm pool → running (ms)", w["warm_create_ms"],
                         f"{w['cold_create_ms']['p50']:.0f} (cold create)", w["ratio_warm_vs_cold_p50"]))
        rows.append(table_row("create, warm pool → first exec done (ms)", w["warm_create_exec_ms"]))
        rows.append(table_row("create, cold → running (ms)", w["cold_create_ms"],
                         f"{w['runsc_create_start_ms']['p50']:.0f} (`runsc create`+`start`)",
                         w["ratio_cold_vs_runsc_p50"]))
        rows.append(table_row("`runsc create`+`start`, same root (ms)", w["runsc_create_start_ms"]))
        notes.append(f"warm create vs bare `runsc create`+`start`: {w['ratio_warm_vs_runsc_p50']:.3g}x "
                     f"(p50); cold fallbacks during the warm run: {w['cold_fallbacks']}")
    if "sustained" in res:
        s = res["sustained"]
        rows.append(table_row(f"sustained create+delete for {s['seconds']:.0f}s, pool {s['pool']} (ms)",
                         s["latency_ms"]))
        notes.append(f"sustained: {s['creates_per_s']:.2f} creates/s over {s['seconds']:.0f}s "
                     f"({s['creates']} creates, {s['warm_share']:.0%} served by the pool while it refilled)")
    if "concurrent" in res:
        c = res["concurrent"]
        rows.append(table_row(f"{c['burst']} concurrent creates, pool {c['pool']} (ms)", c["with_pool_ms"],
                         f"{c['no_pool_ms']['p50']:.0f} (same burst, no pool)", c["ratio_p50"]))
        rows.append(table_row(f"{c['burst']} concurrent creates, no pool (ms)", c["no_pool_ms"]))
        bursts = c.get("bursts", 1)
        notes.append(f"concurrent: {bursts} bursts of {c['burst']} (p50 of each: {c.get('burst_p50_ms', '-')}); "
                     f"{c['served_warm']}/{c['burst'] * bursts} served warm; p99 ratio {c['ratio_p99']:.3g}")
    return rows, notes
