"""SPACE's lifecycle benchmarks (issue 3): pause/resume, disk snapshots, full checkpoint and rollback,
fork, suspend/restore. Each figure stands beside the naive way it replaces, measured in the same run
on the same sandbox ("Speed is measured, not asserted").

Run through ``bench/run --only lifecycle``. Every benchmark takes a :class:`Bench` around a started
``space serve`` (tests.e2e.harness.Server), deletes what it made (sandboxes through the API, scratch
subvolumes and baseline containers by hand) and returns a JSON-able dict; :func:`table_rows` renders
the results as rows of bench/run's markdown table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.e2e.harness import Server, run, wait_for, wait_operation

#: No scheduled snapshot may land in the middle of a measurement.
POLICY_OFF = {"disk_every": 0, "full_every": 0}
MIB = 1 << 20
#: Allocates N bytes of random memory (random: compression cannot hide it), then holds it.
HOLD_MEMORY = ("import os, sys, time\n"
               "held = os.urandom(int(sys.argv[1]))\n"
               "open('/tmp/held', 'w').write(str(len(held)))\n"
               "time.sleep(10**9)\n")


# -- statistics ------------------------------------------------------------------------------


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50": pct(xs, 0.5), "p90": pct(xs, 0.9), "p99": pct(xs, 0.99),
            "mean": statistics.fmean(xs)}


def given(args: Any) -> dict[str, Any]:
    """A script's arguments as its results record them (where they were saved is not one)."""
    return {k: v for k, v in vars(args).items() if k != "out"}


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


# -- what to run -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    pause_n: int = 20
    disk_sizes_mb: tuple[int, ...] = (1024, 5120)
    disk_n: int = 10
    mem_sizes_mb: tuple[int, ...] = (50, 500)
    full_n: int = 5
    #: (forks per request, repetitions)
    fork_counts: tuple[tuple[int, int], ...] = ((1, 5), (5, 3))
    suspend_n: int = 5
    change_mb: int = 10
    #: Repetitions of the naive tar|zstd upload.
    naive_n: int = 3


FULL = Plan()
QUICK = Plan(pause_n=5, disk_sizes_mb=(256, 1024), disk_n=3, full_n=2, fork_counts=((1, 2), (5, 1)),
             suspend_n=2, naive_n=1)


class BenchError(RuntimeError):
    """An endpoint misbehaved: carries the request, the answer and the server log's tail."""


# -- the server, its pool and its runtime ----------------------------------------------------


