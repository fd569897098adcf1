#!/usr/bin/env python3
"""The adversarial suite's probes (tests marked ``@pytest.mark.probe("what it tried")``), as the
README's security table.

    scripts/security_probes.py            list them: test, what it tried (markdown)
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
    ap.add_argument("pytest_args", nargs="*", help="further pytest arguments")
    args = ap.parse_args()
    probes = _Probes()
    argv = [str(REPO / "tests" / "security"), "-m", "probe", "-p", "no:cacheprovider", *args.pytest_args]
    if not args.run:
        argv += ["--collect-only", "-q"]
    code = pytest.main(argv, plugins=[probes])
    print()
    print("| probe | what it tried | outcome |" if args.run else "| probe | what it tried |")
    print("|---|---|---|" if args.run else "|---|---|")
    for nodeid, tried in sorted(probes.tried.items()):
        name = nodeid.removeprefix("tests/security/")
        if args.run:
            outcome = probes.outcome.get(nodeid, "not run")
            shown = {"passed": "reached nothing", "failed": "**reached**"}.get(outcome, outcome)
            print(f"| `{name}` | {tried} | {shown} |")
        else:
            print(f"| `{name}` | {tried} |")
    reached = sum(1 for o in probes.outcome.values() if o == "failed")
    print(f"\n{len(probes.tried)} probes" + (f", {reached} reached" if args.run else ""))
    return int(code) if args.run else 0


if __name__ == "__main__":
    sys.exit(main())
