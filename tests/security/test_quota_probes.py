"""Finding 11: one sandbox could fill the node. Probes from inside real sandboxes of a real
``space serve`` with a small pool (4 GiB, so that a fill takes seconds):

- disk: ``fallocate -l 1T`` and ``dd`` until full in one tenant's sandbox meet its disk limit
  (EDQUOT: "Disk quota exceeded"), and another tenant's sandbox still writes, snapshots and
  suspends; a sandbox with no limit of its own fills only the share of the pool all sandboxes may
  take, never the node's reserve, so snapshots and suspends still work
- fork bomb: the guest's processes per user are bounded (fork fails with EAGAIN); the sandbox
  lives on and answers, and so do the others
- memory bomb: the sandbox's memory limit holds; it dies alone and that is reported as an OOM
  (its state ``failed``, an event with cause ``oom``), nothing else on the node is killed
- defaults: a tenant no quota was ever set for gets the default limits and cannot create more

docs/notes/quotas.md says how each limit is enforced.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.harness import Server, node_agent_pid
from tests.security.quota_fixtures import finish, ok, op_of, sandbox, sh, small_server, start, tenants
from tests.waiting import wait_for

pytestmark = pytest.mark.runtime

__all__ = ["small_server", "tenants"]  # fixtures

SMALL = {"cpu": 0.5, "memory_mb": 256}
LIMIT_MB = 256


#: Files go on the sandbox's root (its /tmp is a tmpfs in gVisor: memory, not disk).
def quota_errno(stderr: str) -> bool:
    return "Disk quota exceeded" in stderr or "No space left on device" in stderr


def still_works(c: Any, sid: str) -> None:
    """The sandbox writes, snapshots and suspends (then comes back)."""
    ok(c, sid, "dd if=/dev/urandom of=$HOME/victim bs=1M count=20 status=none && sync && echo ok")
    snap = op_of(c, c.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "disk"}))
    assert snap["status"] == "succeeded", snap
    suspended = op_of(c, c.post(f"/v1/sandboxes/{sid}/suspend", json={}))
    assert suspended["status"] == "succeeded", suspended
    resumed = op_of(c, c.post(f"/v1/sandboxes/{sid}/restore"))
    assert resumed["status"] == "succeeded", resumed
    assert ok(c, sid, "stat -c %s $HOME/victim").strip() == str(20 << 20)


@pytest.mark.probe("fallocate -l 1T and dd until full inside one tenant's sandbox, then another "
                   "tenant's sandbox writes, snapshots and suspends")
def test_disk_fill_meets_the_sandbox_limit(small_server: Server, tenants: Any) -> None:
    filler, victim = tenants("filler"), tenants("victim")
    a = sandbox(filler.api, **SMALL, disk_mb=LIMIT_MB)
    b = sandbox(victim.api, **SMALL)

    code, _, err, error = sh(filler.api, a, "fallocate -l 1T /var/tmp/huge", user="root")
    assert code != 0 and quota_errno(err), (code, err, error)
    code, out, _, error = sh(filler.api, a, "dd if=/dev/zero of=/var/tmp/fill bs=1M 2>&1; sync; du -sm /var/tmp/fill",
                             user="root", timeout=300)
    assert code == 0 and error is None, (code, out[-2000:], error)
    filled = int(out.split()[-2])
    assert filled <= LIMIT_MB, f"the sandbox wrote {filled} MiB past its {LIMIT_MB} MiB limit: {out[-500:]}"
    assert quota_errno(out), out[-2000:]
    assert filler.api.get(f"/v1/sandboxes/{a}").json()["disk_mb"] == LIMIT_MB
    # Over its limit the sandbox itself lives on: it can still delete (and then write again).
    ok(filler.api, a, "rm -f /var/tmp/fill && sync && dd if=/dev/zero of=/var/tmp/again bs=1M count=8 status=none",
       user="root")

    still_works(victim.api, b)


@pytest.mark.probe("dd until full inside a sandbox with no disk limit of its own, then snapshots and "
                   "suspends on the node still work")
def test_disk_fill_never_takes_the_node_reserve(small_server: Server, tenants: Any) -> None:
    victim = tenants("bystander")
    filler = small_server.client(timeout=300)  # the operator's tenant: no ceiling on disk limits
    b = sandbox(victim.api, **SMALL)
    a = sandbox(filler, **SMALL, disk_mb=1 << 20)  # far beyond the pool
    code, out, _, error = sh(filler, a, "dd if=/dev/zero of=/var/tmp/fill bs=1M 2>&1; sync; echo done",
                             user="root", timeout=600)
    assert code == 0 and error is None and quota_errno(out), (code, out[-2000:], error)
    # The node's view of its pool after the fill: the reserve (1 GiB of a 4 GiB pool) is still free.
    info = wait_for(lambda: _pool_after(small_server), 30, "a heartbeat after the fill")
    assert info["free_bytes"] >= 768 << 20, info
    snap = op_of(victim.api, victim.api.post(f"/v1/sandboxes/{b}/snapshots", json={"kind": "disk"}))
    assert snap["status"] == "succeeded", snap
    suspended = op_of(victim.api, victim.api.post(f"/v1/sandboxes/{b}/suspend", json={}))
    assert suspended["status"] == "succeeded", suspended
    # Once the filler is gone its space comes back (the cleaner, a commit, the next move of the
    # cap): the node makes sandboxes and they write again.
    filler.delete(f"/v1/sandboxes/{a}")
    filler.close()
    wait_for(lambda: _pool_free(small_server) > 2 << 30, 180, "the filler's space to come back", interval=1.0)
    restored = op_of(victim.api, victim.api.post(f"/v1/sandboxes/{b}/restore"))
    assert restored["status"] == "succeeded", restored
    ok(victim.api, b, "dd if=/dev/zero of=$HOME/after bs=1M count=8 status=none && sync")


def _pool_free(server: Server) -> int:
    with server.client() as c:
        nodes = c.get("/v1/nodes").json()["nodes"]
    return int(((nodes[0].get("capacity") or {}).get("pool") or {}).get("free_bytes", 0)) if nodes else 0


def _pool_after(server: Server) -> dict[str, Any] | None:
    with server.client() as c:
        nodes = c.get("/v1/nodes").json()["nodes"]
    pool = ((nodes[0].get("capacity") or {}).get("pool") or {}) if nodes else {}
    return pool if pool.get("used_bytes", 0) > 2 << 30 else None


@pytest.mark.probe("a fork bomb inside a sandbox (as its user)")
def test_fork_bomb_is_bounded(small_server: Server, tenants: Any) -> None:
    t = tenants("forker")
    a, b = sandbox(t.api, **SMALL), sandbox(t.api, **SMALL)
    agent = node_agent_pid(small_server)
    limit = int(ok(t.api, a, "ulimit -u").strip())
    bomb = start(t.api, a, "exec 2>/dev/null; bomb() { bomb | bomb & }; bomb; sleep 5", timeout=60)
    seen: list[int] = []

    def count() -> int:
        # The user's live processes (a zombie has left the count already, not yet the table).
        _, out, _, error = sh(t.api, a, "ps -e -o user=,stat= | awk '$1 != \"root\" && $2 !~ /^Z/' | wc -l",
                              user="root", timeout=30)
        assert error is None, f"the sandbox died under the fork bomb: {error}"
        return int(out.strip() or 0)

    def grown() -> bool:
        seen.append(count())
        return len(seen) >= 5 and max(seen) > limit // 2

    wait_for(grown, 240, "the fork bomb to grow", interval=1.0)
    assert max(seen) <= limit, f"{max(seen)} processes of one user, limit {limit}: {seen}"
    # The sandbox's root ends it (a process forking while it is signalled can outlive one
    # kill of its group, so kill until none is left).
    ok(t.api, a, "for i in $(seq 200); do pkill -9 -u user || break; sleep 0.1; done; true", user="root")
    wait_for(lambda: count() == 0, 60, "the fork bomb to be gone")
    _, _, _, error = finish(t.api, a, bomb)
    assert error is None, f"the sandbox died under the fork bomb: {error}"
    ok(t.api, a, "echo alive")
    ok(t.api, b, "echo alive")
    assert node_agent_pid(small_server) == agent
    assert t.api.get(f"/v1/sandboxes/{a}").json()["state"] == "running"


#: As root: fork until refused (EAGAIN), each child holding its slot until killed; then say how
#: many and hold too (the test kills the command's process group).
ROOT_BOMB = """
import os, signal
n = 0
while True:
    try:
        pid = os.fork()
    except BlockingIOError:
        break
    if pid == 0:
        while True:
            signal.pause()
    n += 1
