"""The shim as the last line of fencing (space.runtime.shim.LeaseWatch), on a real freezer cgroup
holding a real process -- cgroup v1's ``freezer.state`` (the host's hierarchy) and v2's
``cgroup.freeze`` (a cgroup2 filesystem mounted for the test: tests/node/cgroupkit.py) -- and a
real shim process:

- once the published lease end is GRACE past, the instance is frozen and a mark names the end;
  a lease still running, or no lease at all, freezes nothing
- once per lease end: thawed by the agent (the control plane said the node still owns it), it is
  not frozen again for the same lapse, but is for the next one
- the lease file is hostile input to the shim: a symlink, a FIFO (which must not block it), a
  directory, garbage, an oversized file, inf or nan are no lease at all
- the shim writes only a freezing value, only into a freezer file that exists, never through a
  symlink
- a shim started with the lease flags freezes its instance on its own while nothing else runs,
  and the driver hands it those flags (the freezer file and what freezes it, per cgroup version)
  only when the node has a lease; its arguments go together
- a fenced (frozen) instance dies of the kill a node's teardown sends it, on both versions
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.runtime import shim
from space.runtime.cgroups import CgroupsV1, CgroupsV2
from space.runtime.shim import GRACE, LeaseWatch, read_lease_end
from tests.node.cgroupkit import Instance, v1_instance, v2_instance
from tests.waiting import wait_for


@pytest.fixture(params=["v1", "v2"])
def inst(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Instance]:
    """An instance's cgroup of its own (v1: the host's freezer hierarchy; v2: a cgroup2 mount)
    holding a sleeping process; thawed, emptied and removed after."""
    with v1_instance() if request.param == "v1" else v2_instance(tmp_path) as instance:
        yield instance


def watch_of(inst: Instance, lease: Path, mark: Path) -> LeaseWatch:
    cg = inst.cgroups
    return LeaseWatch(str(lease), str(cg.freeze_file(inst.name)), str(mark), freeze_value=cg.freeze_value(True))


def publish(path: Path, end: float) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{end!r}\n")
    os.replace(tmp, path)


def test_past_the_lease_and_its_grace_the_instance_is_frozen_once_per_lease_end(inst: Instance,
                                                                              tmp_path: Path) -> None:
    cg, name = inst.cgroups, inst.name
    lease, mark = tmp_path / "lease-end", tmp_path / "fenced"
    watch = watch_of(inst, lease, mark)
    assert not watch.check() and not cg.is_frozen(name)  # no lease: nothing to lose
    publish(lease, shim.boottime() + 30)
    assert not watch.check() and not cg.is_frozen(name)  # the lease still runs
    publish(lease, shim.boottime() - GRACE / 2)
    assert not watch.check() and not cg.is_frozen(name)  # over, but the agent's turn first
    lapsed = shim.boottime() - GRACE - 1
    publish(lease, lapsed)
    assert watch.check()
    wait_for(lambda: cg.fully_frozen(name), 10, "the freezer to settle")
    assert float(mark.read_text()) == lapsed
    # The agent thaws it (told the node still owns the sandbox): not frozen again for this lapse.
    cg.thaw(name)
    wait_for(lambda: not cg.fully_frozen(name), 10, "the thaw")
    assert not watch.check() and not cg.is_frozen(name)
    # The next lapse is another matter.
    publish(lease, lapsed + 10 - 20)
    assert watch.check()
    wait_for(lambda: cg.fully_frozen(name), 10, "the freezer to settle again")


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "garbage", "oversized", "inf", "nan", "empty"])
def test_a_lease_file_that_is_not_a_plain_number_is_no_lease(tmp_path: Path, kind: str) -> None:
    path, target = tmp_path / "lease-end", tmp_path / "elsewhere"
    target.write_text("1.0\n")
    if kind == "symlink":
        path.symlink_to(target)  # the agent's directory: a symlink planted there is not followed
    elif kind == "fifo":
        os.mkfifo(path)  # opening must not wait for a writer
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_text({"garbage": "soon\n", "oversized": "1" * 100, "inf": "inf", "nan": "nan", "empty": ""}[kind])
    t0 = time.monotonic()
    assert read_lease_end(str(path)) is None
    assert time.monotonic() - t0 < 1
    path_ok = tmp_path / "ok"
    path_ok.write_text("12.5\n")
    assert read_lease_end(str(path_ok)) == 12.5


def test_the_watch_writes_a_freezing_value_into_an_existing_freezer_file_only(tmp_path: Path) -> None:
    """A freezer file that is not there (the instance is gone) is not created, a symlink there is
    not followed, and nothing but a value that freezes (v1's or v2's) is ever written."""
    lease, mark = tmp_path / "lease-end", tmp_path / "fenced"
    publish(lease, shim.boottime() - GRACE - 1)
    gone = tmp_path / "gone" / "cgroup.freeze"
    gone.parent.mkdir()
    assert not LeaseWatch(str(lease), str(gone), str(mark), freeze_value="1").check()
    assert not gone.exists() and not mark.exists()
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "link").symlink_to(target)
    assert not LeaseWatch(str(lease), str(tmp_path / "link"), str(mark), freeze_value="1").check()
    assert target.read_text() == "" and not mark.exists()
    with pytest.raises(ValueError, match="not a freezing value"):
        LeaseWatch(str(lease), str(gone), str(mark), freeze_value="THAWED")
    plain = tmp_path / "freezer.state"  # what a v1 freezer file takes by default
    plain.write_text("")
    assert LeaseWatch(str(lease), str(plain), str(mark)).check()
    assert plain.read_text() == "FROZEN" and mark.exists()


def test_a_shim_freezes_its_instance_on_its_own_when_the_lease_lapses(inst: Instance, tmp_path: Path) -> None:
    cg, name = inst.cgroups, inst.name
    lease, mark = tmp_path / "lease-end", tmp_path / "fenced"
    publish(lease, shim.boottime() + 1.0)  # runs out in a second; nobody renews it
    to_guest_r, to_guest_w = os.pipe()
    from_guest_r, from_guest_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "space.runtime.shim", "--socket", str(tmp_path / "s.sock"),
         "--to-guest-fd", str(to_guest_w), "--from-guest-fd", str(from_guest_r),
         "--lease-file", str(lease), "--freeze-file", str(cg.freeze_file(name)),
         "--freeze-value", cg.freeze_value(True), "--fence-mark", str(mark)],
        pass_fds=(to_guest_w, from_guest_r), stderr=subprocess.PIPE)
    os.close(to_guest_w)
    os.close(from_guest_r)
    try:
        wait_for(lambda: mark.exists(), 1.0 + GRACE + 10, "the shim to fence its instance")
        assert cg.is_frozen(name)
        wait_for(lambda: cg.fully_frozen(name), 10, "the freezer to settle")
    finally:
        os.close(from_guest_w)  # the guest's stdout ends: the shim exits
        assert proc.wait(timeout=10) == 0
        os.close(to_guest_r)
    assert proc.stderr is not None and b"instance frozen" in proc.stderr.read()


def test_the_lease_arguments_go_together(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "space.runtime.shim", "--socket", str(tmp_path / "s"),
            "--to-guest-fd", "0", "--from-guest-fd", "1", "--lease-file", str(tmp_path / "l")]
    out = subprocess.run(base, capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 2 and "go together" in out.stderr
    out = subprocess.run([*base, "--freeze-file", str(tmp_path / "f"), "--fence-mark", str(tmp_path / "m"),
                          "--freeze-value", "THAWED"], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 2 and "--freeze-value" in out.stderr


def test_the_driver_gives_shims_the_lease_only_when_the_node_has_one(tmp_path: Path) -> None:
    from space.runtime.base import InstanceSpec
    from space.runtime.gvisor import FENCE_MARK, GVisorDriver

    spec = InstanceSpec(sandbox_id="s1", instance_id="i1", rootfs=tmp_path, workdir=tmp_path / "w",
                        guest_dir=tmp_path, channel_dir=tmp_path, cpu=1, memory_mb=256, hostname="h")
    v1, v2 = CgroupsV1(Path("/sys/fs/cgroup")), CgroupsV2(Path("/sys/fs/cgroup"))
    assert GVisorDriver(None, tmp_path, cgroups=v1)._fence_args(spec) == []  # type: ignore[arg-type]
    lease = tmp_path / "lease-end"
    args = GVisorDriver(None, tmp_path, lease_file=lease, cgroups=v1)._fence_args(spec)  # type: ignore[arg-type]
    assert args == ["--lease-file", str(lease),
                    "--freeze-file", "/sys/fs/cgroup/freezer/space/i1/freezer.state", "--freeze-value", "FROZEN",
                    "--fence-mark", str(tmp_path / "w" / FENCE_MARK)]
    args = GVisorDriver(None, tmp_path, lease_file=lease, cgroups=v2)._fence_args(spec)  # type: ignore[arg-type]
    assert args == ["--lease-file", str(lease),
                    "--freeze-file", "/sys/fs/cgroup/space/i1/cgroup.freeze", "--freeze-value", "1",
                    "--fence-mark", str(tmp_path / "w" / FENCE_MARK)]
    driver = GVisorDriver(None, tmp_path, cgroups=v1)  # type: ignore[arg-type]
    (tmp_path / "w").mkdir()
    assert not driver.take_fence_mark(tmp_path / "w")
    (tmp_path / "w" / FENCE_MARK).write_text("1.0\n")
    assert driver.take_fence_mark(tmp_path / "w") and not driver.take_fence_mark(tmp_path / "w")


def test_a_kill_or_stop_ends_the_shim_first_and_waits_for_it(tmp_path: Path) -> None:
    """A shim must not fence (freeze) its instance while runsc kills it: it is gone before."""
    import asyncio

    from space.runtime.gvisor import SHIM_PIDFILE, _running, _stop_shim

    to_guest_r, to_guest_w = os.pipe()
    from_guest_r, from_guest_w = os.pipe()
    pidfile = tmp_path / SHIM_PIDFILE
    proc = subprocess.Popen(
        [sys.executable, "-m", "space.runtime.shim", "--socket", str(tmp_path / "s.sock"),
         "--to-guest-fd", str(to_guest_w), "--from-guest-fd", str(from_guest_r), "--pidfile", str(pidfile)],
        pass_fds=(to_guest_w, from_guest_r))
    for fd in (to_guest_w, from_guest_r):
        os.close(fd)
    try:
        wait_for(pidfile.exists, 10, "the shim's pidfile")
        assert _running(proc.pid)
        asyncio.run(_stop_shim(tmp_path))
        assert not _running(proc.pid)  # exited (a zombie until reaped) when the call returned
        assert proc.wait(timeout=1) == 0
        asyncio.run(_stop_shim(tmp_path))  # gone: nothing to do, no error
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for fd in (to_guest_r, from_guest_w):
            os.close(fd)


def test_a_fenced_instance_dies_of_its_kill(inst: Instance) -> None:
    """A node's teardown (or a stray's removal) SIGKILLs an instance its shim froze: on v1 the kill
    lands only once the freezer thaws it, so the kill thaws it too (v2 lets a fatal signal through
    a freeze; the thaw is one more write there). (Leaked frozen sandboxes outlived a teardown
    before.)"""
    from space.node.helper import verbs_runtime

    cg, name = inst.cgroups, inst.name
    cg.freeze(name)
    wait_for(lambda: cg.fully_frozen(name), 10, "the freezer to settle")
    verbs_runtime.kill_thawed(cg, {inst.proc.pid: name})
    assert inst.proc.wait(timeout=10) == -9
    assert not cg.is_frozen(name)
