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
    assert all(g.is_dir() for g in groups)  # another node's shim is in them

    shim.kill()
    shim.wait(timeout=10)
    wait_for(lambda: not any((g / "cgroup.procs").read_text().strip() for g in groups), 10,
             "the killed shim to leave its cgroups")
    placement.remove_empty_shim_groups()
    assert not any(g.exists() for g in groups)
