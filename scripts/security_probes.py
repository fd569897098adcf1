#!/usr/bin/env python3
"""The adversarial suite's probes (tests marked ``@pytest.mark.probe("what it tried")``), as the
README's security table.

    scripts/security_probes.py            list them: test, what it tried (markdown)
    scripts/security_probes.py --grouped  one row per probe test, with its number of cases
    scripts/security_probes.py --run      run them too, and say how many reached (failed)

A probe attacks from inside a sandbox and passes when it reached nothing, so "reached" is the
number that failed. A parametrized probe is one row per case.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


class _Probes:
    def __init__(self) -> None:
        self.tried: dict[str, str] = {}
        self.outcome: dict[str, str] = {}

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        for item in items:
            mark = item.get_closest_marker("probe")
            if mark is not None:
                self.tried[item.nodeid] = str(mark.args[0] if mark.args else mark.kwargs.get("tried", ""))

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.nodeid not in self.tried:
            return
        if report.when == "call" or report.outcome != "passed":
            previous = self.outcome.get(report.nodeid)
            if previous in (None, "passed"):
                self.outcome[report.nodeid] = report.outcome


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="run the probes, not only list them")
    ap.add_argument("--grouped", action="store_true", help="one row per probe test (its cases counted)")
    ap.add_argument("pytest_args", nargs="*", help="further pytest arguments")
    args = ap.parse_args()
    probes = _Probes()
    argv = [str(REPO / "tests" / "security"), "-m", "probe", "-p", "no:cacheprovider", *args.pytest_args]
    if not args.run:
        argv += ["--collect-only", "-q"]
    code = pytest.main(argv, plugins=[probes])
    print()
    rows: dict[str, list[str]] = {}
    for nodeid in sorted(probes.tried):
        key = nodeid.split("[", 1)[0] if args.grouped else nodeid
        rows.setdefault(key, []).append(nodeid)
    cols = ["probe", *(["cases"] if args.grouped else []), "what it tried", *(["outcome"] if args.run else [])]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for key, ids in rows.items():
        cells = [f"`{key.removeprefix('tests/security/')}`"]
        if args.grouped:
            cells.append(str(len(ids)))
        cells.append(probes.tried[ids[0]])
        if args.run:
            outcomes = [probes.outcome.get(i, "not run") for i in ids]
            failed = sum(1 for o in outcomes if o == "failed")
            cells.append("**reached**" if failed else "reached nothing" if all(o == "passed" for o in outcomes)
                         else ", ".join(sorted(set(outcomes))))
        print("| " + " | ".join(cells) + " |")
    reached = sum(1 for o in probes.outcome.values() if o == "failed")
    print(f"\n{len(probes.tried)} probes" + (f", {reached} reached" if args.run else ""))
    return int(code) if args.run else 0


if __name__ == "__main__":
    sys.exit(main())
