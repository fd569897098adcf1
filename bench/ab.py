"""Same-run A/B of two revisions: the machinery behind ``bench/compare``.

A machine's own speed drifts between days (and within an hour) by more than most changes move a
hot path, so a number is only comparable with one taken beside it. ``compare`` builds each revision
once in a scratch work tree with its own virtualenvs (kept under ``--trees`` and reused while the
commit is the same), then runs ``bench/run --only PARTS`` from each tree in counterbalanced order
(A B, B A, A B, ...: a drift that is linear in time falls on both sides equally), each run a fresh
``space serve`` on a scratch data dir. Every ``p50`` (and every throughput) leaf of the runs' JSON
becomes one row: both sides' values per run, the median of each side, the ratio B/A of the medians
and a 95 % confidence interval of that ratio, bootstrapped over the runs (each side resampled with
replacement). A row's verdict names a difference only when the interval excludes 1.

With three runs a side the interval is wide by construction: it says what these runs can and
cannot tell apart, which is the point. More rounds narrow it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TREES = Path("/var/tmp/space-compare")
# The checkout itself, uncommitted changes included, with the virtualenvs it already has.
THIS_CHECKOUT = "."

# Leaves compared: every median, and throughputs (which are single numbers per run).
_WANTED = re.compile(r"(\.p50|(^|\.)[a-z_]*per_s)$")
# Higher is better for these; lower for everything else (latencies).
_HIGHER_IS_BETTER = re.compile(r"per_s$")
# Derived ratios inside one run say nothing across runs that their parts do not.
_SKIPPED = re.compile(r"(^|\.)ratio[a-z_]*(\.|$)")
# Variables of the caller's shell that must not steer a benchmark (the README has users export them).
_SCRUBBED_ENV = re.compile(r"^(SPACE_|AWS_)")

Runner = Callable[["Side", int, Path], dict[str, Any]]


class CompareError(Exception):
    """A comparison that cannot go on: a revision that does not resolve, a tree that does not build,
    a run that fails. The message says which and where its log is."""


@dataclasses.dataclass(frozen=True)
class Side:
    label: str  # "A" or "B"
    rev: str  # as the user named it
    commit: str  # the full hash, or "." for this checkout as it is
    tree: Path

    @property
    def short(self) -> str:
        return "worktree" if self.commit == THIS_CHECKOUT else self.commit[:10]


@dataclasses.dataclass(frozen=True)
class Row:
    metric: str
    higher_is_better: bool
    a: list[float]
    b: list[float]
    median_a: float
    median_b: float
    ratio: float
    ci_low: float
    ci_high: float

    @property
    def verdict(self) -> str:
        """``B faster``/``B slower`` (or ``B higher``/``B lower`` for throughputs) when the interval
        excludes 1, else ``no difference shown``."""
        if self.ci_low > 1.0:
            return "B higher" if self.higher_is_better else "B slower"
        if self.ci_high < 1.0:
            return "B lower" if self.higher_is_better else "B faster"
        return "no difference shown"

    @property
    def worse(self) -> bool:
        return self.verdict in ("B slower", "B lower")


# -- what is compared ---------------------------------------------------------------------------


def leaves(tree: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every numeric leaf of a JSON tree, as (dotted path, value)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, float(tree)


def metrics(result: dict[str, Any]) -> dict[str, float]:
    """The compared leaves of one ``bench/run`` result."""
    return {k: v for k, v in leaves(result) if _WANTED.search(k) and not _SKIPPED.search(k) and math.isfinite(v)}


def higher_is_better(metric: str) -> bool:
    return bool(_HIGHER_IS_BETTER.search(metric))


def ratio_interval(a: Sequence[float], b: Sequence[float], *, resamples: int = 10_000,
                   seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of median(b) / median(a), each side resampled with
    replacement over its runs. Seeded: the same runs always give the same interval."""
    rng = random.Random(seed)
    ratios: list[float] = []
    for _ in range(resamples):
        ma = statistics.median(rng.choices(a, k=len(a)))
        mb = statistics.median(rng.choices(b, k=len(b)))
        if ma > 0:
            ratios.append(mb / ma)
    if not ratios:
        return math.nan, math.nan
    ratios.sort()
    return ratios[int(0.025 * (len(ratios) - 1))], ratios[math.ceil(0.975 * (len(ratios) - 1))]


def rows(runs_a: Sequence[dict[str, Any]], runs_b: Sequence[dict[str, Any]]) -> list[Row]:
    """One row per metric both sides measured in every run, sorted by name."""
    ma = [metrics(r) for r in runs_a]
    mb = [metrics(r) for r in runs_b]
    common = set.intersection(*(set(m) for m in ma + mb)) if ma and mb else set()
    out: list[Row] = []
    for name in sorted(common):
        a = [m[name] for m in ma]
        b = [m[name] for m in mb]
        med_a, med_b = statistics.median(a), statistics.median(b)
        lo, hi = ratio_interval(a, b)
        out.append(Row(name, higher_is_better(name), a, b, med_a, med_b,
                       med_b / med_a if med_a else math.nan, lo, hi))
    return out


