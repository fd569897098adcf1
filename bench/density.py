"""Density (issue 4): what an idle sandbox costs the host, and what the levers against it save.

Run through ``bench/run --only density``. Against a started ``space serve`` it creates N idle sandboxes
through the API and, as the baseline, N bare ``runsc`` containers running ``sleep infinity`` (the same
OCI spec and runsc flags as the node's, on a btrfs snapshot of the same template, in a runsc root and
cgroup of their own so the node never sees them). All of them are measured in the same windows:

- host CPU of each sandbox while running, while paused (``POST pause`` / ``runsc pause``) and while its
  cgroup is frozen (freezer), from ``/proc/<pid>/task/*/schedstat`` of every process in its cgroup
  plus, for SPACE sandboxes, the host-side shim;
- memory: PSS (``smaps_rollup``, counted once per address space: systrap's stub threads are
  separate processes sharing one ``mm``) and the memcg's usage;
- thaw → first exec done (the freezer's price) against a plain exec;
- what ``runsc restore`` of a checkpoint of an idle sandbox costs (wall time and host CPU), the only
  state that costs no CPU and no memory while it waits.

Everything it made is deleted on the way out, also on failure (frozen cgroups are thawed first:
runsc calls on a frozen sandbox hang).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import resource
import secrets
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.lifecycle import Bench, ms_since, summary, table_row
from tests.e2e.harness import Server

PARTS = ("density",)
CGROUP = Path("/sys/fs/cgroup")
#: Process kinds a sandbox's host CPU and memory are split into.
KINDS = ("sentry", "gofer", "stub", "shim")
_SYS_KCMP, _KCMP_VM = 312, 1  # x86_64
_libc = ctypes.CDLL(None, use_errno=True)


@dataclasses.dataclass(frozen=True)
class Plan:
    sandboxes: int = 10
    baselines: int = 10
    window_s: float = 10.0
    #: Wait after the last start (boot work, warm imports) and after a pause before measuring.
    settle_s: float = 5.0
    restores: int = 3


FULL = Plan()
QUICK = Plan(sandboxes=4, baselines=4, window_s=5.0, settle_s=3.0, restores=1)


# -- cgroups (v1 controllers, or the v2 unified tree) ------------------------------------------


def _cg(controller: str, path: str) -> Path:
    for d in (CGROUP / controller, CGROUP / f"{controller},cpuacct", CGROUP / f"cpu,{controller}"):
        if d.is_dir():
            return d / path.lstrip("/")
    return CGROUP / path.lstrip("/")  # v2


def _cg_pids(path: str) -> list[int]:
    try:
        return [int(x) for x in _cg("pids", path).joinpath("cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _memcg_bytes(path: str) -> int:
    d = _cg("memory", path)
    for name in ("memory.usage_in_bytes", "memory.current"):
        with contextlib.suppress(OSError, ValueError):
            return int((d / name).read_text())
    return 0


def _freeze(path: str, frozen: bool) -> None:
    d = _cg("freezer", path)
    if (d / "freezer.state").exists():
        (d / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        want = "FROZEN" if frozen else "THAWED"
        deadline = time.monotonic() + 10
        while (d / "freezer.state").read_text().strip() != want and time.monotonic() < deadline:
            time.sleep(0.005)
    else:
        (d / "cgroup.freeze").write_text("1" if frozen else "0")


# -- processes ---------------------------------------------------------------------------------


def _cmd0(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _kind(pid: int) -> str:
    c = _cmd0(pid)
    return "sentry" if c.startswith("runsc-sandbox") else "gofer" if c.startswith("runsc-gofer") else "stub"


def _cpu_ns(pid: int) -> int:
    """On-CPU time of every live thread of ``pid`` (schedstat: ns, finer than stat's ticks)."""
    total = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total


def _same_mm(a: int, b: int) -> bool:
    return int(_libc.syscall(_SYS_KCMP, a, b, _KCMP_VM, 0, 0)) == 0


def _rollup(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


@dataclasses.dataclass
class Box:
    """One measured sandbox: a SPACE sandbox or a bare baseline container."""

    name: str
    cgroup: str
    shim_pid: int | None = None
    sandbox_id: str | None = None  # SPACE sandboxes only

    def pids(self) -> dict[int, str]:
        out = {p: _kind(p) for p in _cg_pids(self.cgroup)}
        if self.shim_pid is not None and b"space.runtime.shim" in _safe_cmdline(self.shim_pid):
            out[self.shim_pid] = "shim"
        return out

    def memory(self) -> dict[str, Any]:
        """PSS by process kind, each address space counted once, and the memcg's usage."""
        seen: list[int] = []
        pss: Counter[str] = Counter()
        for pid, kind in self.pids().items():
            if any(_same_mm(pid, q) for q in seen):
                continue
            seen.append(pid)
            pss[kind] += _rollup(pid).get("Pss", 0)
        return {"pss_bytes": sum(pss.values()), "pss_by_kind": dict(pss), "memcg_bytes": _memcg_bytes(self.cgroup)}


def _safe_cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _cpu_window(boxes: list[Box], seconds: float, extra: dict[str, list[int]] | None = None
                ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Host CPU ms per second of each box (by process kind) and of each ``extra`` pid group, all
    over the same window. A thread that exits inside the window loses its share (idle: none do)."""
    pids = {b.name: b.pids() for b in boxes}
    groups = extra or {}
    before = {p: _cpu_ns(p) for ps in pids.values() for p in ps} | {p: _cpu_ns(p) for g in groups.values() for p in g}
    t0 = time.monotonic()
    time.sleep(seconds)
    after = {p: _cpu_ns(p) for p in before}
    dt = time.monotonic() - t0
    rate = {p: max(0, after[p] - before[p]) / 1e6 / dt for p in before}
    per_box: dict[str, dict[str, float]] = {}
    for b in boxes:
        by: dict[str, float] = {}
        for p, kind in pids[b.name].items():
            by[kind] = by.get(kind, 0.0) + rate[p]
        per_box[b.name] = {"total": sum(by.values()), **by}
    return per_box, {name: sum(rate[p] for p in g) for name, g in groups.items()}


def _tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


# -- the baseline: bare runsc containers -------------------------------------------------------


class Baselines:
    """Bare ``runsc`` containers running ``sleep infinity`` with the node's spec and flags, in a
    runsc root and cgroup parent of their own."""

    def __init__(self, b: Bench, spec: dict[str, Any], template: Path) -> None:
        self.b = b
        self.tag = secrets.token_hex(3)
        self.root = b.srv.data_dir / f"density-runsc-{self.tag}"
        self.flags = [f"--root={self.root}", *[f for f in b.runsc_flags if not f.startswith("--root=")]]
        self.spec = spec
        self.template = template
        self.names: list[str] = []
        self.pids: dict[str, list[int]] = {}

    def runsc(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["runsc", *self.flags, *args], check=check, capture_output=True, timeout=timeout)

    def cgroup(self, name: str) -> str:
        return f"/spacedensity/{name}"

    def start(self, n: int) -> list[Box]:
        boxes = []
        for i in range(n):
            name = f"zdens{self.tag}{i:03d}"
            rootfs, bundle = self.b.scratch / f"{name}-root", self.b.scratch / f"{name}-bundle"
            subprocess.run(["btrfs", "-q", "subvolume", "snapshot", str(self.template), str(rootfs)], check=True,
                           capture_output=True)
            subprocess.run(["btrfs", "property", "set", "-ts", str(rootfs), "ro", "false"], check=True,
                           capture_output=True)
            spec = json.loads(json.dumps(self.spec))
            spec["root"]["path"] = str(rootfs)
            spec["process"]["args"] = ["sleep", "infinity"]
            spec["linux"]["cgroupsPath"] = self.cgroup(name)
            bundle.mkdir()
            (bundle / "config.json").write_text(json.dumps(spec))
            self.names.append(name)
            # The detached sandbox inherits the CLI's stdio: no pipes, or waiting for their end never ends.
            with open(bundle / "runsc.log", "wb") as err:
                subprocess.run(["runsc", *self.flags, "run", "--detach", "--bundle", str(bundle), name],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, check=True,
                               timeout=60)
            self.pids[name] = _cg_pids(self.cgroup(name))
            boxes.append(Box(name=name, cgroup=self.cgroup(name)))
        return boxes

    def cleanup(self) -> None:
        for name in self.names:
            with contextlib.suppress(OSError):
                _freeze(self.cgroup(name), False)
            with contextlib.suppress(subprocess.SubprocessError):
                self.runsc("delete", "--force", name, check=False)
            # A delete that failed leaves the processes running: they are ours, end them by pid.
            for pid in self.pids.get(name, []):
                if _cmd0(pid).startswith(("runsc-sandbox", "runsc-gofer")):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
            self.b.drop_subvolume(self.b.scratch / f"{name}-root")
            shutil.rmtree(self.b.scratch / f"{name}-bundle", ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)
        for ctl in ("cpu", "cpuacct", "memory", "pids", "freezer", "blkio", "devices", "cpuset", "systemd"):
            with contextlib.suppress(OSError):
                _cg(ctl, "/spacedensity").rmdir()


# -- the benchmark -----------------------------------------------------------------------------


def _space_box(b: Bench, sid: str) -> Box:
    sb = b.get(f"/v1/sandboxes/{sid}")
    inst = str(sb["instance_id"])
    shim: int | None = None
    with contextlib.suppress(OSError, ValueError):
        shim = int((b.pool / "sandboxes" / sid / "instances" / inst / "shim.pid").read_text().strip())
    return Box(name=inst, cgroup=f"/space/{inst}", shim_pid=shim, sandbox_id=sid)


def _per_box(cpu: dict[str, dict[str, float]], boxes: list[Box]) -> dict[str, Any]:
    totals = [cpu[x.name]["total"] for x in boxes]
    by = {k: sum(cpu[x.name].get(k, 0.0) for x in boxes) / max(len(boxes), 1) for k in KINDS}
    return {"ms_per_s": summary(totals), "mean_by_kind": by}


def _mem_summary(mem: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = {k for m in mem for k in m["pss_by_kind"]}
    return {"pss_bytes": summary([m["pss_bytes"] for m in mem]),
            "memcg_bytes": summary([m["memcg_bytes"] for m in mem]),
            "pss_mean_by_kind": {k: sum(m["pss_by_kind"].get(k, 0) for m in mem) / len(mem) for k in sorted(kinds)}}


def _children_cpu_ms() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (r.ru_utime + r.ru_stime) * 1000


def _restore_cost(b: Bench, base: Baselines, sid: str, n: int) -> dict[str, Any]:
    """``runsc checkpoint --leave-running`` of an idle SPACE sandbox, then ``runsc restore`` of it
    under a new id (baseline root, own cgroup, a snapshot of its root), n times: wall time, the CLI's
    CPU and the restored sandbox's CPU until restore returned."""
    inst = b.instance(sid)
    spec = json.loads((b.srv.data_dir / "bundles" / inst / "config.json").read_text())  # the helper's
    img = b.scratch / f"density-img-{base.tag}"
    img.mkdir()
    wall: list[float] = []
    cli: list[float] = []
    sandbox_cpu: list[float] = []
    errors: list[str] = []
    try:
        b.runsc("checkpoint", "--leave-running", "--image-path", img, inst)
        image_bytes = sum(f.stat().st_size for f in img.iterdir())
        for i in range(n):
            name = f"zdensr{base.tag}{i:02d}"
            rootfs, bundle = b.scratch / f"{name}-root", b.scratch / f"{name}-bundle"
            fds: list[int] = []
            base.names.append(name)  # cleanup() deletes it, its root and its bundle
            subprocess.run(["btrfs", "-q", "subvolume", "snapshot", str(b.root(sid)), str(rootfs)], check=True,
                           capture_output=True)
            s = json.loads(json.dumps(spec))
            s["root"]["path"] = str(rootfs)
            s["linux"]["cgroupsPath"] = base.cgroup(name)
            bundle.mkdir()
            (bundle / "config.json").write_text(json.dumps(s))
            to_r, to_w = os.pipe()
            from_r, from_w = os.pipe()
            fds += [to_r, to_w, from_r, from_w]
            try:
                c0, t0 = _children_cpu_ms(), time.perf_counter()
                with open(bundle / "runsc.log", "wb") as err:
                    rc = subprocess.run(["runsc", *base.flags, "restore", "--detach", "--image-path", str(img),
                                         "--bundle", str(bundle), name], stdin=to_r, stdout=from_w,
                                        stderr=err, check=False, timeout=120).returncode
                ms = ms_since(t0)
                cli_ms = _children_cpu_ms() - c0
                base.pids[name] = _cg_pids(base.cgroup(name))
                if rc != 0:
                    errors.append((bundle / "runsc.log").read_text(errors="replace")[-300:])
                    continue
                usage = _cg("cpuacct", base.cgroup(name)) / "cpuacct.usage"
                cpu_ms = int(usage.read_text()) / 1e6 if usage.exists() else float("nan")
                wall.append(ms)
                cli.append(cli_ms)
                sandbox_cpu.append(cpu_ms)
            finally:
                for fd in fds:
                    os.close(fd)
                base.runsc("delete", "--force", name, check=False)
    finally:
        shutil.rmtree(img, ignore_errors=True)
    out: dict[str, Any] = {"image_bytes": image_bytes, "errors": errors}
    if wall:
        out |= {"wall_ms": summary(wall), "cli_cpu_ms": summary(cli), "sandbox_cpu_ms": summary(sandbox_cpu)}
    return out


def bench_density(b: Bench, plan: Plan, log: Callable[[str], None] = print) -> dict[str, Any]:
    res: dict[str, Any] = {"plan": dataclasses.asdict(plan)}
    def server_pids() -> list[int]:
        root = b.srv.proc.pid if b.srv.proc is not None else None
        return [p for p in (_tree(root) if root else []) if b"space.runtime.shim" not in _safe_cmdline(p)]

    if pids := server_pids():  # the control plane's own cost, before any sandbox exists
        res["server_empty_ms_per_s"] = _cpu_window([], plan.window_s, {"server": pids})[1]["server"]
    with b.sandboxes() as ids:
        log(f"density: creating {plan.sandboxes} sandboxes ...")
        for _ in range(plan.sandboxes):
            ids.append(b.sandbox())
        space = [_space_box(b, sid) for sid in ids]
        first = space[0]
        spec = json.loads((b.srv.data_dir / "bundles" / first.name / "config.json").read_text())  # the helper's
        digest = str(b.get(f"/v1/sandboxes/{ids[0]}")["template_digest"])[:16]
        template = next(p for p in (b.pool / "templates").iterdir() if p.name.endswith(f"@{digest}"))
        base = Baselines(b, spec, template)
        frozen: list[Box] = []
        try:
            log(f"density: starting {plan.baselines} bare runsc containers ...")
            bare = base.start(plan.baselines)
            everything = space + bare
            time.sleep(plan.settle_s)
            server = server_pids()

            log("density: running ...")
            cpu, other = _cpu_window(everything, plan.window_s, {"server": server})
            res["running"] = {"space": _per_box(cpu, space), "baseline": _per_box(cpu, bare)}
            res["server_ms_per_s"] = other["server"] if server else None
            res["memory"] = {"space": _mem_summary([x.memory() for x in space]),
                             "baseline": _mem_summary([x.memory() for x in bare])}

            plain = [(_exec_ms(b, sid), _exec_ms(b, sid))[1] for sid in ids]  # the first exec warms up

            log("density: frozen (cgroup freezer) ...")
            for x in everything:
                _freeze(x.cgroup, True)
                frozen.append(x)
            cpu, _ = _cpu_window(everything, plan.window_s)
            res["frozen"] = {"space": _per_box(cpu, space), "baseline": _per_box(cpu, bare)}
            thaw_exec: list[float] = []
            for x in everything:
                t0 = time.perf_counter()
                _freeze(x.cgroup, False)
                frozen.remove(x)
                if x.sandbox_id is not None:
                    _exec_ms(b, x.sandbox_id)
                    thaw_exec.append(ms_since(t0))
            res["thaw_exec_ms"] = summary(thaw_exec)
            res["plain_exec_ms"] = summary(plain)

            log("density: paused ...")
            for sid in ids:
                b.act(f"/v1/sandboxes/{sid}/pause")
            for x in bare:
                base.runsc("pause", x.name)
            time.sleep(min(plan.settle_s, 2.0))
            cpu, _ = _cpu_window(everything, plan.window_s)
            res["paused"] = {"space": _per_box(cpu, space), "baseline": _per_box(cpu, bare)}
            for sid in ids:
                b.act(f"/v1/sandboxes/{sid}/resume")
            for x in bare:
                base.runsc("resume", x.name)

            if plan.restores:
                log("density: checkpoint/restore cost ...")
                res["restore"] = _restore_cost(b, base, ids[0], plan.restores)
        finally:
            for x in frozen:
                with contextlib.suppress(OSError):
                    _freeze(x.cgroup, False)
            base.cleanup()
    _derive(res)
    return res


def _exec_ms(b: Bench, sid: str) -> float:
    t0 = time.perf_counter()
    b.sh(sid, "true")
    return ms_since(t0)


def _derive(res: dict[str, Any]) -> None:
    """Sandboxes one core / one GiB holds, from the means (a core is 1000 ms of CPU per second)."""
    d: dict[str, Any] = {}
    for who in ("space", "baseline"):
        run_ms = res["running"][who]["ms_per_s"]["mean"]
        pause_ms = res["paused"][who]["ms_per_s"]["mean"]
        pss = res["memory"][who]["pss_bytes"]["mean"]
        d[who] = {"per_core_running": 1000 / run_ms if run_ms > 0 else None,
                  "per_core_paused": 1000 / pause_ms if pause_ms > 0 else None,
                  "per_gib_pss": 2**30 / pss if pss > 0 else None}
    idle_ms = res["running"]["space"]["ms_per_s"]["mean"]
    if (r := res.get("restore")) and "sandbox_cpu_ms" in r and idle_ms > 0:
        d["restore_break_even_idle_s"] = (r["sandbox_cpu_ms"]["p50"] + r["cli_cpu_ms"]["p50"]) / idle_ms
    res["derived"] = d


# -- the table ---------------------------------------------------------------------------------


def _one(metric: str, value: float | None, base: float | None, base_label: str, fmt: str = "{:.1f}") -> str:
    v = "∞" if value is None else fmt.format(value)
    bv = "∞" if base is None else fmt.format(base)
    ratio = "" if value is None or base is None or base == 0 else f"{value / base:.3g}"
    return f"| {metric} | {v} | | | | {bv} {base_label} | {ratio} |"


def table_rows(res: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rows for bench/run's table (metric | p50 | p90 | p99 | n | baseline p50 | ratio) and notes."""
    rows: list[str] = []
    notes: list[str] = []
    bare = "(bare `runsc` sleep)"
    for state, label in (("running", "running"), ("paused", "paused (`POST pause` / `runsc pause`)"),
                         ("frozen", "cgroup-frozen")):
        s, bs = res[state]["space"]["ms_per_s"], res[state]["baseline"]["ms_per_s"]
        rows.append(table_row(f"host CPU of an idle sandbox, {label} (ms/s)", s, f"{bs['p50']:.1f} {bare}",
                         s["p50"] / bs["p50"] if bs["p50"] > 0 else "", fmt="{:.1f}"))
    mib = float(2**20)
    for key, label in (("pss_bytes", "PSS"), ("memcg_bytes", "memcg usage")):
        s = {k: v / mib if k != "n" else v for k, v in res["memory"]["space"][key].items()}
        bs = {k: v / mib if k != "n" else v for k, v in res["memory"]["baseline"][key].items()}
        rows.append(table_row(f"{label} of an idle sandbox (MiB)", s, f"{bs['p50']:.1f} {bare}", s["p50"] / bs["p50"]))
    d = res["derived"]
    rows.append(_one("idle running sandboxes one core holds (CPU)", d["space"]["per_core_running"],
                     d["baseline"]["per_core_running"], bare, "{:.0f}"))
    rows.append(_one("idle paused sandboxes one core holds (CPU)", d["space"]["per_core_paused"],
                     d["baseline"]["per_core_paused"], bare, "{:.0f}"))
    rows.append(_one("idle sandboxes per GiB (PSS)", d["space"]["per_gib_pss"], d["baseline"]["per_gib_pss"],
                     bare, "{:.0f}"))
    te, pe = res["thaw_exec_ms"], res["plain_exec_ms"]
    rows.append(table_row("thaw a frozen sandbox → first exec done (ms)", te, f"{pe['p50']:.1f} (exec, not frozen)",
                     te["p50"] / pe["p50"]))
    if (r := res.get("restore")) and "wall_ms" in r:
        rows.append(table_row("`runsc restore` of an idle sandbox's checkpoint, wall (ms)", r["wall_ms"], fmt="{:.0f}"))
        rows.append(table_row("host CPU that restore costs (ms, sandbox + CLI)",
                         {k: r["sandbox_cpu_ms"][k] + r["cli_cpu_ms"][k] if k != "n" else r["sandbox_cpu_ms"][k]
                          for k in r["sandbox_cpu_ms"]}, fmt="{:.0f}"))
        if "restore_break_even_idle_s" in d:
            notes.append(f"a checkpointed sandbox costs no CPU; restoring it costs what "
                         f"{d['restore_break_even_idle_s']:.1f} s of idle running costs "
                         f"(memory image {r['image_bytes'] / mib:.1f} MiB)")
    for state in ("running", "paused"):
        by = res[state]["space"]["mean_by_kind"]
        bb = res[state]["baseline"]["mean_by_kind"]
        notes.append(f"CPU {state}, mean ms/s by process: SPACE " + ", ".join(f"{k} {v:.1f}" for k, v in by.items())
                     + "; bare " + ", ".join(f"{k} {v:.1f}" for k, v in bb.items()))
    pm = res["memory"]["space"]["pss_mean_by_kind"]
    bm = res["memory"]["baseline"]["pss_mean_by_kind"]
    notes.append("PSS mean MiB by process: SPACE " + ", ".join(f"{k} {v / mib:.1f}" for k, v in pm.items())
                 + "; bare " + ", ".join(f"{k} {v / mib:.1f}" for k, v in bm.items())
                 + " (stub = the guest's processes' address spaces)")
    if res.get("server_ms_per_s") is not None:
        n = res["plan"]["sandboxes"]
        empty = res.get("server_empty_ms_per_s")
        notes.append(f"control plane + node agent (no shims): {res['server_ms_per_s']:.1f} ms/s with {n} idle sandboxes"
                     + (f", {empty:.1f} ms/s with none ({(res['server_ms_per_s'] - empty) / n:.2f} ms/s per sandbox)"
                        if empty is not None else ""))
    return rows, notes


def run_all(srv: Server, plan: Plan, log: Callable[[str], None] = print) -> dict[str, Any]:
    b = Bench(srv)
    try:
        t0 = time.perf_counter()
        out = bench_density(b, plan, log)
        out["took_s"] = round(time.perf_counter() - t0, 1)
        return out
    finally:
        b.close()
