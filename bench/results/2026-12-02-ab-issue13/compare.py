#!/usr/bin/env python3
"""Print p50s of base vs main from /work/ab/*.json: every .p50 leaf (ms or MB/s), both rounds."""
import json, glob, re, statistics, sys
from pathlib import Path

def leaves(x, p=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, f"{p}.{k}" if p else k)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield p, float(x)

rows = {}
for f in sorted(glob.glob("/work/ab/*.json")):
    name = Path(f).stem            # base-1-basic, main-life ...
    tree = name.split("-")[0]
    for k, v in leaves(json.load(open(f))):
        if re.search(r"\.(p50|mb_s|MB_s|mbps)$", k) or k.endswith("p50") or "mb_per_s" in k or "MBps" in k:
            rows.setdefault(k, {}).setdefault(tree, []).append(v)
print("| metric | base p50 | main p50 | main/base |\n|---|---|---|---|")
for k in sorted(rows):
    b, m = rows[k].get("base"), rows[k].get("main")
    if not b or not m:
        continue
    bm, mm = statistics.median(b), statistics.median(m)
    ratio = mm / bm if bm else float("nan")
    fmt = lambda xs: "/".join(f"{x:.1f}" for x in xs)
    print(f"| {k} | {fmt(b)} | {fmt(m)} | {ratio:.2f} |")
