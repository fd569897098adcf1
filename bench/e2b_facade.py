"""The E2B facade's cost (issue 6): the official ``e2b`` SDK against the same server, next to SPACE's
own API doing the same thing, measured in the same run.

- ``e2b``: a sandbox create (``Sandbox.create()``, warm pool of ``base``) against SPACE's create
  (POST /v1/sandboxes → 201 running); a command round trip (``commands.run("true")``) against
  SPACE's exec (POST command + its event stream to the exit); a 1 MiB file write + read
  (``files.write``/``files.read``) against SPACE's PUT/GET; a kill against SPACE's delete + wait.

Both clients keep their connections alive, so the ratio is the facade's translation (Connect
envelopes, the envd token, the command lookup by pid) plus each client's own overhead.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench import create as creation
from bench.lifecycle import Bench, ms_since, summary, table_row
from tests.e2e.harness import read_events, wait_operation

PARTS = ("e2b",)
#: Warm sandboxes of ``base``: both clients' creates take the warm path.
POOL = 2
FILE_BYTES = 1 << 20


def _space_create(b: Bench) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = b.c.post("/v1/sandboxes", json={"template": "base"})
    body = r.json()
    if r.status_code == 202:
        wait_operation(b.c, body["operation"]["id"])
    return ms_since(t0), str(body["sandbox"]["id"])


def _space_delete(b: Bench, sid: str) -> float:
    t0 = time.perf_counter()
    op = b.c.delete(f"/v1/sandboxes/{sid}").json()["operation"]["id"]
    wait_operation(b.c, op)
    return ms_since(t0)


def bench_e2b(b: Bench, n: int) -> dict[str, Any]:
    import e2b

    os.environ.update({"E2B_API_URL": b.srv.url, "E2B_SANDBOX_URL": b.srv.url, "E2B_API_KEY": b.srv.admin_key})
    for name in ("E2B_DEBUG", "E2B_DOMAIN"):
        os.environ.pop(name, None)
    out: dict[str, list[float]] = {k: [] for k in ("e2b_create", "space_create", "e2b_run", "space_exec",
                                                 "e2b_file", "space_file", "e2b_kill", "space_delete")}
    payload = os.urandom(FILE_BYTES)
    creation.set_pool(b, POOL)
    for _ in range(n):
        # Creates alternate, each from a full pool, so both take the warm path.
        creation.wait_ready(b, POOL, settled=True)
        t0 = time.perf_counter()
        sbx = e2b.Sandbox.create()
        out["e2b_create"].append(ms_since(t0))
        creation.wait_ready(b, POOL, settled=True)
        ms, sid = _space_create(b)
        out["space_create"].append(ms)
        try:
            for _ in range(5):
                t0 = time.perf_counter()
                sbx.commands.run("true")
                out["e2b_run"].append(ms_since(t0))
                t0 = time.perf_counter()
                cmd = b.c.post(f"/v1/sandboxes/{sid}/commands", json={"shell": "true"}).json()
                read_events(b.c, sid, cmd["id"])
                out["space_exec"].append(ms_since(t0))
            t0 = time.perf_counter()
            sbx.files.write("/home/user/blob", payload)
            if sbx.files.read("/home/user/blob", format="bytes") != payload:
                raise b.fail("e2b file round trip", "the bytes read differ")
            out["e2b_file"].append(ms_since(t0))
            t0 = time.perf_counter()
            b.c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/blob"}, content=payload)
            if b.c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/blob"}).content != payload:
                raise b.fail("SPACE file round trip", "the bytes read differ")
            out["space_file"].append(ms_since(t0))
        finally:
            t0 = time.perf_counter()
            sbx.kill()
            out["e2b_kill"].append(ms_since(t0))
            out["space_delete"].append(_space_delete(b, sid))
    creation.set_pool(b, 0)
    s = {k: summary(v) for k, v in out.items()}
    return {"n": n, **{f"{k}_ms": v for k, v in s.items()},
            "ratio_create_p50": s["e2b_create"]["p50"] / s["space_create"]["p50"],
            "ratio_run_p50": s["e2b_run"]["p50"] / s["space_exec"]["p50"],
            "ratio_file_p50": s["e2b_file"]["p50"] / s["space_file"]["p50"],
            "ratio_kill_p50": s["e2b_kill"]["p50"] / s["space_delete"]["p50"]}


def run_all(b: Bench, parts: tuple[str, ...], *, quick: bool, log: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "e2b" in parts:
        log("e2b facade ...")
        out["e2b"] = bench_e2b(b, 5 if quick else 20)
    return out


def table_rows(res: dict[str, Any]) -> tuple[list[str], list[str]]:
    rows: list[str] = []
    notes: list[str] = []
    if "e2b" in res:
        e = res["e2b"]
        for label, mine, theirs, ratio, base in (
            ("E2B SDK `Sandbox.create()`, warm (ms)", "e2b_create", "space_create", "ratio_create_p50",
             "SPACE create"),
            ("E2B SDK `commands.run(\"true\")` (ms)", "e2b_run", "space_exec", "ratio_run_p50", "SPACE exec"),
            ("E2B SDK 1 MiB `files.write` + `read` (ms)", "e2b_file", "space_file", "ratio_file_p50",
             "SPACE PUT+GET"),
            ("E2B SDK `kill()` (ms)", "e2b_kill", "space_delete", "ratio_kill_p50", "SPACE delete+wait"),
        ):
            rows.append(table_row(label, e[f"{mine}_ms"], f"{e[f'{theirs}_ms']['p50']:.1f} ({base})", e[ratio]))
        notes.append("E2B facade: both clients against the same server in the same run; ratio = E2B SDK p50 / "
                     "SPACE API p50")
    return rows, notes