class Bench:
    def __init__(self, srv: Server) -> None:
        self.srv = srv
        self.c = srv.client(timeout=600)
        self.pool = srv.data_dir / "pool"
        self.scratch = self.pool / "tmp"
        self.scratch.mkdir(parents=True, exist_ok=True)
        # Exactly the node's global flags: a runsc call with other flags misreads the container.
        self.runsc_flags = [f"--root={srv.data_dir / 'runsc'}", "--platform=systrap", "--overlay2=none",
                            "--network=none"]

    def close(self) -> None:
        self.c.close()

    # -- API ---------------------------------------------------------------------------------

    def fail(self, what: str, detail: Any) -> BenchError:
        return BenchError(f"{what}: {json.dumps(detail, default=str)[:2000]}\n--- server log tail ---\n"
                          f"{self.srv.log_tail(6000)}")

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.c.post(path, json=body)
        if r.status_code not in (201, 202):
            raise self.fail(f"POST {path} {body} answered {r.status_code}", r.text)
        out: dict[str, Any] = r.json()
        return out

    def get(self, path: str) -> dict[str, Any]:
        r = self.c.get(path)
        if r.status_code != 200:
            raise self.fail(f"GET {path} answered {r.status_code}", r.text)
        out: dict[str, Any] = r.json()
        return out

    def wait(self, op_id: str, what: str, timeout: float = 900) -> dict[str, Any]:
        op = wait_operation(self.c, op_id, timeout=timeout)
        if op["status"] != "succeeded":
            raise self.fail(f"{what}: operation {op_id} {op['status']}", op)
        return op

    def act(self, path: str, body: dict[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
        """POST a lifecycle action and follow its operation: (end-to-end ms, operation)."""
        t0 = time.perf_counter()
        r = self.post(path, body)
        op = self.wait(r["operation"]["id"], f"POST {path} {body or ''}")
        return ms_since(t0), op

    def sandbox(self, **body: Any) -> str:
        r = self.post("/v1/sandboxes", {"template": "base", "snapshot_policy": POLICY_OFF, **body})
        self.wait(r["operation"]["id"], "create")
        return str(r["sandbox"]["id"])

    def delete(self, ids: list[str]) -> None:
        """Delete sandboxes (all at once) and wait until they are gone, so their pool space is free."""
        ops = []
        for sid in ids:
            r = self.c.delete(f"/v1/sandboxes/{sid}")
            if r.status_code == 202:
                ops.append(r.json()["operation"]["id"])
        for op in ops:
            wait_operation(self.c, op, timeout=300)

    @contextlib.contextmanager
    def sandboxes(self) -> Iterator[list[str]]:
        """A list to put sandbox ids in; every one is deleted on the way out, also on failure."""
        ids: list[str] = []
        try:
            yield ids
        finally:
            self.delete(ids)

    def sh(self, sid: str, script: str) -> str:
        code, out, err = run(self.c, sid, {"shell": script, "user": "root"})
        if code != 0:
            raise self.fail(f"`{script}` in {sid} exited {code}", err.decode(errors="replace"))
        return out.decode()

    def instance(self, sid: str) -> str:
        return str(self.get(f"/v1/sandboxes/{sid}")["instance_id"])

    def root(self, sid: str) -> Path:
        return self.pool / "sandboxes" / sid / "rootfs"

    # -- host side ---------------------------------------------------------------------------

    def runsc(self, *args: str | Path, **kw: Any) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["runsc", *self.runsc_flags, *map(str, args)], check=True, capture_output=True,
                              **kw)

    def fs_sync(self) -> None:
        """Commit the pool's transaction, so that extent sharing is what ``du`` reads."""
        subprocess.run(["btrfs", "filesystem", "sync", str(self.pool)], check=True, capture_output=True)

    def du(self, path: Path) -> dict[str, int]:
        """``btrfs filesystem du -s --raw``: total, exclusive and shared bytes of ``path``."""
        out = subprocess.run(["btrfs", "filesystem", "du", "-s", "--raw", str(path)], check=True,
                             capture_output=True, text=True).stdout.splitlines()
        total, exclusive, shared = (int(x) for x in out[1].split()[:3])
        return {"total": total, "exclusive": exclusive, "shared": shared}

    def drop_subvolume(self, path: Path) -> None:
        if path.exists():
            subprocess.run(["btrfs", "-q", "subvolume", "delete", str(path)], check=True, capture_output=True)


# -- 1. pause / resume -------------------------------------------------------------------------


def bench_pause_resume(b: Bench, n: int) -> dict[str, Any]:
    """API pause and resume (POST → operation succeeded) against ``runsc pause``/``resume`` on the
    same container, interleaved so that both see the same machine noise."""
    pause, resume, raw_pause, raw_resume = [], [], [], []
    with b.sandboxes() as ids:
        sid = b.sandbox()
        ids.append(sid)
        inst = b.instance(sid)
        for i in range(n + 1):
            ms_p, _ = b.act(f"/v1/sandboxes/{sid}/pause")
            ms_r, _ = b.act(f"/v1/sandboxes/{sid}/resume")
            t0 = time.perf_counter()
            b.runsc("pause", inst)
            ms_rp = ms_since(t0)
            t0 = time.perf_counter()
            b.runsc("resume", inst)
            ms_rr = ms_since(t0)
            if i == 0:
                continue  # warm-up
            pause.append(ms_p)
            resume.append(ms_r)
            raw_pause.append(ms_rp)
            raw_resume.append(ms_rr)
        b.sh(sid, "true")  # it still runs
    return {"pause_ms": summary(pause), "resume_ms": summary(resume),
            "runsc_pause_ms": summary(raw_pause), "runsc_resume_ms": summary(raw_resume),
            "ratio_pause_p50": pct(pause, .5) / pct(raw_pause, .5),
            "ratio_resume_p50": pct(resume, .5) / pct(raw_resume, .5)}


# -- 2. disk snapshots -------------------------------------------------------------------------


def _copy_root(b: Bench, root: Path, reflink: str) -> dict[str, float]:
    """The naive snapshot: ``cp -a`` of the whole root into a fresh subvolume of the pool, then
    ``sync -f`` (a btrfs snapshot is durable at its commit; a copy only once written back)."""
    dst = b.scratch / f"bench-copy-{reflink}"
    b.drop_subvolume(dst)
    subprocess.run(["btrfs", "-q", "subvolume", "create", str(dst)], check=True, capture_output=True)
    try:
        t0 = time.perf_counter()
        subprocess.run(["cp", "-a", f"--reflink={reflink}", f"{root}/.", f"{dst}/"], check=True,
                       capture_output=True)
        cp_ms = ms_since(t0)
        subprocess.run(["sync", "-f", str(dst)], check=True)
        total_ms = ms_since(t0)
        b.fs_sync()
        used = b.du(dst)
    finally:
        b.drop_subvolume(dst)
    return {"cp_ms": cp_ms, "cp_sync_ms": total_ms, "exclusive_bytes": used["exclusive"]}


def bench_disk_snapshots(b: Bench, sizes_mb: tuple[int, ...], n: int) -> dict[str, Any]:
    """Disk snapshot latency of one sandbox grown to each size in turn (random data written from
    inside in 256 MiB files: real extents), and the space one snapshot costs after a 1 MiB change."""
    out: dict[str, Any] = {}
    with b.sandboxes() as ids:
        sid = b.sandbox(memory_mb=1024)
        ids.append(sid)
        root = b.root(sid)
        b.sh(sid, "mkdir -p /home/user/fill && dd if=/dev/urandom of=/home/user/small bs=1M count=1 status=none")
        written = 0
        for size in sizes_mb:
            t0 = time.perf_counter()
            while written < size:
                step = min(256, size - written)
                b.sh(sid, f"dd if=/dev/urandom of=/home/user/fill/f{written} bs=1M count={step} status=none")
                written += step
            b.sh(sid, "sync")
            fill_s = time.perf_counter() - t0
            b.fs_sync()
            held = b.du(root)
            lat: list[float] = []
            added: list[float] = []
            node_ms: list[float] = []
            snaps: list[str] = []
            for _ in range(n):
                ms, op = b.act(f"/v1/sandboxes/{sid}/snapshots", {"kind": "disk"})
                snap = str(op["result"]["snapshot"])
                snaps.append(snap)
                lat.append(ms)
                node_ms.append(float(b.get(f"/v1/snapshots/{snap}")["details"]["took_ms"]))
                # A 1 MiB change: the small file rewritten whole, so its old extent is the snapshot's alone.
                b.sh(sid, "dd if=/dev/urandom of=/home/user/small bs=1M count=1 status=none && sync")
                b.fs_sync()
                added.append(float(b.du(b.pool / "sandboxes" / sid / "snapshots" / snap / "rootfs")["exclusive"]))
            never = _copy_root(b, root, "never")
            always = _copy_root(b, root, "always")
            out[str(size)] = {
                "root_bytes": held, "fill_s": fill_s, "snapshot_ms": summary(lat), "node_took_ms": summary(node_ms),
                "snapshot_exclusive_after_1mib_change": summary(added),
                "cp_reflink_never": never, "cp_reflink_always": always,
                "ratio_vs_copy_p50": pct(lat, .5) / never["cp_sync_ms"],
                "ratio_vs_reflink_p50": pct(lat, .5) / always["cp_sync_ms"],
            }
            # The next size starts without this size's snapshots.
            for snap in snaps:
                d = b.c.delete(f"/v1/sandboxes/{sid}/snapshots/{snap}")
                if d.status_code == 202:
                    b.wait(d.json()["operation"]["id"], f"delete snapshot {snap}")
    return out


# -- 3. full checkpoint and rollback -----------------------------------------------------------


def _raw_checkpoint_restore(b: Bench, sid: str) -> dict[str, Any]:
    """The bare runtime doing the same: ``runsc checkpoint --leave-running`` of the sandbox's
    container, then ``runsc restore`` of that image under a new id onto a btrfs snapshot of its root
    (the same bundle, root path and cgroup changed); the restored container is removed after."""
    inst = b.instance(sid)
    tag = secrets.token_hex(4)
    img, bundle = b.scratch / f"bench-img-{tag}", b.scratch / f"bench-bundle-{tag}"
    root_copy = b.scratch / f"bench-root-{tag}"
    new_id = f"zbench{secrets.token_hex(10)}"  # 26 characters, like the node's: no prefix clash
    fds: list[int] = []
    restored = False
    try:
        img.mkdir()
        t0 = time.perf_counter()
        b.runsc("checkpoint", "--leave-running", "--image-path", img, inst)
        ckpt_ms = ms_since(t0)
        subprocess.run(["btrfs", "-q", "subvolume", "snapshot", str(b.root(sid)), str(root_copy)], check=True,
                       capture_output=True)
        spec = json.loads((b.srv.data_dir / "bundles" / inst / "config.json").read_text())  # the helper's
        spec["root"]["path"] = str(root_copy)
        spec["linux"]["cgroupsPath"] = f"/space/{new_id}"
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(spec))
        # The guest talks over its stdio: give it pipes we hold, as the node's shim does.
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        fds += [to_r, to_w, from_r, from_w]
        t0 = time.perf_counter()
        with open(bundle / "runsc.log", "wb") as err:
            rc = subprocess.run(["runsc", *b.runsc_flags, "restore", "--detach", "--image-path", str(img),
                                 "--bundle", str(bundle), "--pid-file", str(bundle / "pid"), new_id],
                                stdin=to_r, stdout=from_w, stderr=err, check=False).returncode
        restore_ms = ms_since(t0)
        restored = True
        if rc != 0:
            return {"error": f"runsc restore exited {rc}: {(bundle / 'runsc.log').read_text()[-500:]}",
                    "checkpoint_ms": ckpt_ms}
        return {"checkpoint_ms": ckpt_ms, "restore_ms": restore_ms,
                "image_bytes": sum(f.stat().st_size for f in img.iterdir())}
    finally:
        if restored:
            subprocess.run(["runsc", *b.runsc_flags, "delete", "--force", new_id], capture_output=True, check=False)
        for fd in fds:
            os.close(fd)
        b.drop_subvolume(root_copy)
        shutil.rmtree(img, ignore_errors=True)
        shutil.rmtree(bundle, ignore_errors=True)


