#!/usr/bin/env python3
"""Templates from container images (issue 19): what materializing one costs against the tools
alone, in the same run (needs root).

    sudo .venv/bin/python bench/template_image.py [--runs 3] [--out STEM]

A registry on loopback (Debian's ``docker-registry``) and a ``space serve`` of its own that may pull
from it. The image is the server's ``base`` root (~300 MB unpacked) built with ``buildah`` from
scratch; each run adds a layer holding a nonce, so each run's image is new to the server and its
template is pulled and unpacked from nothing. Per run, alternately:

- ``materialize``: ``POST /v1/templates/{name}/build`` with the image's tag → the operation done
  (the tag pinned through a node, pull, unpack into a btrfs subvolume, the image's configure and
  guest check in build sandboxes, the read-only publish, the send stream written to the cache);
- the baseline, ``skopeo copy`` of the same image to an OCI layout + ``umoci raw unpack`` of it,
  into a directory on the same btrfs pool (target: materialize at most 1.3 times it);
- ``rebuild``: the same tag built again (the same digest: the template exists, nothing pulled);
- ``create``: a sandbox of the new template, create → running (a cold create: no pool keeps it).

Then, per run, E2B's SDK: ``Template().from_dockerfile(...)`` of a 3-step Dockerfile on E2B's base
(SPACE's ``base`` here: ENV, COPY of a context file, RUN) with ``Template.build``, cold (a nonce in
the RUN makes each run's template new) and cached (the same again: the same digest); against the
same Dockerfile (another nonce) through ``space template build -f``, SPACE's own path, cold.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lifecycle import given, ms_since, summary  # noqa: E402
from space.keyforms import e2b_spelling  # noqa: E402
from tests.e2e.harness import SPACE, base_template, free_port, own_server, wait_operation  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

CACHE = Path("/var/cache/space")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Registry:
    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        (root / "config.yml").write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
                                         f"    rootdirectory: {root / 'data'}\nhttp:\n  addr: {self.address}\n")
        self._log = (root / "registry.log").open("wb")
        self.proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")], stdout=self._log,
                                     stderr=self._log)
        wait_for(lambda: subprocess.run(["curl", "-sf", f"http://{self.address}/v2/"],
                                        capture_output=True).returncode == 0, timeout=30, what="the registry")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._log.close()


class Buildah:
    def __init__(self, root: Path) -> None:
        self.flags = ["--root", str(root / "storage"), "--runroot", str(root / "run"), "--storage-driver", "vfs"]

    def __call__(self, *args: str) -> str:
        p = subprocess.run(["buildah", *self.flags, *args], capture_output=True, text=True, timeout=1200)
        if p.returncode != 0:
            raise RuntimeError(f"buildah {args[0]} failed: {p.stderr[-2000:]}")
        return p.stdout.strip()


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {p.stderr[-2000:]}")
    return ms_since(t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, metavar="STEM",
                    help="save STEM.json and STEM.md (default: bench/results/<date>-template-image)")
    args = ap.parse_args()
    res: dict[str, Any] = {"date": dt.date.today().isoformat(), "args": given(args)}
    materialize: list[float] = []
    baseline: list[float] = []
    rebuild: list[float] = []
    create: list[float] = []
    built: list[str] = []
    with tempfile.TemporaryDirectory(prefix="space-bench-image-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "registry").mkdir()
        (tmp / "serve").mkdir()
        registry = Registry(tmp / "registry")
        buildah = Buildah(tmp / "buildah")
        try:
            with own_server(tmp / "serve", env={"SPACE_BUILD_REGISTRIES": f"http://{registry.address}"}) as srv, \
                    srv.client(timeout=600) as api:
                c = buildah("from", "scratch")
                mnt = Path(buildah("mount", c))  # owners kept (buildah copy makes every file root's)
                subprocess.run(["cp", "-a", f"{base_template(srv)}/.", str(mnt)], check=True)
                buildah("umount", c)
                buildah("config", "--user", "user", "--workingdir", "/home/user", c)
                buildah("commit", "--quiet", c, "bench/base:1")
                buildah("rm", c)
                unpacked = int(subprocess.run(["du", "-sxb", str(base_template(srv))], capture_output=True,
                                              text=True).stdout.split()[0])
                res["unpacked_bytes"] = unpacked
                pool_tmp = srv.data_dir / "pool" / "tmp"
                for i in range(args.runs):
                    nonce = uuid.uuid4().hex[:12]
                    c = buildah("from", "bench/base:1")
                    (tmp / "nonce").write_text(nonce)
                    buildah("copy", c, str(tmp / "nonce"), "/etc/bench-nonce")
                    buildah("commit", "--quiet", c, f"bench/app:{nonce}")
                    buildah("rm", c)
                    ref = f"{registry.address}/bench/app:{nonce}"
                    buildah("push", "--quiet", "--tls-verify=false", f"bench/app:{nonce}", f"docker://{ref}")
                    name = f"bench-image-{i}"

                    def build(name: str = name, ref: str = ref) -> float:
                        t0 = time.perf_counter()
                        r = api.post(f"/v1/templates/{name}/build", json={"spec": {"image": ref}})
                        r.raise_for_status()
                        op = wait_operation(api, r.json()["operation"]["id"], timeout=1800)
                        if op["status"] != "succeeded":
                            raise RuntimeError(f"build of {ref} {op['status']}: {op.get('error')}")
                        return ms_since(t0)

                    def tools(ref: str = ref, i: int = i) -> float:
                        layout = tmp / f"layout-{i}"
                        dest = pool_tmp / f"bench-baseline-{i}"
                        dest.mkdir()
                        try:
                            return (timed(["skopeo", "--insecure-policy", "copy", "--quiet", "--src-tls-verify=false",
                                           f"docker://{ref}", f"oci:{layout}:x"])
                                    + timed(["umoci", "--log", "error", "raw", "unpack", "--image", f"{layout}:x",
                                             str(dest)]))
                        finally:
                            shutil.rmtree(layout, ignore_errors=True)
                            shutil.rmtree(dest, ignore_errors=True)

                    # Alternate which goes first: neither always meets a warm page cache.
                    if i % 2 == 0:
                        materialize.append(build())
                        baseline.append(tools())
                    else:
                        baseline.append(tools())
                        materialize.append(build())
                    built.append(name)
                    rebuild.append(build())
                    t0 = time.perf_counter()
                    r = api.post("/v1/sandboxes", json={"template": name})
                    r.raise_for_status()
                    body = r.json()
                    if r.status_code == 202:
                        op = wait_operation(api, body["operation"]["id"], timeout=600)
                        if op["status"] != "succeeded":
                            raise RuntimeError(f"create from {name} {op['status']}: {op.get('error')}")
                    create.append(ms_since(t0))
                    d = api.delete(f"/v1/sandboxes/{body['sandbox']['id']}")
                    if d.status_code == 202:
                        wait_operation(api, d.json()["operation"]["id"], timeout=300)
                    log(f"run {i + 1}/{args.runs}: materialize {materialize[-1]:.0f} ms, skopeo+umoci "
                        f"{baseline[-1]:.0f} ms, rebuild {rebuild[-1]:.0f} ms, create {create[-1]:.0f} ms")
                res["image_build_steps_s"] = image_steps(srv.log_path)
                res.update(e2b_builds(srv, tmp, args.runs))
                for manifest in (srv.data_dir / "pool" / "templates").glob("bench-*@*.json"):
                    body = json.loads(manifest.read_text())
                    (CACHE / "templates" / f"{body['name']}-{body['digest']}.btrfs.zst").unlink(missing_ok=True)
        finally:
            registry.close()
            subprocess.run(["buildah", *buildah.flags, "rm", "--all"], capture_output=True)
    m, b = summary(materialize), summary(baseline)
    res.update({"materialize_ms": m, "skopeo_umoci_ms": b, "ratio_p50": m["p50"] / b["p50"],
                "rebuild_same_tag_ms": summary(rebuild), "create_ms": summary(create)})
    table = render(res)
    print(table)
    out = args.out or REPO / "bench" / "results" / f"{res['date']}-template-image"
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    log(f"saved {out}.json and .md")
    return 0


def image_steps(log_path: Path) -> dict[str, float]:
    """Where an image template's build spends its time, from the server's log (mean seconds over
    the runs): the pull and unpack, the two build sandboxes, the whole of the base step, and the
    template's send stream written to the node's cache."""
    sums: dict[str, list[float]] = {}
    for raw in log_path.read_text(errors="replace").splitlines():
        if not raw.startswith("{"):
            continue
        try:
            ev = json.loads(raw)
        except ValueError:
            continue
        if ev.get("event") == "template.image_steps" and "/bench/app" in str(ev.get("image", "")):
            for k in ("pull_unpack_s", "configure_s", "check_s"):
                sums.setdefault(k, []).append(float(ev[k]))
        elif ev.get("event") == "template.build_step" and str(ev.get("step", "")).startswith("base: image"):
            sums.setdefault("base_step_s", []).append(float(ev["seconds"]))
        elif ev.get("event") == "template.exported" and str(ev.get("template", "")).startswith("bench-image-"):
            sums.setdefault("export_s", []).append(float(ev["seconds"]))
    return {k: round(sum(v) / len(v), 2) for k, v in sums.items()}


E2B_DOCKERFILE = """FROM e2bdev/base
ENV STAGE=bench
COPY app.py /opt/app/
RUN python3 /opt/app/app.py > /opt/app/out-{nonce}
"""


def e2b_builds(srv: Any, tmp: Path, runs: int) -> dict[str, Any]:
    """E2B's SDK building a 3-step Dockerfile, cold and cached, and SPACE's CLI building it cold."""
    import os

    os.environ.update({"E2B_API_URL": srv.url, "E2B_SANDBOX_URL": srv.url,
                       "E2B_API_KEY": e2b_spelling(srv.admin_key)})
    for name in ("E2B_DEBUG", "E2B_DOMAIN", "E2B_ACCESS_TOKEN"):
        os.environ.pop(name, None)
    import e2b

    ctx = tmp / "e2b-context"
    ctx.mkdir()
    (ctx / "app.py").write_text("print('built for the benchmark')\n")
    cold: list[float] = []
    cached: list[float] = []
    native: list[float] = []
    for i in range(runs):
        nonce = uuid.uuid4().hex[:12]
        template = e2b.Template(file_context_path=str(ctx)).from_dockerfile(E2B_DOCKERFILE.format(nonce=nonce))
        t0 = time.perf_counter()
        e2b.Template.build(template, f"bench-e2b-{i}")
        cold.append(ms_since(t0))
        t0 = time.perf_counter()
        e2b.Template.build(template, f"bench-e2b-{i}")
        cached.append(ms_since(t0))
        (ctx / "Dockerfile").write_text(E2B_DOCKERFILE.format(nonce=nonce + "-native").replace("e2bdev/base", "base"))
        env = {**os.environ, "SPACE_URL": srv.url, "SPACE_API_KEY": srv.admin_key}
        native.append(timed_env([SPACE, "template", "build", f"bench-native-{i}", "-f", str(ctx / "Dockerfile")], env))
        log(f"e2b run {i + 1}/{runs}: Template.build cold {cold[-1]:.0f} ms, cached {cached[-1]:.0f} ms; "
            f"space template build -f {native[-1]:.0f} ms")
    c, n = summary(cold), summary(native)
    return {"e2b_build_cold_ms": c, "e2b_build_cached_ms": summary(cached), "space_cli_build_cold_ms": n,
            "e2b_vs_cli_p50": c["p50"] / n["p50"]}


def timed_env(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {p.stderr[-2000:]}")
    return ms_since(t0)


def render(res: dict[str, Any]) -> str:
    def row(what: str, s: dict[str, float], base: str = "", ratio: str = "") -> str:
        return f"| {what} | {s['p50']:.0f} | {s['p90']:.0f} | {s['p99']:.0f} | {s['n']} | {base} | {ratio} |"

    m, b = res["materialize_ms"], res["skopeo_umoci_ms"]
    return "\n".join([
        f"Templates from container images, {res['date']} ({res['unpacked_bytes'] / 1e6:.0f} MB unpacked, one layer "
        "plus a nonce's)",
        "",
        "| metric | p50 | p90 | p99 | n | baseline p50 | ratio |",
        "|---|---|---|---|---|---|---|",
        row("image template materialized: API build → done (ms)", m, f"{b['p50']:.0f} (skopeo copy + umoci unpack)",
            f"{res['ratio_p50']:.2f} (target ≤ 1.3)"),
        row("skopeo copy + umoci raw unpack alone (ms)", b),
        row("the same tag built again (ms)", res["rebuild_same_tag_ms"]),
        row("a sandbox of it, create → running (ms)", res["create_ms"]),
        row("E2B SDK Template.build, 3-step Dockerfile, cold (ms)", res["e2b_build_cold_ms"],
            f"{res['space_cli_build_cold_ms']['p50']:.0f} (space template build -f, cold)",
            f"{res['e2b_vs_cli_p50']:.2f}"),
        row("E2B SDK Template.build, the same again (ms)", res["e2b_build_cached_ms"]),
        row("space template build -f, the same Dockerfile, cold (ms)", res["space_cli_build_cold_ms"]),
        "",
        "Where an image template's build goes (mean seconds, from the server's log): "
        + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in res["image_build_steps_s"].items()),
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
