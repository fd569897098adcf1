#!/usr/bin/env python3
"""Chaos: sandboxes at work while nodes, controllers and API replicas die, freeze and drain; at the
end every sandbox exists exactly once and no acknowledged write is missing that its backup covered
(issue 15).

A cluster on this machine (tests/e2e/cluster.py): 2 API replicas, 2 controllers on PostgreSQL, 3
node agents over mutual TLS with a short fencing lease, moto's S3. ``--sandboxes`` sandboxes, each
backed up every 2 s, each with a worker writing numbered files through the API (a write counts
once the API acknowledged it) and running a command now and then. Meanwhile, one at a time at
random moments, a fault from:

- ``node_kill``: SIGKILL of a node's whole process tree (agent, helper, gateway, every sandbox's
  runtime), the agent restarted once its sandboxes run elsewhere;
- ``node_stop``: SIGSTOP of a node's whole tree for longer than its lease, then SIGCONT;
- ``controller_kill`` / ``api_kill``: SIGKILL of one replica, restarted two seconds later;
- ``drain``: a node drained (its sandboxes moved with their processes), then uncordoned.

Checked at the end, when every sandbox is running again: each is on exactly one node (the nodes'
own lists) and it is the one its row names; every write acknowledged before the moment it was last
restored as of (``relocated`` events: the disk backup's or the checkpoint's time) or after it, and
every write of a sandbox that was only ever moved, is in its files. The report gives operations done,
faults injected, moves and relocations, the RPO seen on the rows (max, p99) and what was lost.

    sudo .venv/bin/python bench/chaos.py [--minutes 30] [--sandboxes 20] [--seed N]

Saves bench/results/<date>-chaos.json and .md; exits 1 if anything was lost.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.lifecycle import pct  # noqa: E402
from space.node.main import channel_dir_for  # noqa: E402
from tests.e2e.cluster import Cluster, ClusterNode, cluster  # noqa: E402
from tests.e2e.harness import create_sandbox, run  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

LEASE = 15
BACKUP_EVERY = 2
FAULTS = ("node_kill", "node_stop", "controller_kill", "api_kill", "drain")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def node_pids(node: ClusterNode) -> list[int]:
    """Every process of a node: its agent, helper and gateway, its sandboxes' runtime."""
    marks = (str(node.data_dir).encode(), str(channel_dir_for(node.data_dir)).encode())
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if any(m in (entry / "cmdline").read_bytes() for m in marks):
                    pids.append(int(entry.name))
    return pids


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Chaos:
    def __init__(self, cl: Cluster, *, sandboxes: int, seed: int) -> None:
        self.cl = cl
        self.n = sandboxes
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sids: list[str] = []
        #: sandbox → [(seq, acknowledged at)]
        self.acked: dict[str, list[tuple[int, float]]] = {}
        self.ops = Counter[str]()
        self.faults: list[dict[str, Any]] = []
        self.rpo: list[float] = []
        self.refusals: dict[str, str] = {}

    def api(self, timeout: float = 30) -> httpx.Client:
        return self.cl.client(self.rng.randrange(len(self.cl.apis)), timeout=timeout)

    # -- work --------------------------------------------------------------------------------------

    def setup(self) -> None:
        with self.cl.client(0, timeout=600) as api:
            wait_for(lambda: api.get("/v1/templates/base").json().get("status") == "ready", 1800,
                     "the base template", interval=1)
            for _ in range(self.n):
                sid = create_sandbox(api, memory_mb=256,
                                     snapshot_policy={"backup_every": BACKUP_EVERY, "disk_every": None})
                self.sids.append(sid)
                self.acked[sid] = []
                run(api, sid, {"shell": "mkdir -p /home/user/w"})
            # Faults start once every sandbox has something durable: a node lost before its
            # sandbox's first backup link loses that sandbox, rightly (there is nothing to restore).
            wait_for(lambda: all((api.get(f"/v1/sandboxes/{sid}").json().get("backup") or {}).get("disk_at")
                                 for sid in self.sids), 300, "every sandbox's first backup", interval=1)
        log(f"{self.n} sandboxes made and backed up")

    def worker(self, sid: str) -> None:
        seq = 0
        while not self.stop.is_set():
            seq += 1
            try:
                with self.api() as api:
                    r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": f"/home/user/w/{seq}"},
                                content=f"{sid}:{seq}\n".encode())
                    if r.status_code in (200, 201, 204):
                        with self.lock:
                            self.acked[sid].append((seq, time.time()))
                        self.ops["write"] += 1
                    else:
                        self.ops[f"write_{r.status_code}"] += 1
                        with self.lock:  # what a refusal said, once per kind (the report shows it)
                            self.refusals.setdefault(str(r.status_code), r.text[:300])
                    if seq % 5 == 0:
                        code, _, _ = run(api, sid, {"shell": "ls /home/user/w | wc -l"})
                        self.ops["exec" if code == 0 else "exec_failed"] += 1
            except (httpx.HTTPError, AssertionError, KeyError, ValueError):
                self.ops["call_failed"] += 1
                self.stop.wait(0.5)
            self.stop.wait(0.2)

    def sampler(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError), self.api() as api:
                for sb in api.get("/v1/sandboxes").json()["sandboxes"]:
                    b = sb.get("backup") or {}
                    if sb["id"] in self.acked and sb["state"] == "running" and b.get("rpo_s") is not None:
                        self.rpo.append(float(b["rpo_s"]))
            self.stop.wait(5)

    # -- faults ------------------------------------------------------------------------------------

    def live_nodes(self) -> list[ClusterNode]:
        with self.cl.client(0) as api:
            rows = {r["id"]: r for r in api.get("/v1/nodes").json()["nodes"]}
        return [n for n in self.cl.nodes if rows.get(n.node_id, {}).get("state") == "ready"
                and not rows[n.node_id].get("cordoned")]

    def settle(self, timeout: float = 300) -> None:
        """Every chaos sandbox running on a ready node."""
        last: dict[str, Any] = {}

        def settled() -> bool:
            with self.cl.client(0) as api:
                rows = {r["id"]: r for r in api.get("/v1/nodes").json()["nodes"]}
                sbs = {s["id"]: s for s in api.get("/v1/sandboxes").json()["sandboxes"]}
            last.update(nodes={k: v["state"] for k, v in rows.items()},
                        sandboxes={sid: (sbs.get(sid, {}).get("state"), sbs.get(sid, {}).get("node_id"))
                                   for sid in self.sids})
            # A failed sandbox is settled too (the verdict counts it as lost): waiting would not help.
            return all(sbs.get(sid, {}).get("state") == "failed" or (
                sbs.get(sid, {}).get("state") == "running"
                and rows.get(sbs[sid]["node_id"], {}).get("state") == "ready") for sid in self.sids)
        try:
            wait_for(settled, timeout, "every sandbox to run on a ready node", interval=1)
        except AssertionError:
            log(f"not settled: {last}")
            with self.cl.client(0) as api:
                for sid, (state, _) in last.get("sandboxes", {}).items():
                    if state != "running":
                        events = api.get(f"/v1/sandboxes/{sid}/events").json()["events"][-4:]
                        log(f"{sid} {state}: {[(e['kind'], e['message'][:160]) for e in events]}")
            raise

    def wait_state(self, node: ClusterNode, state: str, timeout: float = 120) -> None:
        def there() -> bool:
            with self.cl.client(0) as api:
                rows = {r["id"]: r for r in api.get("/v1/nodes").json()["nodes"]}
            return bool(rows.get(node.node_id, {}).get("state") == state)
        wait_for(there, timeout, f"{node.node_id} to be {state}", interval=1)

    def inject(self, kind: str) -> dict[str, Any]:
        t0 = time.monotonic()
        info: dict[str, Any] = {"kind": kind, "at": dt.datetime.now(dt.UTC).isoformat()}
        if kind in ("node_kill", "node_stop", "drain"):
            nodes = self.live_nodes()
            if len(nodes) < 2:
                return {**info, "skipped": "fewer than two ready nodes"}
            node = self.rng.choice(nodes)
            info["target"] = node.node_id
            if kind == "node_kill":
                signal_all(node_pids(node), signal.SIGKILL)
                assert node.proc.proc is not None
                node.proc.proc.wait(timeout=30)
                self.wait_state(node, "lost")
                self.settle()
                info["relocated_in_s"] = round(time.monotonic() - t0, 1)
                node.proc.start()  # the same machine back: its old copies are stale, its pool is reused
                self.cl.wait_nodes_ready(timeout=300)
            elif kind == "node_stop":
                pids = node_pids(node)
                signal_all(pids, signal.SIGSTOP)
                try:
                    self.wait_state(node, "lost")
                    self.settle()
                    info["relocated_in_s"] = round(time.monotonic() - t0, 1)
                finally:
                    signal_all(pids, signal.SIGCONT)
                self.cl.wait_nodes_ready(timeout=300)
            else:
                with self.cl.client(0, timeout=600) as api:
                    r = api.post(f"/v1/nodes/{node.node_id}/drain", json={"parallel": 2})
                    r.raise_for_status()
                    op_id = r.json()["operation"]["id"]
                    wait_for(lambda: api.get(f"/v1/operations/{op_id}").json()["status"]
                             in ("succeeded", "failed"), 600, "the drain", interval=1)
                    info["drain"] = api.get(f"/v1/operations/{op_id}").json()["status"]
                    api.post(f"/v1/nodes/{node.node_id}/uncordon").raise_for_status()
        elif kind == "controller_kill":
            i = self.rng.randrange(len(self.cl.controllers))
            info["target"] = f"controller-{i}"
            self.cl.controllers[i].kill()
            self.stop.wait(2)
            self.cl.controllers[i].start()
        elif kind == "api_kill":
            i = self.rng.randrange(len(self.cl.apis))
            info["target"] = f"api-{i}"
            self.cl.apis[i].kill()
            self.stop.wait(2)
            self.cl.start_api(replace=i)
        info["seconds"] = round(time.monotonic() - t0, 1)
        return info

    def faulter(self, until: float) -> None:
        while time.monotonic() < until and not self.stop.is_set():
            self.stop.wait(self.rng.uniform(5, 15))
            if time.monotonic() >= until:
                break
            kind = self.rng.choice(FAULTS)
            log(f"fault: {kind}")
            try:
                self.faults.append(self.inject(kind))
            except Exception as exc:  # the report says; the run goes on
                self.faults.append({"kind": kind, "error": repr(exc)[:300]})
                log(f"fault {kind} failed: {exc!r}"[:300])
            log(f"fault done: {self.faults[-1]}")

    # -- the run and its verdict -------------------------------------------------------------------

    def run(self, minutes: float) -> dict[str, Any]:
        self.setup()
        workers = [threading.Thread(target=self.worker, args=(sid,), daemon=True) for sid in self.sids]
        extra = [threading.Thread(target=self.sampler, daemon=True)]
        for t in workers + extra:
            t.start()
        started = time.monotonic()
        try:
            self.faulter(started + minutes * 60)
        finally:
            self.stop.set()
            for t in workers + extra:
                t.join(timeout=60)
        log("faults over; settling")
        self.settle(600)
        self.cl.wait_nodes_ready(timeout=300)
        return self.verdict(time.monotonic() - started)

    def copies(self) -> tuple[Counter[str], dict[str, str]]:
        """How many nodes hold a live (running or paused) copy of each chaos sandbox, and where."""
        copies: Counter[str] = Counter()
        where: dict[str, str] = {}
        for node in self.cl.nodes:
            with self.cl.node_client(node) as c:
                for item in c.get("/v1/sandboxes").json()["sandboxes"]:
                    if item["id"] in self.acked and item.get("status") in ("running", "paused"):
                        copies[item["id"]] += 1
                        where[item["id"]] = node.node_id
        return copies, where

    def verdict(self, seconds: float) -> dict[str, Any]:
        # A node back from a freeze discards its stale copies at its next heartbeat answer: give that
        # a deadline, then judge what is there (a copy still doubled after it is reported, not hidden).
        with contextlib.suppress(AssertionError):
            wait_for(lambda: all(n == 1 for n in self.copies()[0].values()), 120,
                     "stale copies to be discarded", interval=1)
        copies, where = self.copies()
        missing: dict[str, list[int]] = {}
        moved = relocated = 0
        back_after: list[float] = []  # a lost node's last heartbeat → its sandbox running elsewhere
        failed: dict[str, str] = {}
        with self.cl.client(0, timeout=120) as api:
            for sid in self.sids:
                sb = api.get(f"/v1/sandboxes/{sid}").json()
                if sb["state"] != "running":
                    failed[sid] = str((sb.get("error") or {}).get("message") or sb["state"])
                    continue
                assert where.get(sid) == sb["node_id"], (sid, where.get(sid), sb["node_id"])
                events = api.get(f"/v1/sandboxes/{sid}/events").json()["events"]
                moved += sum(e["kind"] == "moved" for e in events)
                relocations = [(dt.datetime.fromisoformat(e["data"]["lost_at"]).timestamp(),
                                dt.datetime.fromisoformat(e["data"]["restored_as_of"]).timestamp())
                               for e in events if e["kind"] == "relocated" and e["data"].get("restored_as_of")]
                back_after.extend(dt.datetime.fromisoformat(e["at"]).timestamp()
                                  - dt.datetime.fromisoformat(e["data"]["lost_at"]).timestamp()
                                  for e in events if e["kind"] == "relocated" and e["data"].get("lost_at"))
                relocated += len(relocations)
                code, out, err = run(api, sid, {"shell": "ls /home/user/w"})
                assert code == 0, err
                present = {int(x) for x in out.split() if x.isdigit()}
                for seq, at in self.acked[sid]:
                    # Required unless a relocation after it came back as of a moment before it.
                    lost_window = any(at < lost_at + 60 and at >= as_of - 0.5 for lost_at, as_of in relocations)
                    if seq not in present and not lost_window:
                        missing.setdefault(sid, []).append(seq)
        twice = sorted(s for s in self.sids if copies[s] != 1 and s not in failed)
        return {
            "seconds": round(seconds), "sandboxes": len(self.sids), "ops": dict(self.ops),
            "refusals": self.refusals,
            "writes_acknowledged": sum(len(v) for v in self.acked.values()),
            "faults": self.faults,
            "faults_by_kind": dict(Counter(f["kind"] for f in self.faults if "skipped" not in f)),
            "moves": moved, "relocations": relocated,
            "relocated_after_s": {"p50": pct(back_after, 0.5) if back_after else None,
                                  "max": max(back_after, default=None)},
            "rpo_s": {"max": max(self.rpo, default=0.0), "p99": pct(self.rpo, 0.99) if self.rpo else 0.0,
                      "n": len(self.rpo)},
            "not_exactly_once": twice, "missing_writes": missing, "failed": failed,
            "lost": len(twice) + len(failed) + sum(len(v) for v in missing.values()),
        }


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def render(r: dict[str, Any]) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in sorted(r["faults_by_kind"].items())) or "none"
    return "\n".join([
        f"Chaos run, {r['date']}: {r['seconds'] / 60:.1f} min, {r['sandboxes']} sandboxes, 3 nodes, 2 API replicas, "
        "2 controllers (`bench/chaos.py`)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| writes acknowledged | {r['writes_acknowledged']} |",
        f"| operations (writes, execs, refused or failed calls) | {json.dumps(r['ops'], sort_keys=True)} |",
        f"| faults injected | {faults} |",
        f"| sandboxes moved (drains) / restored elsewhere (node loss) | {r['moves']} / {r['relocations']} |",
        f"| a lost node's last heartbeat → its sandbox running elsewhere, p50 / max (s), "
        f"lease {r.get('lease', LEASE):g} s | "
        f"{_num(r['relocated_after_s']['p50'])} / {_num(r['relocated_after_s']['max'])} |",
        f"| RPO seen on the rows, max / p99 (s) | {r['rpo_s']['max']:.1f} / {r['rpo_s']['p99']:.1f} |",
        f"| sandboxes not exactly once / failed | {len(r['not_exactly_once'])} / {len(r.get('failed') or {})} |",
        f"| acknowledged writes missing that a backup covered | {sum(len(v) for v in r['missing_writes'].values())} |",
        f"| **lost** | **{r['lost']}** |",
    ]) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--sandboxes", type=int, default=20)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--lease", type=float, default=LEASE, help="the nodes' fencing lease, seconds")
    ap.add_argument("--out", default=None, help="report path without suffix (default bench/results/<date>-chaos)")
    args = ap.parse_args()
    import anyio

    from tests.conftest import _ensure_local_postgres
    from tests.store.conftest import reset_postgres

    url = _ensure_local_postgres()
    anyio.run(reset_postgres, url)
    date = dt.date.today().isoformat()
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"{date}-chaos"
    with tempfile.TemporaryDirectory(prefix="space-bench-chaos-") as tmp, \
            cluster(Path(tmp), url, apis=2, controllers=2, nodes=3,
                    node_env={"SPACE_FENCE_AFTER": f"{args.lease:g}"}) as cl:
        res = Chaos(cl, sandboxes=args.sandboxes, seed=args.seed).run(args.minutes)
        # Saved before the cluster is torn down: half an hour of evidence must not hang on a teardown.
        res.update(date=date, args=vars(args), lease=args.lease)
        table = render(res)
        print(table)
        out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
        out.with_suffix(".md").write_text(table)
        log(f"saved {out}.json and .md")
    return 1 if res["lost"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