def bench_full_checkpoint(b: Bench, mem_sizes_mb: tuple[int, ...], n: int) -> dict[str, Any]:
    """A full snapshot (memory + files) and a rollback to it, of a sandbox whose process holds
    ``mem`` MB of touched random memory; against bare runsc checkpoint/restore of the same container."""
    out: dict[str, Any] = {}
    for mem in mem_sizes_mb:
        with b.sandboxes() as ids:
            sid = b.sandbox(memory_mb=1024)
            ids.append(sid)
            cmd = b.post(f"/v1/sandboxes/{sid}/commands",
                         {"cmd": ["python3", "-c", HOLD_MEMORY, str(mem * 10**6)], "user": "root"})
            wait_for(lambda: b.sh(sid, "cat /tmp/held 2>/dev/null || true").strip() == str(mem * 10**6),  # noqa: B023
                     300, f"the sandbox to hold {mem} MB")
            snap_ms: list[float] = []
            rb_ms: list[float] = []
            freeze: list[float] = []
            took: list[float] = []
            image: list[float] = []
            rb_timings: list[dict[str, float]] = []
            raw: list[dict[str, Any]] = []
            for _ in range(n):
                ms, op = b.act(f"/v1/sandboxes/{sid}/snapshots", {"kind": "full"})
                snap = b.get(f"/v1/snapshots/{op['result']['snapshot']}")
                snap_ms.append(ms)
                freeze.append(float(snap["details"]["freeze_ms"]))
                took.append(float(snap["details"]["took_ms"]))
                image.append(float(snap["details"]["image_bytes"]))
                ms, op = b.act(f"/v1/sandboxes/{sid}/rollback", {"snapshot": snap["id"]})
                rb_ms.append(ms)
                rb_timings.append(op["result"].get("timings") or {})
                raw.append(_raw_checkpoint_restore(b, sid))
            # The memory came back with the process: it is still running after every rollback.
            state = b.get(f"/v1/sandboxes/{sid}/commands/{cmd['id']}")["state"]
            if state != "running":
                raise b.fail(f"the {mem} MB process did not survive the rollbacks", state)
            ok = [r for r in raw if "error" not in r]
            raw_ckpt = [float(r["checkpoint_ms"]) for r in raw]
            raw_restore = [float(r["restore_ms"]) for r in ok]
            keys = sorted(set.intersection(*(set(t) for t in rb_timings))) if rb_timings else []
            out[str(mem)] = {
                "snapshot_ms": summary(snap_ms), "rollback_ms": summary(rb_ms),
                "freeze_ms": summary(freeze), "node_took_ms": summary(took),
                "image_bytes": summary(image),
                "rollback_breakdown_ms_p50": {k: pct([t[k] for t in rb_timings if k in t], .5) for k in keys},
                "runsc_checkpoint_ms": summary(raw_ckpt),
                "runsc_restore_ms": summary(raw_restore) if raw_restore else None,
                "runsc_errors": [r["error"] for r in raw if "error" in r],
                "ratio_snapshot_p50": pct(snap_ms, .5) / pct(raw_ckpt, .5),
                "ratio_rollback_p50": pct(rb_ms, .5) / pct(raw_restore, .5) if raw_restore else None,
            }
    return out


