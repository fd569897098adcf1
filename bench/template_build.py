#!/usr/bin/env python3
"""How long template builds take, through a real ``space serve`` and the CLI (needs root).

    ./.venv/bin/python bench/template_build.py [--runs 1] [--out FILE]

Two builds per run, each of a spec no cache holds (a nonce in it):

- ``scratch``: a debootstrap base from nothing (``[base] suite = "bookworm"``, the packages of
  ``base``) with the machine's debootstrap package cache copied in (a warm apt cache: no package
  download from the mirror, only its indexes);
- ``steps``: derived from ``base`` with an apt, a pip and two run steps (the mirror's indexes, a
  Debian package and a PyPI package are downloaded).

The server has a template cache of its own (seeded with the machine's ``base`` stream and
debootstrap packages), so nothing it builds lands in the shared ``/var/cache/space``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.harness import SCRATCH, SPACE, Server, own_server  # noqa: E402

SHARED_CACHE = Path("/var/cache/space")

SCRATCH_TOML = """
[base]
suite = "bookworm"
[build]
run = ["echo {nonce} > /etc/bench-nonce"]
"""

STEPS_TOML = """
[base]
template = "base"
[build]
apt = ["jq"]
pip = ["six==1.16.0"]
run = ["echo {nonce} > /etc/bench-nonce", "python3 -c 'import six; print(six.__version__)'"]
"""

_BUILT = re.compile(r" built in (\d+)s")


def seed_cache(cache: Path) -> None:
    """The machine's debootstrap packages and base stream, copied (never linked: ours to delete)."""
    for part in ("debootstrap", "templates"):
        (cache / part).mkdir(parents=True, exist_ok=True)
    for deb in (SHARED_CACHE / "debootstrap").glob("*.deb"):
        shutil.copy2(deb, cache / "debootstrap" / deb.name)
    for stream in (SHARED_CACHE / "templates").glob("base-*.btrfs.zst"):
        shutil.copy2(stream, cache / "templates" / stream.name)


def build(server: Server, name: str, toml: str, workdir: Path) -> dict[str, Any]:
    f = workdir / f"{name}.toml"
    f.write_text(toml.format(nonce=uuid.uuid4().hex))
    env = {**os.environ, "SPACE_URL": server.url, "SPACE_API_KEY": server.admin_key}
    started = time.monotonic()
    p = subprocess.run([SPACE, "template", "build", name, "-f", str(f)], env=env, capture_output=True,
                       text=True, timeout=3600)
    wall = time.monotonic() - started
    if p.returncode != 0:
        raise SystemExit(f"build {name} failed ({p.returncode}):\n{p.stderr[-4000:]}\n{server.log_tail()}")
    m = _BUILT.search(p.stderr)
    return {"name": name, "wall_s": round(wall, 1), "server_s": int(m.group(1)) if m else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    SCRATCH.mkdir(mode=0o711, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=SCRATCH, prefix="bench-build-"))
    os.chmod(tmp, 0o755)
    cache = tmp / "cache"
    seed_cache(cache)
    results: dict[str, list[dict[str, Any]]] = {"scratch": [], "steps": []}
    try:
        with own_server(tmp, "--cache-dir", str(cache)) as srv:
            for i in range(args.runs):
                for kind, toml in (("scratch", SCRATCH_TOML), ("steps", STEPS_TOML)):
                    r = build(srv, f"bench-{kind}-{i}", toml, tmp)
                    print(f"{kind} run {i}: {r['wall_s']}s through the CLI (server: built in {r['server_s']}s)",
                          flush=True)
                    results[kind].append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {k: statistics.median(r["wall_s"] for r in v) for k, v in results.items() if v}
    print(json.dumps({"median_wall_s": summary, "runs": results}, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps({"median_wall_s": summary, "runs": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
