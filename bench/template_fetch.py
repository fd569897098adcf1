"""Template download (issue 13, finding 7): what a node that lacks a template pays to get it from
object storage, as a restore on a fresh node does.

Run through ``bench/run --only template_fetch``. A sandbox is suspended once (which publishes
``base`` to the server's object store); then, N times, a fresh node agent (its own pool and an
empty template cache, registered with the server, sharing its object store) restores it. Measured:
the restore end to end (API → operation done), and from the fresh node's own log the template's
download (with its verification, where the code verifies) and its ``btrfs receive``. The sandbox is
suspended again after each restore, so the next fresh node restores the same way.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.lifecycle import Bench, ms_since, summary, table_row
from tests.e2e.harness import NodeAgent, Server, node_scratch

PARTS = ("template_fetch",)
#: A structlog line, JSON (``"seconds": 1.2``) or console (``seconds=1.2``).
_SECONDS = re.compile(r'seconds"?[=:] ?([0-9.]+)')


@dataclasses.dataclass(frozen=True)
class Plan:
    nodes: int = 3


FULL = Plan()
QUICK = Plan(nodes=1)


def _logged_seconds(log: Path, event: str) -> float | None:
    for line in log.read_text(errors="replace").splitlines():
        if event in line and (m := _SECONDS.search(line)):
            return float(m.group(1)) * 1000
    return None


def bench_template_fetch(b: Bench, plan: Plan, log: Callable[[str], None] = print) -> dict[str, Any]:
    restore_ms: list[float] = []
    download_ms: list[float] = []
    receive_ms: list[float] = []
    stream_bytes = 0
    with b.sandboxes() as ids:
        sid = b.sandbox()
        ids.append(sid)
        b.act(f"/v1/sandboxes/{sid}/suspend", {"memory": False})
        for i in range(plan.nodes):
            scratch = node_scratch(f"bench-fetch-{i}-")
            node = NodeAgent(node_id=f"fetch-{i}", data_dir=scratch / "data", cache_dir=scratch / "cache",
                             log_path=scratch / "node.log", object_store_url=str(b.srv.data_dir / "objects"))
            try:
                node.start(b.srv)
                t0 = time.perf_counter()
                b.act(f"/v1/sandboxes/{sid}/restore", {"node": node.node_id})
                restore_ms.append(ms_since(t0))
                got = _logged_seconds(node.log_path, "template.downloaded")
                rec = _logged_seconds(node.log_path, "template.received")
                if got is None or rec is None:
                    raise b.fail(f"fresh node {node.node_id} did not download and receive the template",
                                 node.log_tail())
                download_ms.append(got)
                receive_ms.append(rec)
                stream_bytes = max(p.stat().st_size for p in (node.cache_dir / "templates").iterdir())
                log(f"template_fetch: node {i}: restore {restore_ms[-1]:.0f} ms, download {got:.0f} ms, "
                    f"receive {rec:.0f} ms")
                b.act(f"/v1/sandboxes/{sid}/suspend", {"memory": False})
            finally:
                node.teardown()
                shutil.rmtree(scratch, ignore_errors=True)
    return {"restore_ms": summary(restore_ms), "download_ms": summary(download_ms),
            "receive_ms": summary(receive_ms), "stream_bytes": stream_bytes}


def run_all(srv: Server, plan: Plan, log: Callable[[str], None] = print) -> dict[str, Any]:
    b = Bench(srv)
    try:
        log("template_fetch ...")
        return {"template_fetch": bench_template_fetch(b, plan, log)}
    finally:
        b.close()


def table_rows(res: dict[str, Any]) -> tuple[list[str], list[str]]:
    rows: list[str] = []
    notes: list[str] = []
    if tf := res.get("template_fetch"):
        rows.append(table_row("restore on a fresh node (template from object storage) (ms)", tf["restore_ms"]))
        rows.append(table_row("  of which: template download + verification (ms)", tf["download_ms"]))
        rows.append(table_row("  of which: template btrfs receive (ms)", tf["receive_ms"]))
        notes.append(f"template_fetch: base's stream is {tf['stream_bytes'] / 2**20:.1f} MiB compressed")
    return rows, notes