# -- 4. fork -----------------------------------------------------------------------------------


def bench_fork(b: Bench, counts: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    """POST /fork {"count": k} until every fork runs (a full checkpoint of the source, then k
    restores), against k cold creates posted at once; and the space each fork's root adds."""
    out: dict[str, Any] = {}
    with b.sandboxes() as ids:
        src = b.sandbox()
        ids.append(src)
        b.sh(src, "dd if=/dev/urandom of=/home/user/state bs=1M count=1 status=none && sync")
        b.fs_sync()
        src_root = b.du(b.root(src))
        for count, reps in counts:
            fork_ms: list[float] = []
            create_ms: list[float] = []
            excl: list[float] = []
            image: list[float] = []
            for _ in range(reps):
                t0 = time.perf_counter()
                r = b.post(f"/v1/sandboxes/{src}/fork", {"count": count})
                forks = [s["id"] for s in r["sandboxes"]]
                ids.extend(forks)
                op = b.wait(r["operation"]["id"], f"fork x{count}")
                fork_ms.append(ms_since(t0))
                if sorted(op["result"]["sandbox_ids"]) != sorted(forks):
                    raise b.fail(f"fork x{count}: not every fork is running", op)
                b.fs_sync()
                excl += [float(b.du(b.root(f))["exclusive"]) for f in forks]
                snap = b.get(f"/v1/snapshots/{r['snapshot']}")
                image.append(float(snap["details"].get("image_bytes") or 0))
                b.delete(forks)
                d = b.c.delete(f"/v1/sandboxes/{src}/snapshots/{snap['id']}")
                if d.status_code == 202:
                    b.wait(d.json()["operation"]["id"], "delete the fork snapshot")
                # Baseline: the same number of sandboxes created cold, all posted at once.
                t0 = time.perf_counter()
                posted = [b.post("/v1/sandboxes", {"template": "base", "snapshot_policy": POLICY_OFF})
                          for _ in range(count)]
                cold = [p["sandbox"]["id"] for p in posted]
                ids.extend(cold)
                for p in posted:
                    b.wait(p["operation"]["id"], "cold create")
                create_ms.append(ms_since(t0))
                b.delete(cold)
            out[str(count)] = {
                "fork_ms": summary(fork_ms), "cold_create_ms": summary(create_ms),
                "ratio_p50": pct(fork_ms, .5) / pct(create_ms, .5),
                "fork_root_exclusive_bytes": summary(excl), "fork_image_bytes": summary(image),
                "source_root": src_root,
            }
    return out


# -- 5. suspend / restore ----------------------------------------------------------------------


def _naive_round_trip(b: Bench, root: Path) -> dict[str, float]:
    """What suspend/restore replaces: the whole root filesystem tar'd and zstd-compressed (the level
    suspend uses) into a file next to the object store, then unpacked into a fresh subvolume.
    Files only (no processes), no fsync: both favour the baseline."""
    dst = b.srv.data_dir / "bench-naive.tar.zst"
    back = b.scratch / "bench-untar"
    try:
        t0 = time.perf_counter()
        with open(dst, "wb") as f:
            tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "--warning=no-file-changed",
                                    "-cf", "-", "."], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            assert tar.stdout is not None
            zstd = subprocess.run(["zstd", "-T0", "-3", "-q", "-c"], stdin=tar.stdout, stdout=f, check=False)
            tar.stdout.close()
            tar_rc = tar.wait()
        up_ms = ms_since(t0)
        if tar_rc not in (0, 1) or zstd.returncode != 0:  # tar exits 1 when a file changed while read
            raise RuntimeError(f"tar|zstd of {root} failed: tar {tar_rc}, zstd {zstd.returncode}")
        b.drop_subvolume(back)
        subprocess.run(["btrfs", "-q", "subvolume", "create", str(back)], check=True, capture_output=True)
        t0 = time.perf_counter()
        subprocess.run(["bash", "-o", "pipefail", "-c", 'zstd -d -q -c -- "$1" | tar -C "$2" --numeric-owner -xf -',
                        "untar", str(dst), str(back)], check=True, capture_output=True)
        down_ms = ms_since(t0)
        return {"upload_ms": up_ms, "bytes": float(dst.stat().st_size), "download_ms": down_ms}
    finally:
        dst.unlink(missing_ok=True)
        b.drop_subvolume(back)


