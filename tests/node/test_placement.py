"""Shims placed outside the node agent's cgroups (space.node.helper.placement), on this host's real
cgroup hierarchies (v1 controllers and the unified v2 one) and real processes:

- a shim is moved into ``/space/shims`` of every mounted hierarchy, and nothing of it stays in the
  cgroups it started in (those whose processes a container runtime kills with the container);
- the helper moves only what the agent may name: its own child, running as the agent's uid, that
  is a shim; anything else is refused and stays where it is;
- the groups go at teardown once empty, and stay while another node's shim is in one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from space.errors import Conflict
from space.node.helper import placement
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="moving processes between cgroups needs root")

#: A process whose command line is a shim's (``-m space.runtime.shim``); the trailing ``:`` keeps
#: the shell from exec'ing sleep in its place.
SHIM_LIKE = ["sh", "-c", "sleep 60; :", "-m", "space.runtime.shim"]


def cgroups_of(pid: int) -> dict[str, str]:
    """hierarchy (controllers, or "" for v2) -> the process's cgroup in it."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        out[controllers] = path
    return out


Spawn = Callable[[list[str]], "subprocess.Popen[bytes]"]


@pytest.fixture
def child() -> Iterator[Spawn]:
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(argv)
        procs.append(p)
        return p

    yield spawn
    for p in procs:
        p.kill()
        p.wait(timeout=10)
    placement.remove_empty_shim_groups()


def test_a_shim_is_moved_into_space_shims_in_every_hierarchy(child: Spawn) -> None:
    shim = child(SHIM_LIKE)
    before = cgroups_of(shim.pid)
    found = placement.hierarchies()
    assert {h.fstype for h in found} >= {"cgroup"} or {h.fstype for h in found} == {"cgroup2"}

    placement.check_shim(shim.pid, parent=os.getpid(), uid=0)
    moved = placement.place_shim(shim.pid)

    assert sorted(moved) == sorted(str(h.mountpoint) for h in found)
    after = cgroups_of(shim.pid)
    assert set(after) == set(before)
    # Every hierarchy, the named ones (systemd's) and the unified one too: runc finds a
    # container's processes by one of them, systemd by another.
    assert all(path == "/space/shims" for path in after.values()), after
    for h in found:
        assert str(shim.pid) in (h.mountpoint / "space" / "shims" / "cgroup.procs").read_text().split()


def test_what_is_not_the_agents_own_shim_is_refused_and_stays_where_it_is(child: Spawn) -> None:
    not_a_shim = child(["sleep", "60"])
    with pytest.raises(Conflict, match="is not a shim"):
        placement.check_shim(not_a_shim.pid, parent=os.getpid(), uid=0)

    shim = child(SHIM_LIKE)
    with pytest.raises(Conflict, match="does not run as the node agent"):
        placement.check_shim(shim.pid, parent=os.getpid(), uid=997)
    with pytest.raises(Conflict, match="not the caller's child"):
        placement.check_shim(shim.pid, parent=os.getpid() + 1, uid=0)
    # Another process's child (here the shell's own sleep): not the caller's to move.
    grandchild = int(wait_for(lambda: (Path(f"/proc/{shim.pid}/task/{shim.pid}/children").read_text().split()
                                       or [None])[0], 10, "the shell's sleep"))
    with pytest.raises(Conflict, match="not the caller's child"):
        placement.check_shim(grandchild, parent=os.getpid(), uid=0)
    with pytest.raises(Conflict, match="is gone"):
        placement.check_shim(1 << 22, parent=os.getpid(), uid=0)
    assert "/space/shims" not in cgroups_of(shim.pid).values()


def test_the_shims_groups_go_once_empty_and_stay_while_one_is_in_use(child: Spawn) -> None:
    shim = child(SHIM_LIKE)
    placement.place_shim(shim.pid)
    groups = [h.mountpoint / placement.SHIMS for h in placement.hierarchies()]

    placement.remove_empty_shim_groups()
    assert all(g.is_dir() for g in groups)  # a node's shim is in them

    shim.kill()
    shim.wait(timeout=10)
    wait_for(lambda: not any(str(shim.pid) in (g / "cgroup.procs").read_text().split() for g in groups), 10,
             "the killed shim to leave its cgroups")
    placement.remove_empty_shim_groups()
    # Gone, unless a shim of a node running on this host meanwhile is in one.
    for g in groups:
        assert not g.exists() or (g / "cgroup.procs").read_text().strip(), g


def test_a_node_in_a_cgroup_namespace_of_its_own_joins_the_hosts_to_place_a_shim(child: Spawn) -> None:
    """A pod's container on a cgroup v2 host has a cgroup namespace of its own; from inside it no
    process can be moved to a cgroup outside (ENOENT, where the v2 hierarchy is mounted with
    ``nsdelegate``, as systemd mounts it). With the host's PIDs in sight (hostPID), the node joins
    the namespace of the host's init first, and the move works. (This host's pid 1 is not
    readable, and its cgroup2 mount has no ``nsdelegate``: the test's own process stands for the
    host's init, and the refusal before the join is asserted only where the kernel makes it.)"""
    shim = child(SHIM_LIKE)
    code = ("import sys; from pathlib import Path; from space.node.helper import placement as p\n"
            "from space.errors import RuntimeFailure\n"
            "pid, init = int(sys.argv[1]), Path(sys.argv[2])\n"
            "try:\n    p.place_shim(pid); print('placed before')\n"
            "except RuntimeFailure as e:\n    print('refused before:', e.message)\n"
            "print('joined', p.enter_host_cgroup_namespace(init))\n"
            "p.place_shim(pid); print('placed after')\n"
            "print('joined again', p.enter_host_cgroup_namespace(init))\n")
    out = subprocess.run(["unshare", "--cgroup", sys.executable, "-c", code, str(shim.pid), f"/proc/{os.getpid()}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    if _nsdelegate():
        assert lines[0].startswith("refused before:") and "No such file or directory" in lines[0], lines
    assert lines[1:] == ["joined True", "placed after", "joined again False"], lines
    assert set(cgroups_of(shim.pid).values()) == {"/space/shims"}


def _nsdelegate() -> bool:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        _, _, right = line.partition(" - ")
        fstype, _, options = right.split()
        if fstype == "cgroup2" and "nsdelegate" in options.split(","):
            return True
    return False
