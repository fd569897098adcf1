#!/usr/bin/env python3
"""What a fenced write costs (space.store.fencing): a sandbox state change made inside an operation's
fence against the same change made without one, alternating in the same run, on SQLite and on
PostgreSQL. The fence adds one locking read of the operation's row to the write's transaction; a
create makes three or four such writes.

    .venv/bin/python bench/fencing.py [--n 300] [--postgres postgresql+asyncpg://…]

Prints a markdown table and saves bench/results/<date>-fencing.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from space import ids  # noqa: E402
from space.lifecycle import State  # noqa: E402
from space.store import Operation, Sandbox, Store, fencing  # noqa: E402


def _pcts(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p50": round(at(0.5), 3), "p90": round(at(0.9), 3), "p99": round(at(0.99), 3), "n": len(xs)}


async def _measure(url: str, n: int) -> dict[str, Any]:
    async with await Store.open(url) as store:
        sb = Sandbox(id=ids.sandbox_id(), tenant="bench", template="base", cpu=1.0, memory_mb=256, disk_mb=1024,
                     state=State.RUNNING)
        op = Operation(id=ids.operation_id(), tenant="bench", kind="sandbox.pause", target=sb.id, request={})
        await store.create_sandbox(sb, op)
        claimed = await store.claim_operation("bench", 600)
        assert claimed is not None
        plain: list[float] = []
        fenced: list[float] = []
        for i in range(n):
            for kind in (("plain", "fenced") if i % 2 else ("fenced", "plain")):
                t0 = time.perf_counter()
                if kind == "fenced":
                    with fencing.fenced(claimed.id, "bench"):
                        await store.update_sandbox(sb.id, error_message=f"w{i}")
                    fenced.append((time.perf_counter() - t0) * 1000)
                else:
                    await store.update_sandbox(sb.id, error_message=f"w{i}")
                    plain.append((time.perf_counter() - t0) * 1000)
        return {"unfenced_ms": _pcts(plain), "fenced_ms": _pcts(fenced),
                "ratio_p50": round(statistics.median(fenced) / statistics.median(plain), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--postgres", default=None, help="a throwaway database (its schema is migrated)")
    args = ap.parse_args()
    res: dict[str, Any] = {"date": dt.date.today().isoformat(), "n": args.n}
    with tempfile.TemporaryDirectory() as d:
        res["sqlite"] = asyncio.run(_measure(f"sqlite+aiosqlite:///{d}/bench.db", args.n))
    if args.postgres:
        res["postgresql"] = asyncio.run(_measure(args.postgres, args.n))
    lines = ["| store | unfenced write p50/p90/p99 (ms) | fenced write p50/p90/p99 (ms) | ratio (p50) |",
             "|---|---|---|---|"]
    for name in ("sqlite", "postgresql"):
        if name in res:
            u, f = res[name]["unfenced_ms"], res[name]["fenced_ms"]
            lines.append(f"| {name} | {u['p50']} / {u['p90']} / {u['p99']} | {f['p50']} / {f['p90']} / {f['p99']} "
                         f"| {res[name]['ratio_p50']}x |")
    table = "\n".join(lines)
    print(table)
    out = REPO / "bench" / "results" / f"{res['date']}-fencing"
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"# Fenced writes, same run (n={args.n} each, alternating)\n\n{table}\n")


if __name__ == "__main__":
    main()
