#!/usr/bin/env python3
"""Generate the sync SDK (space/sdk/_sync) from the async one (space/sdk/_async).

The async code is the only source; the sync twin is derived token by token, never edited by hand.

    python scripts/unasync.py           # regenerate space/sdk/_sync
    python scripts/unasync.py --check   # exit 1 if the committed files differ from a fresh run
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# This script shares its name with the package it drives: keep its own directory off the path
# (and import by name, so type checkers do not take this file for the package).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
unasync: Any = importlib.import_module("unasync")

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "space" / "sdk" / "_async"
DST = ROOT / "space" / "sdk" / "_sync"

# On top of unasync's defaults (async/await dropped, __aenter__ -> __enter__, AsyncIterator ->
# Iterator, asynccontextmanager -> contextmanager, other Async* names -> Sync*).
REPLACEMENTS = {
    "AsyncClient": "Client",  # ours, and httpx.AsyncClient -> httpx.Client
    "AsyncBaseTransport": "BaseTransport",
    "AsyncSandbox": "Sandbox",
    "AsyncSandboxes": "Sandboxes",
    "AsyncCommand": "Command",
    "AsyncFiles": "Files",
    "AsyncOperations": "Operations",
    "AsyncTemplates": "Templates",
    "AsyncApiKeys": "ApiKeys",
    "AsyncPools": "Pools",
    "AsyncNodes": "Nodes",
    "AsyncJoinTokens": "JoinTokens",
    "AsyncQuotas": "Quotas",
    "AsyncAudit": "Audit",
    "AsyncSecrets": "Secrets",
    "aclose": "close",
    "aread": "read",
    "aiter_lines": "iter_lines",
    "aiter_bytes": "iter_bytes",
    "anyio": "time",  # only anyio.sleep is used: it becomes time.sleep
}

HEADER = "# Generated from space/sdk/_async/{name} by scripts/unasync.py: do not edit.\n"


def render() -> dict[str, str]:
    """The sync files a fresh run produces, by file name."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "_async"
        shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
        rule = unasync.Rule("/_async/", "/_sync/", additional_replacements=REPLACEMENTS)
        unasync.unasync_files([str(p) for p in sorted(src.glob("*.py"))], rules=[rule])
        out = sorted((Path(tmp) / "_sync").glob("*.py"))
        return {p.name: HEADER.format(name=p.name) + p.read_text() for p in out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if space/sdk/_sync is out of date")
    args = parser.parse_args()
    expected = render()
    current = {p.name: p.read_text() for p in sorted(DST.glob("*.py"))} if DST.is_dir() else {}
    names = expected.keys() | current.keys()
    drift = sorted(name for name in names if expected.get(name) != current.get(name))
    if args.check:
        for name in drift:
            print(f"out of date: {DST.relative_to(ROOT) / name}", file=sys.stderr)
        if drift:
            print("run: python scripts/unasync.py", file=sys.stderr)
        return 1 if drift else 0
    DST.mkdir(exist_ok=True)
    for name in drift:
        path = DST / name
        if name in expected:
            path.write_text(expected[name])
            print(f"wrote {path.relative_to(ROOT)}")
        else:
            path.unlink()
            print(f"removed {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