print(n, flush=True)
while True:
    signal.pause()
"""


def _start(c: Any, sid: str, argv: list[str], **body: Any) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": argv, **body})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _run(c: Any, sid: str, argv: list[str], **body: Any) -> str:
    code, out, err, error = finish(c, sid, _start(c, sid, argv, **body))
    assert code == 0 and error is None, (argv, code, out[-2000:], err[-2000:], error)
    return out


def _cap_sets(status: str) -> dict[str, int]:
    return {k: int(v, 16) for k, v in (line.split(":\t") for line in status.splitlines()
                                        if line.startswith("Cap"))}


@pytest.mark.probe("a fork bomb inside a sandbox as its root, holding every process slot root has, "
                   "then commands and a kill through the API")
def test_a_root_fork_bomb_leaves_the_sandbox_manageable(small_server: Server, tenants: Any) -> None:
    t = tenants("rootfork")
    a = sandbox(t.api, **SMALL)
    limit = int(ok(t.api, a, "ulimit -u", user="root").strip())
    bomb = _start(t.api, a, ["python3", "-c", ROOT_BOMB], user="root", timeout=300)
    # It prints once fork said EAGAIN: root's slots are all taken from here on.
    wait_for(lambda: t.api.get(f"/v1/sandboxes/{a}/commands/{bomb}").json()["out_bytes"] > 0,
             120, "the root fork bomb to fill root's slots")
    # Root's slots are full: the daemon still starts commands, as root (which cannot fork now)
    # and as the user, and its workers still start threads; before the daemon held
    # CAP_SYS_RESOURCE, starting a command here failed with EAGAIN.
    for i in range(10):
        assert _run(t.api, a, ["echo", f"alive {i}"], user="root") == f"alive {i}\n"
        assert ok(t.api, a, "echo user $(id -u)").strip() == "user 1000"
    code, _, err, error = sh(t.api, a, "true & wait", user="root")
    assert code != 0 and error is None, (code, err)  # root itself is still bounded
    r2 = t.api.post(f"/v1/sandboxes/{a}/commands/{bomb}/signal", json={"signal": "KILL"})
    assert r2.status_code == 204, r2.text
    finish(t.api, a, bomb)

    def roots() -> int:
        return int(ok(t.api, a, "ps -e -o user=,stat= | awk '$1 == \"root\" && $2 !~ /^Z/' | wc -l"))

    wait_for(lambda: roots() < limit // 2, 60, "the bomb's processes to be gone")
    assert ok(t.api, a, "true & wait; echo ok", user="root").strip() == "ok"
    assert t.api.get(f"/v1/sandboxes/{a}").json()["state"] == "running"


def test_no_command_holds_the_daemons_cap_sys_resource(small_server: Server, tenants: Any) -> None:
    """The daemon holds CAP_SYS_RESOURCE (exempt from RLIMIT_NPROC); root's commands, on every
    spawn path, get neither it nor a way to raise their process limit."""
    t = tenants("caps")
    a = sandbox(t.api, **SMALL)
    bit = 1 << 24  # CAP_SYS_RESOURCE
    daemon = _cap_sets(ok(t.api, a, "cat /proc/1/status", user="root"))
    assert daemon["CapEff"] & bit, daemon  # (its threads that start commands drop it from their bounding sets)
    for how in ({"user": "root"}, {"user": "root", "pty": {"rows": 24, "cols": 80}}, {}):
        caps = _cap_sets(_run(t.api, a, ["cat", "/proc/self/status"], **how))
        assert not any(v & bit for v in caps.values()), (how, caps)
        # and what a root shell starts (a child of the command, not of the daemon)
        caps = _cap_sets(ok(t.api, a, "cat /proc/self/status; true", **how))
        assert not any(v & bit for v in caps.values()), (how, caps)
    code, _, err, _ = sh(t.api, a, "ulimit -u unlimited", user="root")
    assert code != 0, err


BOMBS = {
    # gVisor's own accounting may refuse the allocation first (MemoryError inside), or the host's
    # OOM killer takes the sandbox: either holds the limit.
    "heap": "python3 -c 'x = []\nwhile True: x.append(bytearray(16 << 20))'",
    # tmpfs pages are the sentry's memory, not an application's: the host's OOM killer decides.
    "tmpfs": "i=0; while dd if=/dev/zero of=/dev/shm/f$i bs=1M count=16 status=none; do i=$((i+1)); done; "
             "echo stopped at $i",
}


@pytest.mark.probe("a memory bomb inside a sandbox")
@pytest.mark.parametrize("bomb", list(BOMBS), ids=[f"memory-bomb-{k}" for k in BOMBS])
def test_memory_bomb_is_held_by_the_sandbox_limit(small_server: Server, tenants: Any, bomb: str) -> None:
    t = tenants("hog")
    a, b = sandbox(t.api, **SMALL), sandbox(t.api, **SMALL)
    agent = node_agent_pid(small_server)
    code, out, err, error = sh(t.api, a, BOMBS[bomb], user="root", timeout=120)
    if error is None:
        # Refused inside: the sandbox lives on, within its limit.
        assert code != 0 or "stopped at" in out, (code, out[-1000:], err[-1000:])
        assert t.api.get(f"/v1/sandboxes/{a}").json()["state"] == "running"
        ok(t.api, a, "rm -f /dev/shm/f*; echo alive", user="root")
    else:
        # Killed whole by the host: told as an OOM, its state failed with the reason, an event.
        assert error.get("cause") == "oom", error
        sb = wait_for(lambda: (s := t.api.get(f"/v1/sandboxes/{a}").json())["state"] == "failed" and s, 120,
                      "the sandbox to be failed")
        assert "out of memory" in (sb["error"] or {}).get("message", ""), sb
        events = t.api.get(f"/v1/sandboxes/{a}/events").json()["events"]
        assert any(e.get("kind") == "failed" and (e.get("data") or {}).get("cause") == "oom"
                   for e in events), events
    ok(t.api, b, "echo alive")
    assert node_agent_pid(small_server) == agent
    assert small_server.client().get("/healthz").status_code == 200


@pytest.mark.probe("a tenant no quota was ever set for creates more sandboxes than the default")
def test_a_new_tenant_gets_the_default_quota(small_server: Server, tenants: Any) -> None:
    t = tenants("newcomer")
    q = t.api.get("/v1/quota").json()
    assert q["limits"]["sandboxes"] is not None, f"a new tenant is unlimited: {q}"
    assert q.get("source") == "default", q
    with small_server.client() as op:
        before = op.get("/v1/quota/defaults").json()["limits"]
        r = op.put("/v1/quota/defaults", json={"sandboxes": 2, "disk_mb": 512})
        assert r.status_code == 200, r.text
    try:
        for _ in range(2):
            sandbox(t.api, **SMALL, disk_mb=512)
        r = t.api.post("/v1/sandboxes", json={"template": "base", **SMALL})
        assert r.status_code == 429 and r.json()["error"]["resource"] == "sandboxes", r.text
        r = t.api.post("/v1/sandboxes", json={"template": "base", **SMALL, "disk_mb": 4096})
        assert r.status_code == 429, r.text
        assert t.api.get("/v1/quota").json()["limits"]["sandboxes"] == 2
        # Limits set for the tenant replace the defaults.
        with small_server.client() as op:
            assert op.put(f"/v1/tenants/{t.name}/quota", json={"sandboxes": 3}).status_code == 200
        sandbox(t.api, **SMALL)
    finally:
        with small_server.client() as op:
            op.put("/v1/quota/defaults", json=before)
