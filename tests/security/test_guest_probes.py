"""Probes: floods from inside a sandbox at the guest channel and the node agent behind it.

Each probe runs in tenant A's sandbox through the real API (and the real node, shim and runsc) while
tenant B's sandbox on the same node keeps answering exec, each exec within a generous deadline
(guest_fixtures.Bystander), and asserts that the node agent's resident memory stays within
MEMORY_BOUND of what it was before. The floods: many commands started at once; output nobody reads;
frames forged into the guest daemon's own channel (as root, through ``/proc/1/fd/1``: whoever is
root in a sandbox can speak for its guest daemon); files created and removed under a watcher.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.harness import Server, wait_for
from tests.security.guest_fixtures import (
    EXEC_DEADLINE,
    Bystander,
    MiB,
    NodeMemory,
    Tenant,
    attacker,
    bystander,
    node_api,
    tenants,
)

__all__ = ["attacker", "bystander", "node_api", "tenants"]  # fixtures

pytestmark = pytest.mark.runtime
GiB = 1 << 30


@contextlib.contextmanager
def watching(server: Server, tenants: tuple[Tenant, Tenant], bystander: str) -> Iterator[tuple[Bystander, NodeMemory]]:
    _, b = tenants
    memory = NodeMemory(server)
    with Bystander(b, bystander, memory) as by:
        by.served(2)
        memory.rebase()  # what the node agent holds with the bystander busy, before any flood
        yield by, memory
        by.served(1)  # and still, once the flood is over
    assert not by.failures, by.failures
    print(f"node agent: {memory.base / MiB:.0f} MiB, at most +{memory.growth / MiB:.1f} MiB; "
          f"{by.done} execs of the bystander; keep-alive races retried: {b.races + tenants[0].races}")
    memory.check()


def stop(a: Tenant, sid: str) -> None:
    """Tell the attacker's flooding scripts to end (they poll for /tmp/stop)."""
    code, _ = a.run(sid, {"cmd": ["touch", "/tmp/stop"], "user": "root"})
    assert code == 0


def finished(a: Tenant, sid: str, cids: list[str]) -> bool:
    return all(a.command(sid, c)["state"] == "exited" for c in cids)


@pytest.mark.probe("starts 1,000 commands through the API as fast as it can, then 32 at once writing 64 MiB each")
def test_command_start_flood(server: Server, tenants: tuple[Tenant, Tenant], attacker: str,
                             bystander: str) -> None:
    a, _ = tenants
    with watching(server, tenants, bystander) as (by, memory):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            starts = list(pool.map(lambda _: a.start(attacker, {"cmd": ["true"]}), range(1000)))
            writers = list(pool.map(lambda _: a.start(attacker, {"cmd": ["head", "-c", str(64 << 20), "/dev/zero"]}),
                                    range(32)))
        by.served(3)

        def ours() -> list[dict[str, Any]]:  # the guest forgets the oldest of more than 256 exited
            memory.sample()
            return [c for c in a.commands(attacker) if c["id"] in set(starts + writers)]

        wait_for(lambda: all(c["state"] == "exited" for c in ours()), 900, "the commands to exit")
    done = {c["id"]: c for c in ours()}
    assert all((done[w]["exit_code"], done[w]["out_bytes"]) == (0, 64 << 20) for w in writers), \
        [done[w] for w in writers][:3]


@pytest.mark.probe("writes GBs to stdout from two commands nobody reads, and stalls a reader of a third")
def test_output_flood_nobody_reads(server: Server, tenants: tuple[Tenant, Tenant], attacker: str,
                                   bystander: str) -> None:
    a, _ = tenants
    with watching(server, tenants, bystander) as (by, memory):
        floods = [a.start(attacker, {"cmd": ["cat", "/dev/zero"]}) for _ in range(2)]
        stalled = a.start(attacker, {"cmd": ["cat", "/dev/zero"]})
        with a.api.stream("GET", f"/v1/sandboxes/{attacker}/commands/{stalled}/events") as r:
            assert r.status_code == 200
            next(r.iter_raw(4096))  # then stop reading: the stream backs up to the node and the guest

            def written() -> int:
                memory.sample()
                return sum(a.command(attacker, c)["out_bytes"] for c in floods)

            wait_for(lambda: written() >= 2 * GiB, 900, "2 GiB of output nobody reads")
            by.served(3)
        for c in [*floods, stalled]:
            r2 = a.send("POST", f"/v1/sandboxes/{attacker}/commands/{c}/signal", json={"signal": "KILL"})
            assert r2.status_code == 204, r2.text