def table(sides: tuple[Side, Side], found: Sequence[Row]) -> str:
    a, b = sides
    head = [f"A = {a.rev} ({a.short}), B = {b.rev} ({b.short}); each run's value, in run order.", "",
            "| metric | A runs | B runs | A median | B median | B/A | 95 % CI | verdict |",
            "|---|---|---|---|---|---|---|---|"]
    body = []
    for r in found:
        unit = " (higher is better)" if r.higher_is_better else ""
        verdict = f"**{r.verdict}**" if r.verdict != "no difference shown" else r.verdict
        body.append(f"| {r.metric}{unit} | {_values(r.a)} | {_values(r.b)} | {r.median_a:.4g} | {r.median_b:.4g} "
                    f"| {r.ratio:.3f} | {r.ci_low:.3f} to {r.ci_high:.3f} | {verdict} |")
    return "\n".join(head + body)


def _values(xs: Sequence[float]) -> str:
    return ", ".join(f"{x:.4g}" for x in xs)


def schedule(rounds: int) -> list[str]:
    """The run order: A B, then B A, then A B... (counterbalanced, so linear drift falls on both)."""
    order: list[str] = []
    for i in range(rounds):
        order += ["A", "B"] if i % 2 == 0 else ["B", "A"]
    return order


# -- the trees ----------------------------------------------------------------------------------


def resolve(rev: str, repo: Path = REPO) -> str:
    """The full commit hash ``rev`` names in ``repo`` ("." stays ".": this checkout as it is)."""
    if rev == THIS_CHECKOUT:
        return rev
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise CompareError(f"{rev!r} does not name a commit in {repo}")
    return done.stdout.strip()


def tree_for(commit: str, trees: Path, repo: Path = REPO) -> Path:
    return repo if commit == THIS_CHECKOUT else trees / commit[:12]


_READY = ".space-compare-ready"
BUILD_TARGETS = ("python", "gateway", "access")


def prepare(commit: str, trees: Path, log: Callable[[str], None], repo: Path = REPO) -> Path:
    """A work tree of ``commit`` with its virtualenvs built (``make python gateway access`` there,
    those of the targets its Makefile has), reused while it is complete. This checkout (".") is
    used as it is."""
    tree = tree_for(commit, trees, repo)
    if commit == THIS_CHECKOUT:
        if not (tree / ".venv" / "bin" / "python").exists():
            raise CompareError(f"{tree} has no .venv: run `make setup` there first")
        return tree
    if (tree / _READY).exists():
        return tree
    trees.mkdir(parents=True, exist_ok=True)
    if not (tree / ".git").exists():
        if tree.exists():
            shutil.rmtree(tree)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], check=True, capture_output=True)
        done = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), commit],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise CompareError(f"git worktree add {tree} {commit[:12]} failed: {done.stderr.strip()}")
    build_log = tree / "compare-build.log"
    # Older trees lack some of these targets (the gateway's venv and the service users came later).
    makefile = (tree / "Makefile").read_text()
    targets = [t for t in BUILD_TARGETS if re.search(rf"^{t}:", makefile, re.MULTILINE)]
    log(f"building {commit[:12]} in {tree} (make {' '.join(targets)}; log: {build_log}) ...")
    # `make python` points /usr/local/bin/space at the tree it runs in: put the user's link back.
    cli_link = Path("/usr/local/bin/space")
    kept = os.readlink(cli_link) if cli_link.is_symlink() else None
    try:
        with build_log.open("w") as out:
            done_make = subprocess.run(["make", *targets], cwd=tree, stdout=out,
                                       stderr=subprocess.STDOUT, env=scrubbed_env())
    finally:
        if kept is not None:
            cli_link.unlink(missing_ok=True)
            cli_link.symlink_to(kept)
    if done_make.returncode != 0:
        raise CompareError(f"building {commit[:12]} failed (exit {done_make.returncode}); see {build_log}")
    (tree / _READY).write_text(commit + "\n")
    return tree


def prune(trees: Path, repo: Path = REPO) -> list[Path]:
    """Remove every cached work tree under ``trees``; returns what was removed."""
    gone: list[Path] = []
    if trees.is_dir():
        for tree in sorted(p for p in trees.iterdir() if p.is_dir()):
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                           capture_output=True)
            shutil.rmtree(tree, ignore_errors=True)
            gone.append(tree)
    subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)
    return gone


def scrubbed_env() -> dict[str, str]:
    """This process's environment without the caller's SPACE_* and AWS_* settings."""
    return {k: v for k, v in os.environ.items() if not _SCRUBBED_ENV.match(k)}


