#!/usr/bin/env python3
"""The A/B table: every p50 (and MB/s) leaf of ``base-*.json`` against ``main-*.json`` in a directory
(default: this one), each run's value shown, the ratio of their medians."""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_WANTED = re.compile(r"(\.p50|mb_per_s)$")


def leaves(x: Any, path: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, float(x)


def main() -> None:
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    rows: dict[str, dict[str, list[float]]] = {}
    for f in sorted(where.glob("*.json")):
        tree = f.stem.split("-")[0]
        for k, v in leaves(json.loads(f.read_text())):
            if _WANTED.search(k):
                rows.setdefault(k, {}).setdefault(tree, []).append(v)
    print("| metric | base p50 | main p50 | main/base |\n|---|---|---|---|")
    for k in sorted(rows):
        base, main_ = rows[k].get("base"), rows[k].get("main")
        if not base or not main_:
            continue
        b, m = statistics.median(base), statistics.median(main_)
        shown = ["/".join(f"{x:.1f}" for x in xs) for xs in (base, main_)]
        print(f"| {k} | {shown[0]} | {shown[1]} | {m / b if b else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