#: Run as root inside the attacker's sandbox: writes ``limit`` frames (or bursts of garbage) straight
#: into the guest daemon's stdout, which is the channel to the node, in atomic writes of whole frames
#: (at most PIPE_BUF bytes, so the daemon's own frames are not torn), then prints how many it wrote.
FORGER = r"""
import json, os, struct, sys
mode, limit = sys.argv[1], int(sys.argv[2])
fd = os.open("/proc/1/fd/1", os.O_WRONLY)

def frame(h, p=b""):
    hb = json.dumps(h, separators=(",", ":")).encode()
    return struct.pack(">II", 4 + len(hb) + len(p), len(hb)) + hb + p

def one(i):
    if mode == "forged-command-ids":
        return frame({"t": "ev", "kind": "out", "cmd": "forged-%d" % i, "seq": 1, "fd": 1, "off": 0}, b"x")
    if mode == "forged-answers":
        return (frame({"t": "res", "id": 10**12 + i, "ok": True, "pad": "y" * 200})
                + frame({"t": "chunk", "id": 10**12 + i, "part": "entries", "entries": [{}] * 100}))
    k = i % 3  # garbage
    if k == 0:
        return b"\xff\xff\xff\xf0" + os.urandom(200)      # a length beyond the protocol
    if k == 1:
        return b"{" * 1024                                # bytes that are not a frame
    return struct.pack(">II", 4 + 40, 40) + b"!" * 40     # a header that is not JSON

i = 0
while i < limit:
    pending = b""
    while len(pending) < 3000:
        pending += one(i)
        i += 1
    os.write(fd, pending)
print(i)
"""


@pytest.mark.parametrize("mode", ["forged-command-ids", "forged-answers", "garbage"])
@pytest.mark.probe("as root, writes forged frames and garbage into its guest daemon's channel (/proc/1/fd/1)")
def test_forged_frames_on_the_guest_channel(server: Server, tenants: tuple[Tenant, Tenant], attacker: str,
                                            bystander: str, mode: str) -> None:
    a, _ = tenants
    with watching(server, tenants, bystander) as (by, _):
        forger = a.start(attacker, {"cmd": ["python3", "-c", FORGER, mode, "400000"], "user": "root"})
        by.served(3)
        events = a.events(attacker, forger)  # until it has written them all, and exited
    assert events[-1]["data"]["exit_code"] == 0, events[-3:]
    out = b"".join(base64.b64decode(e["data"]["data"]) for e in events if e["event"] == "stdout")
    assert int(out) >= 400_000, "the forger did not write its frames"
    # The attacker's own channel survived what it wrote into it.
    assert a.run(attacker, {"cmd": ["echo", "ok"]}) == (0, b"ok\n")


#: Creates and removes files as fast as it can until /tmp/stop appears.
CHURN = r"""
import os
os.makedirs("/tmp/w/a/b", exist_ok=True)
i = 0
while not os.path.exists("/tmp/stop"):
    p = "/tmp/w/a/b/f%d" % (i % 1000)
    with open(p, "w") as f:
        f.write("x")
    os.unlink(p)
    i += 1
"""


@pytest.mark.probe("creates and removes files as fast as it can under a recursive watcher (50,000 events)")
def test_watch_event_flood(server: Server, tenants: tuple[Tenant, Tenant], attacker: str, bystander: str,
                           node_api: httpx.Client) -> None:
    a, _ = tenants
    assert a.run(attacker, {"cmd": ["mkdir", "-p", "/tmp/w/a/b"]})[0] == 0
    r = node_api.post(f"/v1/sandboxes/{attacker}/watchers", json={"path": "/tmp/w", "recursive": True,
                                                                 "entry": True})
    assert r.status_code == 201, r.text
    wid = r.json()["id"]
    with watching(server, tenants, bystander) as (by, memory):
        churn = a.start(attacker, {"cmd": ["python3", "-c", CHURN]})
        by.served(3)
        got = 0

        def drained() -> bool:  # each poll takes up to 10,000 events (the guest keeps no more)
            nonlocal got
            polled = node_api.get(f"/v1/sandboxes/{attacker}/watchers/{wid}/events", timeout=EXEC_DEADLINE)
            assert polled.status_code == 200, polled.text
            got += len(polled.json()["events"])
            memory.sample()
            return got >= 50_000

        wait_for(drained, 900, "50,000 watch events", interval=1.0)
        by.served(1)
        stop(a, attacker)
        wait_for(lambda: finished(a, attacker, [churn]), 300, "the churn to stop")
    assert node_api.delete(f"/v1/sandboxes/{attacker}/watchers/{wid}").status_code == 204