def bench_suspend_restore(b: Bench, n: int, change_mb: int, naive_n: int) -> dict[str, Any]:
    """Suspend (full snapshot, shipped as a btrfs delta over the template plus the memory image) and
    restore of a sandbox that changed ``change_mb`` MiB, against a tar|zstd of its whole root."""
    with b.sandboxes() as ids:
        sid = b.sandbox()
        ids.append(sid)
        b.sh(sid, f"dd if=/dev/urandom of=/home/user/change bs=1M count={change_mb} status=none && sync")
        naive = [_naive_round_trip(b, b.root(sid)) for _ in range(naive_n)]

        def round_trip() -> dict[str, Any]:
            s_ms, s_op = b.act(f"/v1/sandboxes/{sid}/suspend")
            snap = b.get(f"/v1/snapshots/{s_op['result']['snapshot']}")
            r_ms, r_op = b.act(f"/v1/sandboxes/{sid}/restore")
            arts = {a["name"]: a["size"] for a in snap["details"].get("artifacts") or []}
            return {"suspend_ms": s_ms, "restore_ms": r_ms, "uploaded_bytes": s_op["result"]["uploaded_bytes"],
                    "rootfs_bytes": arts.get("rootfs.btrfs.zst", 0),
                    "image_bytes": sum(v for k, v in arts.items() if k.startswith("checkpoint/")),
                    "restore_timings": r_op["result"].get("timings") or {}}

        first = round_trip()  # the first suspend also publishes the template to object storage
        reps = [round_trip() for _ in range(n)]
        b.sh(sid, f"test $(stat -c %s /home/user/change) -eq {change_mb * MIB}")
    sus = [r["suspend_ms"] for r in reps]
    res = [r["restore_ms"] for r in reps]
    up = [float(r["uploaded_bytes"]) for r in reps]
    # Only what every restore reported (a restore that had nothing to wait for leaves keys out).
    keys = sorted(set.intersection(*(set(r["restore_timings"]) for r in reps))) if reps else []
    naive_ms = [x["upload_ms"] for x in naive]
    naive_rt = [x["upload_ms"] + x["download_ms"] for x in naive]
    naive_bytes = naive[0]["bytes"]
    return {
        "change_mb": change_mb, "first_round_trip": first,
        "suspend_ms": summary(sus), "restore_ms": summary(res),
        "round_trip_ms": summary([a + c for a, c in zip(sus, res, strict=True)]),
        "uploaded_bytes": summary(up),
        "rootfs_delta_bytes": summary([float(r["rootfs_bytes"]) for r in reps]),
        "image_bytes": summary([float(r["image_bytes"]) for r in reps]),
        "restore_breakdown_ms_p50": {k: pct([r["restore_timings"][k] for r in reps], .5) for k in keys},
        "naive_tar_zstd_ms": summary(naive_ms), "naive_tar_zstd_bytes": naive_bytes,
        "naive_untar_ms": summary([x["download_ms"] for x in naive]), "naive_round_trip_ms": summary(naive_rt),
        "ratio_suspend_time_p50": pct(sus, .5) / pct(naive_ms, .5),
        "ratio_round_trip_p50": pct([a + c for a, c in zip(sus, res, strict=True)], .5) / pct(naive_rt, .5),
        "ratio_bytes_p50": pct(up, .5) / naive_bytes,
    }


