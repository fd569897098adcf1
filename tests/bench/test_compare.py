"""bench/compare's method: what it compares, its interval, its order, its runner and its table.
The benchmark itself is a seam here (a stand-in ``bench/run`` or runner); the real thing runs in
``bench/compare`` against real revisions and its tables are in bench/results/compare/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import ab

REPO = Path(__file__).resolve().parents[2]


def result(warm: float, exec_ms: float, mb_per_s: float) -> dict[str, Any]:
    """The shape of a bench/run JSON, trimmed."""
    return {"date": "2026-12-07", "parts": ["warm", "exec", "throughput"], "quick": False,
            "machine": {"cores": "2"},
            "creation": {"warm": {"warm_create_ms": {"n": 30, "p50": warm, "p90": warm * 1.5, "mean": warm},
                                  "ratio_warm_vs_cold_p50": 0.03}},
            "exec": {"space_exec_ms": {"n": 200, "p50": exec_ms, "p99": 80.0}, "ratio_p50": 1.2},
            "throughput": {"bytes": 1, "seconds": 2.0, "mb_per_s": mb_per_s},
            "lifecycle": {"plan": {"pause_n": 5}}}


def test_the_compared_metrics_are_the_medians_and_throughputs_not_derived_ratios_or_plans() -> None:
    assert ab.metrics(result(12.0, 40.0, 33.0)) == {
        "creation.warm.warm_create_ms.p50": 12.0, "exec.space_exec_ms.p50": 40.0, "throughput.mb_per_s": 33.0}
    assert ab.higher_is_better("throughput.mb_per_s")
    assert not ab.higher_is_better("exec.space_exec_ms.p50")


def test_the_interval_excludes_one_only_when_the_runs_tell_the_sides_apart() -> None:
    same = ab.ratio_interval([10.0, 11.0, 9.5, 10.4], [10.2, 9.8, 10.9, 10.1])
    assert same[0] < 1.0 < same[1]
    apart = ab.ratio_interval([10.0, 11.0, 9.5, 10.4], [15.0, 16.2, 14.8, 15.5])
    assert 1.3 < apart[0] <= apart[1] < 1.8
    assert ab.ratio_interval([10.0, 11.0, 9.5], [15.0, 16.2, 14.8]) == \
        ab.ratio_interval([10.0, 11.0, 9.5], [15.0, 16.2, 14.8])  # seeded: reproducible


def test_a_verdict_reads_the_direction_of_its_metric() -> None:
    slower_latency = ab.rows([result(10, 40, 100), result(11, 41, 101), result(10.5, 40, 99)],
                             [result(20, 40, 50), result(21, 41, 52), result(19, 40, 51)])
    by = {r.metric: r for r in slower_latency}
    assert by["creation.warm.warm_create_ms.p50"].verdict == "B slower"
    assert by["throughput.mb_per_s"].verdict == "B lower"
    assert by["throughput.mb_per_s"].worse and by["creation.warm.warm_create_ms.p50"].worse
    assert by["exec.space_exec_ms.p50"].verdict == "no difference shown"
    assert not by["exec.space_exec_ms.p50"].worse
    faster = ab.rows([result(20, 40, 50)] * 3, [result(10, 40, 100)] * 3)
    assert {r.metric: r.verdict for r in faster} == {
        "creation.warm.warm_create_ms.p50": "B faster", "exec.space_exec_ms.p50": "no difference shown",
        "throughput.mb_per_s": "B higher"}


def test_a_metric_only_one_side_measured_is_left_out() -> None:
    b = result(10, 40, 100)
    del b["throughput"]
    assert "throughput.mb_per_s" not in {r.metric for r in ab.rows([result(10, 40, 100)], [b])}


def test_the_order_is_counterbalanced() -> None:
    assert ab.schedule(3) == ["A", "B", "B", "A", "A", "B"]
    assert ab.schedule(1) == ["A", "B"]


def test_a_comparison_runs_both_sides_in_order_and_saves_every_run_and_the_table(tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []

    def runner(side: ab.Side, n: int, log_path: Path) -> dict[str, Any]:
        calls.append((side.label, n))
        log_path.write_text("ran\n")
        return result(10.0 + n * 0.1, 40.0, 100.0) if side.label == "A" else result(20.0 + n * 0.1, 40.0, 100.0)

    sides = (ab.Side("A", "main~1", "a" * 40, tmp_path), ab.Side("B", "main", "b" * 40, tmp_path))
    out = tmp_path / "cmp"
    cmp = ab.compare(sides, "warm", ["--quick"], 2, out, runner, log=lambda _m: None)
    assert calls == [("A", 1), ("B", 1), ("B", 2), ("A", 2)]
    assert sorted(p.name for p in out.iterdir()) == [
        "a-1.json", "a-1.log", "a-2.json", "a-2.log", "b-1.json", "b-1.log", "b-2.json", "b-2.log",
        "compare.json", "compare.md"]
    saved = json.loads((out / "compare.json").read_text())
    assert saved["sides"]["B"]["rev"] == "main" and saved["extra_args"] == ["--quick"]
    assert [r["side"] for r in saved["runs"]] == ["A", "B", "B", "A"]
    warm = next(r for r in saved["rows"] if r["metric"] == "creation.warm.warm_create_ms.p50")
    assert warm["a"] == [10.1, 10.2] and warm["b"] == [20.1, 20.2] and warm["verdict"] == "B slower"
    md = (out / "compare.md").read_text()
    assert "A = main~1 (aaaaaaaaaa), B = main (bbbbbbbbbb)" in md
    assert "| creation.warm.warm_create_ms.p50 | 10.1, 10.2 | 20.1, 20.2 |" in md and "**B slower**" in md
    assert ab.from_directory(out) == (cmp.runs["A"], cmp.runs["B"])


def test_revisions_resolve_to_commits_and_a_bad_one_is_named() -> None:
    head = ab.resolve("HEAD")
    assert len(head) == 40 and int(head, 16) >= 0
    assert ab.resolve(".") == "."
    with pytest.raises(ab.CompareError, match="'no-such-rev-xyz' does not name a commit"):
        ab.resolve("no-such-rev-xyz")


def _fake_tree(root: Path, script: str) -> Path:
    """A tree whose bench/run is ``script`` and whose .venv/bin/python is this interpreter."""
    (root / "bench" / "results").mkdir(parents=True)
    (root / "bench" / "run").write_text(script)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").symlink_to(sys.executable)
    return root


_WRITES_OUT = """
import json, sys
from pathlib import Path
# takes --out
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
assert args[:2] == ["--only", "warm"], args
print("environment:", sorted(k for k in __import__("os").environ if k.startswith(("SPACE_", "AWS_"))))
(out / "2026-12-07-warm.json").write_text(json.dumps({"creation": {"warm": {"warm_create_ms": {"p50": 12.5}}}}))
(out / "2026-12-07-warm.md").write_text("table")
"""


def test_the_runner_reads_what_bench_run_saved_in_its_scratch_dir_without_the_callers_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPACE_URL", "http://example.invalid")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "caller's")
    tree = _fake_tree(tmp_path / "t", _WRITES_OUT)
    got = ab.bench_run("warm", [])(ab.Side("A", ".", ".", tree), 1, tmp_path / "a-1.log")
    assert got == {"creation": {"warm": {"warm_create_ms": {"p50": 12.5}}}}
    assert "environment: []" in (tmp_path / "a-1.log").read_text()
    assert list((tree / "bench" / "results").iterdir()) == []


def test_an_older_bench_run_without_out_leaves_its_scratch_tree_as_it_was(tmp_path: Path) -> None:
    # The day's results were committed under the same name: the run overwrites them.
    old = """
