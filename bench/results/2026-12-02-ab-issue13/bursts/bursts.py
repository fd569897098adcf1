"""Bursts of 20 concurrent creates, repeated on one server of the work tree given (issue 13's A/B).

    python bursts.py TREE ROUNDS OUT.json [--settled]

Each round: a warm pool of 20, a burst of 20 creates, their deletes; then no pool and a burst of
20 cold creates, their deletes. Default: ``bench/create.py``'s own sequence (nothing waits for the
node to finish removing what was deleted). ``--settled``: before each burst, wait until the node's
trash is empty. Run it with TREE's virtualenv, so that the server is TREE's.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    tree, rounds, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    settled = "--settled" in sys.argv
    sys.path.insert(0, str(tree))
    from bench.create import _burst, set_pool, wait_ready
    from bench.lifecycle import Bench
    from tests.e2e.harness import Server, free_port

    res: dict[str, list[Any]] = {"warm": [], "cold": [], "delete_warm_s": [], "delete_cold_s": []}
    with tempfile.TemporaryDirectory(prefix="space-burst-") as tmp:
        srv = Server(data_dir=Path(tmp) / "data", port=free_port(), log_path=Path(tmp) / "serve.log",
                     extra_args=["--pool-size-gb", "32"])
        srv.start()
        try:
            b = Bench(srv)

            def burst(kind: str) -> None:
                """20 creates at once, then their deletes (timed)."""
                lat, _, ids = _burst(b, 20)
                res[kind].append(sorted(lat))
                t = time.monotonic()
                b.delete(ids)
                res[f"delete_{kind}_s"].append(time.monotonic() - t)

            for r in range(rounds):
                set_pool(b, 20)
                wait_ready(b, 20, 300, settled=settled)
                burst("warm")
                set_pool(b, 0)
                if settled:
                    wait_ready(b, 0, 300, settled=True)
                burst("cold")
                wait_ready(b, 0, 300, settled=True)
                print(r, round(statistics.median(res["warm"][-1])), round(statistics.median(res["cold"][-1])),
                      flush=True)
            b.close()
        finally:
            out.write_text(json.dumps(res))
            srv.teardown()


if __name__ == "__main__":
    main()