def bench_run(parts: str, extra: Sequence[str]) -> Runner:
    """The real runner: ``bench/run --only PARTS EXTRA`` from the side's tree, its output in
    ``log_path``, its result the JSON it saved. A ``bench/run`` that takes ``--out`` saves into a
    scratch directory; an older one saves under its tree's bench/results (a scratch tree: the newest
    JSON there is the run's, and the tree gets its files back afterwards)."""
    def run(side: Side, index: int, log_path: Path) -> dict[str, Any]:
        script = side.tree / "bench" / "run"
        takes_out = "--out" in script.read_text()
        if not takes_out and side.commit == THIS_CHECKOUT:
            raise CompareError(f"{script} does not take --out")
        with tempfile.TemporaryDirectory(prefix="space-compare-") as scratch:
            results = Path(scratch) if takes_out else side.tree / "bench" / "results"
            started = time.time()
            with log_path.open("w") as out:
                done = subprocess.run([str(side.tree / ".venv" / "bin" / "python"), "bench/run", "--only", parts,
                                       *extra, *(["--out", scratch] if takes_out else [])], cwd=side.tree,
                                      stdout=out, stderr=subprocess.STDOUT, env=scrubbed_env())
            if done.returncode != 0:
                raise CompareError(f"run {index} of {side.label} ({side.short}) failed (exit {done.returncode}); "
                                   f"see {log_path}")
            fresh = [p for p in results.glob("*.json") if p.stat().st_mtime >= started - 1]
            if not fresh:
                raise CompareError(f"run {index} of {side.label} ({side.short}) saved no JSON; see {log_path}")
            newest = max(fresh, key=lambda p: p.stat().st_mtime)
            saved: dict[str, Any] = json.loads(newest.read_text())
            if not takes_out:
                _put_back(side.tree, [newest, newest.with_suffix(".md")])
            return saved
    return run


def _put_back(tree: Path, files: Sequence[Path]) -> None:
    """The results a run wrote into its scratch tree are the comparison's now: a tracked file gets
    its committed text back, an untracked one goes (the tree stays clean for the next run)."""
    for f in files:
        tracked = subprocess.run(["git", "-C", str(tree), "ls-files", "--error-unmatch", str(f)],
                                 capture_output=True).returncode == 0
        if tracked:
            subprocess.run(["git", "-C", str(tree), "checkout", "--", str(f)], capture_output=True)
        else:
            f.unlink(missing_ok=True)


# -- the comparison -----------------------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    sides: tuple[Side, Side]
    parts: str
    extra: list[str]
    out: Path
    runs: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=lambda: {"A": [], "B": []})
    log: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: The table's rows, once every run is in (each one a bootstrap: made once).
    found: list[Row] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "sides": {s.label: {"rev": s.rev, "commit": s.commit, "tree": str(s.tree)} for s in self.sides},
            "parts": self.parts, "extra_args": self.extra, "runs": self.log,
            "rows": [{**dataclasses.asdict(r), "verdict": r.verdict} for r in self.found],
        }


def compare(sides: tuple[Side, Side], parts: str, extra: Sequence[str], rounds: int, out: Path,
            runner: Runner, log: Callable[[str], None]) -> Comparison:
    """Run both sides ``rounds`` times each in counterbalanced order; save every run's JSON and log
    and the table (compare.md, compare.json) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    by_label = {s.label: s for s in sides}
    cmp = Comparison(sides, parts, list(extra), out)
    order = schedule(rounds)
    for i, label in enumerate(order, 1):
        side = by_label[label]
        n = len(cmp.runs[label]) + 1
        log(f"[{i}/{len(order)}] {label} ({side.short}) run {n}: bench/run --only {parts} {' '.join(extra)}".rstrip())
        t0 = time.monotonic()
        load = os.getloadavg()[0]
        result = runner(side, n, out / f"{label.lower()}-{n}.log")
        (out / f"{label.lower()}-{n}.json").write_text(json.dumps(result, indent=2))
        cmp.runs[label].append(result)
        cmp.log.append({"side": label, "run": n, "seconds": round(time.monotonic() - t0, 1),
                        "load_before": round(load, 2)})
    cmp.found = rows(cmp.runs["A"], cmp.runs["B"])
    (out / "compare.md").write_text(table(sides, cmp.found) + "\n")
    (out / "compare.json").write_text(json.dumps(cmp.summary(), indent=2))
    return cmp


def from_directory(where: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The runs a comparison saved in ``where`` (a-N.json, b-N.json), in run order."""
    def load(prefix: str) -> list[dict[str, Any]]:
        files = sorted(where.glob(f"{prefix}-*.json"), key=lambda p: int(p.stem.split("-")[1]))
        return [json.loads(p.read_text()) for p in files]
    return load("a"), load("b")


def saved_sides(where: Path) -> tuple[Side, Side]:
    """The sides a comparison saved in ``where`` (compare.json); placeholders without it."""
    saved = where / "compare.json"
    if not saved.exists():
        return Side("A", "A", "?", where), Side("B", "B", "?", where)
    s = json.loads(saved.read_text())["sides"]
    a, b = (Side(label, s[label]["rev"], s[label]["commit"], Path(s[label]["tree"])) for label in ("A", "B"))
    return a, b


def default_out(a: Side, b: Side, parts: str, rounds: int) -> Path:
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M")
    tag = re.sub(r"[^A-Za-z0-9+_-]", "_", parts.replace(",", "+"))
    return REPO / "bench" / "results" / "compare" / f"{stamp}-{a.short}-vs-{b.short}-{tag}-x{rounds}"
