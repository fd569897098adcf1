"""The A/B of the bursts: per side, the median over bursts of each burst's p50, and B/A with a 95 %
bootstrap interval (resampling bursts).

    python stats.py 'A-GLOB[,GLOB]' 'B-GLOB[,GLOB]'     (globs in this directory)
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(globs: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for g in globs.split(","):
        for f in sorted(HERE.glob(g)):
            for k, v in json.loads(f.read_text()).items():
                out.setdefault(k, []).extend(v)
    return out


def interval(a: list[float], b: list[float], n: int = 4000) -> tuple[float, float]:
    rnd = random.Random(1)
    rs = sorted(statistics.median(rnd.choices(b, k=len(b))) / statistics.median(rnd.choices(a, k=len(a)))
                for _ in range(n))
    return rs[int(0.025 * n)], rs[int(0.975 * n)]


def main() -> None:
    a_all, b_all = load(sys.argv[1]), load(sys.argv[2])
    for k, a_raw in a_all.items():
        b_raw = b_all.get(k)
        if not a_raw or not b_raw:
            continue
        a = [statistics.median(x) if isinstance(x, list) else x for x in a_raw]
        b = [statistics.median(x) if isinstance(x, list) else x for x in b_raw]
        lo, hi = interval(a, b)
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {k} | {len(a)} / {len(b)} | {ma:.1f} | {mb:.1f} | {mb / ma:.2f} | {lo:.2f}-{hi:.2f} |")


if __name__ == "__main__":
    main()