import json
from pathlib import Path
results = Path("bench/results")
(results / "2026-12-07-warm.json").write_text(json.dumps({"exec": {"space_exec_ms": {"p50": 40.0}}}))
(results / "2026-12-07-warm.md").write_text("new table")
"""
    tree = _fake_tree(tmp_path / "t", old)
    (tree / "bench" / "results" / "2026-12-07-warm.json").write_text('{"committed": true}')
    (tree / "bench" / "results" / "older.json").write_text('{"older": true}')
    git = ["git", "-C", str(tree), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "bench"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    got = ab.bench_run("warm", [])(ab.Side("A", "old", "c" * 40, tree), 1, tmp_path / "a-1.log")
    assert got == {"exec": {"space_exec_ms": {"p50": 40.0}}}
    status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=all", "bench"],
                            capture_output=True, text=True, check=True).stdout
    assert status == ""
    assert json.loads((tree / "bench" / "results" / "2026-12-07-warm.json").read_text()) == {"committed": True}


def test_a_failed_run_names_its_log(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path / "t", "# --out\nraise SystemExit(3)\n")
    with pytest.raises(ab.CompareError, match=r"run 1 of B \(worktree\) failed \(exit 3\); see .*b-1.log"):
        ab.bench_run("warm", [])(ab.Side("B", ".", ".", tree), 1, tmp_path / "b-1.log")


def test_the_table_of_a_saved_comparison_and_its_exit_status(tmp_path: Path) -> None:
    for n, (a, b) in enumerate([(10.0, 20.0), (10.5, 21.0), (9.8, 19.5)], 1):
        (tmp_path / f"a-{n}.json").write_text(json.dumps(result(a, 40, 100)))
        (tmp_path / f"b-{n}.json").write_text(json.dumps(result(b, 40, 100)))
    done = subprocess.run([sys.executable, str(REPO / "bench" / "compare"), "--table", str(tmp_path)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 1, done.stderr
    assert "| creation.warm.warm_create_ms.p50 | 10, 10.5, 9.8 | 20, 21, 19.5 |" in done.stdout
    assert "**B slower**" in done.stdout
