"""Real cgroups for tests: a group of its own in this host's v1 freezer hierarchy, or in a cgroup2
filesystem mounted for the test (this host runs cgroup v1, and a fresh cgroup2 mount still has the
v2 freezer, ``cgroup.freeze``; its controllers are bound to v1, so ``cpu.weight`` and
``memory.events`` do not exist there). Each holds a sleeping process; everything made is thawed,
emptied, removed and unmounted afterwards."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from space.runtime.cgroups import Cgroups, CgroupsV1, CgroupsV2
from tests.waiting import wait_for

HOST_ROOT = Path("/sys/fs/cgroup")


class Instance(NamedTuple):
    """An instance's cgroup as :mod:`space.runtime.cgroups` names it, with a process in it."""

    cgroups: Cgroups
    name: str
    proc: subprocess.Popen[bytes]


def instance_name() -> str:
    return f"space-test-{secrets.token_hex(4)}"


@contextlib.contextmanager
def cgroup2_root(tmp_path: Path) -> Iterator[Path]:
    """A group of its own in a cgroup2 filesystem mounted at a temporary directory (so nothing the
    test makes lands beside the host's own groups); every group below it removed and the
    filesystem unmounted afterwards. Skips when it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a cgroup2 filesystem needs root")
    mnt = tmp_path / "cgroup2"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "cgroup2", "none", str(mnt)], capture_output=True, text=True,
                         timeout=30, check=False)
    if res.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a cgroup2 filesystem here: {res.stderr.strip() or res.returncode}")
    root = mnt / instance_name()
    try:
        root.mkdir()
        yield root
    finally:
        try:
            _remove_groups(root)
        finally:
            subprocess.run(["umount", str(mnt)], check=True, timeout=30)
            mnt.rmdir()


def _remove_groups(group: Path) -> None:
    """``group`` and every group below it, deepest first (they must be empty of processes)."""
    if not group.is_dir():
        return
    for child in group.iterdir():
        if child.is_dir():
            _remove_groups(child)
    group.rmdir()


def _events(group: Path) -> dict[str, str]:
    try:
        return dict(line.split(" ", 1) for line in (group / "cgroup.events").read_text().splitlines())
    except FileNotFoundError:
        return {}


@contextlib.contextmanager
def sleeper_in_v2(group: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A sleeping process moved into the v2 ``group``; thawed, killed, reaped and the group empty
    afterwards."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        (group / "cgroup.procs").write_text(str(proc.pid))
        yield proc
    finally:
        with contextlib.suppress(OSError):
            (group / "cgroup.freeze").write_text("0")
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: _events(group).get("populated", "0") == "0", 10, "the v2 group to empty")


@contextlib.contextmanager
def v2_instance(tmp_path: Path) -> Iterator[Instance]:
    """An instance group ``<root>/space/<name>`` in a mounted cgroup2 tree, a process in it."""
    with cgroup2_root(tmp_path) as root:
        cg = CgroupsV2(root)
        name = instance_name()
        group = cg.group(name)
        group.mkdir(parents=True)
        with sleeper_in_v2(group) as proc:
            yield Instance(cg, name, proc)


@contextlib.contextmanager
def v1_instance() -> Iterator[Instance]:
    """An instance group in this host's v1 freezer hierarchy (``freezer/space/<name>``), a process
    in it; thawed, emptied and removed afterwards. Skips without root or the v1 freezer."""
    cg = CgroupsV1(HOST_ROOT)
    if os.geteuid() != 0 or not (HOST_ROOT / "freezer" / "cgroup.procs").exists():
        pytest.skip("needs root and the v1 freezer hierarchy")
    name = instance_name()
    group = cg.group("freezer", name)
    group.mkdir(parents=True)
    proc = subprocess.Popen(["sleep", "600"])
    try:
        (group / "cgroup.procs").write_text(str(proc.pid))
        yield Instance(cg, name, proc)
    finally:
        (group / "freezer.state").write_text("THAWED")  # v1: a frozen task takes its SIGKILL only thawed
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), 10, "the v1 group to empty")
        group.rmdir()
