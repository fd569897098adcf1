"""bench/run's parts with deployments of their own: every figure the saved results of
bench/cluster.py, bench/drain.py, bench/backup.py and bench/template_image.py hold becomes a row of
the one table."""

from __future__ import annotations

import json
from pathlib import Path

from bench import deployed

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_saved_results_of_each_script_become_rows_of_the_one_table() -> None:
    res = {part: json.loads((RESULTS / name).read_text()) for part, name in (
        ("cluster", "2026-12-02-cluster.json"), ("drain", "2026-12-03-drain.json"),
        ("backup", "2026-12-03-backup.json"), ("template_image", "2026-12-07-template-image.json"))}
    rows, notes = deployed.table_rows(res)
    assert all(r.startswith("| ") and r.count("|") == 8 for r in rows), rows
    text = "\n".join(rows)
    for metric in ("via a replica, PostgreSQL", "concurrent creates across 2 replicas", "mutual TLS",
                   "leader failover", "drain, idle: the guest frozen per move", "drain, mem100: one move in all",
                   "continuous backup: traffic", "longest gap", "template from a container image: build",
                   "the same tag again", "a sandbox of an image template"):
        assert metric in text, metric
    assert any("served warm" in n for n in notes)
    assert deployed.table_rows({}) == ([], [])
    # A part whose script failed is named as failed; the others keep their rows.
    rows2, notes2 = deployed.table_rows({**res, "drain": {"failed": "bench/drain.py exited with 1"}})
    assert not any("drain" in r for r in rows2) and any("via a replica" in r for r in rows2)
    assert any(n.startswith("drain: FAILED") for n in notes2)


def test_each_part_has_a_script_that_takes_out() -> None:
    for part in deployed.PARTS:
        script, _, _ = deployed.SCRIPTS[part]
        assert '"--out"' in (RESULTS.parents[1] / script).read_text(), script