# -- all of it ---------------------------------------------------------------------------------


#: The lifecycle parts, in the order they run (``bench/run --only`` takes these names too).
PARTS = ("pause_resume", "disk_snapshot", "full_checkpoint", "fork", "suspend_restore")


def run_all(srv: Server, plan: Plan, parts: tuple[str, ...] = PARTS,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    b = Bench(srv)
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "pause_resume": lambda: bench_pause_resume(b, plan.pause_n),
        "disk_snapshot": lambda: bench_disk_snapshots(b, plan.disk_sizes_mb, plan.disk_n),
        "full_checkpoint": lambda: bench_full_checkpoint(b, plan.mem_sizes_mb, plan.full_n),
        "fork": lambda: bench_fork(b, plan.fork_counts),
        "suspend_restore": lambda: bench_suspend_restore(b, plan.suspend_n, plan.change_mb, plan.naive_n),
    }
    took: dict[str, float] = {}
    out: dict[str, Any] = {"plan": dataclasses.asdict(plan), "took_s": took}
    try:
        for name in (p for p in PARTS if p in parts):
            t0 = time.perf_counter()
            log(f"lifecycle: {name} ...")
            out[name] = steps[name]()
            took[name] = round(time.perf_counter() - t0, 1)
            log(f"lifecycle: {name} done in {took[name]} s")
    finally:
        b.close()
    return out


