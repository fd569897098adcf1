"""Boot-phase timings of the guest daemon inside a real sandbox (fresh interpreter each time)."""
import json, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.e2e.harness import Server, free_port, wait_operation, run

PHASES = r'''
import time
t0 = time.monotonic()
import os, sys, threading
sys.path.insert(0, "/opt/space/guest")
t = {}
def mark(k):
    t[k] = (time.monotonic() - t0) * 1000
mark("os_threading")
import protocol; mark("protocol")
import guest_base; mark("guest_base")
import guest_procs; mark("guest_procs")
import guest_exec; mark("guest_exec")
import guest_files; mark("guest_files")
import guest_watch; mark("guest_watch")
try:
    import guest_ca, guest_caps; mark("ca_caps_import")
except ImportError:
    pass
try:
    import daemon; mark("daemon_import")
    if hasattr(daemon, "reset_inherited_signals"):
        daemon.reset_inherited_signals(); mark("signals")
    d = daemon.Daemon(); mark("Daemon()")
except Exception as e:
    t["err"] = repr(e)
try:
    import guest_ca
    r = guest_ca.install(); mark("ca_install:" + r)
except ImportError:
    pass
import json; print(json.dumps(t))
'''

def main():
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    with tempfile.TemporaryDirectory(prefix="space-probe-") as tmp:
        srv = Server(data_dir=Path(tmp) / "data", port=free_port(), log_path=Path(tmp) / "serve.log")
        srv.start()
        try:
            with srv.client() as c:
                overlapped = []
                settled = []
                for i in range(2 * n):
                    r = c.post("/v1/sandboxes", json={"template": "base"})
                    op = wait_operation(c, r.json()["operation"]["id"])
                    (settled if i % 2 else overlapped).append(float(op["result"]["timings"].get("guest_boot_ms", 0.0)))
                    sid = r.json()["sandbox"]["id"]
                    d = c.delete(f"/v1/sandboxes/{sid}")
                    if i % 2 == 0 and d.status_code == 202 and "operation" in d.json():
                        wait_operation(c, d.json()["operation"]["id"])
                        time.sleep(0.5)  # let the node's deferred cleanup finish (probe, not a test)
                r = c.post("/v1/sandboxes", json={"template": "base"})
                wait_operation(c, r.json()["operation"]["id"])
                sid = r.json()["sandbox"]["id"]
                rows = []
                for _ in range(n):
                    code, out, err = run(c, sid, {"cmd": ["python3", "-I", "-S", "-c", PHASES], "user": "root"})
                    if code != 0:
                        print(code, err[:500]); break
                    rows.append(json.loads(out))
                c.delete(f"/v1/sandboxes/{sid}")
            print("boot_ms after a settled delete", [round(b, 1) for b in settled], "median", statistics.median(settled))
            print("boot_ms right after a delete", [round(b, 1) for b in overlapped], "median", statistics.median(overlapped))
            json.dump({"settled": settled, "overlapped": overlapped, "phases": rows}, open(sys.argv[3], "w"))
            keys = rows[0].keys() if rows else []
            for k in keys:
                vals = [r[k] for r in rows if k in r and isinstance(r[k], float)]
                if vals:
                    print(f"{k:28s} {statistics.median(vals):7.1f}")
        finally:
            srv.teardown()

main()