# -- the table ---------------------------------------------------------------------------------


def _mib(x: float) -> str:
    return f"{x / MIB:.1f}"


def table_row(metric: str, s: dict[str, float], base: str = "", ratio: float | str | None = None,
         fmt: str = "{:.1f}") -> str:
    r = ratio if isinstance(ratio, str) else "" if ratio is None else f"{ratio:.3g}"
    return (f"| {metric} | {fmt.format(s['p50'])} | {fmt.format(s['p90'])} | {fmt.format(s['p99'])} | "
            f"{int(s['n'])} | {base} | {r} |")


def _mib_summary(s: dict[str, float]) -> dict[str, float]:
    return {k: (v / MIB if k != "n" else v) for k, v in s.items()}


def table_rows(res: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rows for bench/run's table (metric | p50 | p90 | p99 | n | baseline p50 | ratio) and notes."""
    rows: list[str] = []
    notes: list[str] = []
    if pr := res.get("pause_resume"):
        rows.append(table_row("pause, API → op done (ms)", pr["pause_ms"],
                         f"{pr['runsc_pause_ms']['p50']:.1f} (`runsc pause`)", pr["ratio_pause_p50"]))
        rows.append(table_row("resume, API → op done (ms)", pr["resume_ms"],
                         f"{pr['runsc_resume_ms']['p50']:.1f} (`runsc resume`)", pr["ratio_resume_p50"]))
    for d in (res.get("disk_snapshot") or {}).values():
        gib = d["root_bytes"]["exclusive"] / 2**30
        nv, al = d["cp_reflink_never"], d["cp_reflink_always"]
        rows.append(table_row(f"disk snapshot, root holding {gib:.2f} GiB (ms)", d["snapshot_ms"],
                         f"{nv['cp_sync_ms']:.0f} (`cp -a --reflink=never`+sync); "
                         f"{al['cp_sync_ms']:.0f} (`--reflink=always`)",
                         f"{d['ratio_vs_copy_p50']:.2g}; {d['ratio_vs_reflink_p50']:.2g}"))
        rows.append(table_row(f"space a disk snapshot adds after a 1 MiB change, {gib:.2f} GiB root (MiB)",
                         _mib_summary(d["snapshot_exclusive_after_1mib_change"]),
                         f"{_mib(nv['exclusive_bytes'])} (the copy)",
                         d["snapshot_exclusive_after_1mib_change"]["p50"] / max(nv["exclusive_bytes"], 1),
                         fmt="{:.2f}"))
        notes.append(f"disk snapshot {gib:.2f} GiB: node side (btrfs snapshot) p50 {d['node_took_ms']['p50']:.0f} ms; "
                     f"root filled from inside in {d['fill_s']:.0f} s; "
                     f"`cp --reflink=never` {nv['cp_ms']:.0f} ms + sync = {nv['cp_sync_ms']:.0f} ms, "
                     f"`--reflink=always` {al['cp_ms']:.0f} ms + sync = {al['cp_sync_ms']:.0f} ms")
    for mem, d in (res.get("full_checkpoint") or {}).items():
        rc, rr = d["runsc_checkpoint_ms"], d["runsc_restore_ms"]
        rows.append(table_row(f"full checkpoint, {mem} MB touched memory (ms)", d["snapshot_ms"],
                         f"{rc['p50']:.0f} (`runsc checkpoint --leave-running`)", d["ratio_snapshot_p50"],
                         fmt="{:.0f}"))
        rows.append(table_row(f"rollback to it, {mem} MB (ms)", d["rollback_ms"],
                         f"{rr['p50']:.0f} (`runsc restore`)" if rr else "failed (see json)",
                         d["ratio_rollback_p50"], fmt="{:.0f}"))
        rows.append(table_row(f"guest freeze during it, {mem} MB (ms)", d["freeze_ms"], fmt="{:.0f}"))
        rows.append(table_row(f"memory image, {mem} MB (MiB)", _mib_summary(d["image_bytes"])))
        bd = ", ".join(f"{k} {v:.0f}" for k, v in d["rollback_breakdown_ms_p50"].items())
        notes.append(f"rollback {mem} MB, node side p50 ms: {bd}; node-side checkpoint took p50 "
                     f"{d['node_took_ms']['p50']:.0f} ms")
        if d["runsc_errors"]:
            notes.append(f"bare runsc restore failed {len(d['runsc_errors'])}x: {d['runsc_errors'][0][:200]}")
    for count, d in (res.get("fork") or {}).items():
        cc = d["cold_create_ms"]
        rows.append(table_row(f"fork x{count} → all running (ms)", d["fork_ms"],
                         f"{cc['p50']:.0f} ({count} cold create{'s' if count != '1' else ''})", d["ratio_p50"],
                         fmt="{:.0f}"))
        rows.append(table_row(f"space each fork's root adds, x{count} (MiB)",
                              _mib_summary(d["fork_root_exclusive_bytes"]),
                         f"{_mib(d['source_root']['total'])} (a full copy of the root)",
                         d["fork_root_exclusive_bytes"]["p50"] / d["source_root"]["total"], fmt="{:.3f}"))
        notes.append(f"fork x{count}: plus the memory image each fork request checkpoints, p50 "
                     f"{_mib(d['fork_image_bytes']['p50'])} MiB (shared by its forks)")
    if sr := res.get("suspend_restore"):
        nz = sr["naive_tar_zstd_ms"]
        rows.append(table_row(f"suspend, {sr['change_mb']} MiB changed (ms)", sr["suspend_ms"],
                         f"{nz['p50']:.0f} (tar\\|zstd of the root)", sr["ratio_suspend_time_p50"], fmt="{:.0f}"))
        rows.append(table_row("restore from object storage (ms)", sr["restore_ms"],
                         f"{sr['naive_untar_ms']['p50']:.0f} (zstd -d\\|tar -x, files only)",
                         sr["restore_ms"]["p50"] / sr["naive_untar_ms"]["p50"], fmt="{:.0f}"))
        rows.append(table_row("suspend → restore round trip (ms)", sr["round_trip_ms"],
                         f"{sr['naive_round_trip_ms']['p50']:.0f} (tar+untar)", sr["ratio_round_trip_p50"],
                         fmt="{:.0f}"))
        rows.append(table_row("bytes uploaded per suspend (MiB)", _mib_summary(sr["uploaded_bytes"]),
                         f"{_mib(sr['naive_tar_zstd_bytes'])} (tar.zst of the root)", sr["ratio_bytes_p50"],
                         fmt="{:.1f}"))
        f = sr["first_round_trip"]
        bd = ", ".join(f"{k} {v:.0f}" for k, v in sr["restore_breakdown_ms_p50"].items())
        notes.append(f"suspend uploads p50: root delta {_mib(sr['rootfs_delta_bytes']['p50'])} MiB + memory image "
                     f"{_mib(sr['image_bytes']['p50'])} MiB; the first suspend (also publishing the template) "
                     f"took {f['suspend_ms']:.0f} ms, its restore {f['restore_ms']:.0f} ms; restore node side "
                     f"p50 ms: {bd}")
    return rows, notes
