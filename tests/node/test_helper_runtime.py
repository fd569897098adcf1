"""What the helper's runtime verbs refuse before runsc ever runs (their success paths boot real
sandboxes in every e2e test), and how they find and remove what a runsc cut short left behind."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from space.errors import Conflict, InvalidPath, InvalidRequest, NotFound
from space.node.helper.backend import InProcess
from space.node.helper.verbs import HelperContext
from space.node.helper.verbs_runtime import Runsc, runsc_processes
from tests.waiting import await_for, wait_for

SID = "sbx-helper-test"
IID = f"{SID}-abcde"


@pytest.fixture
def priv(tmp_path: Path) -> InProcess:
    (tmp_path / "data" / "runsc").mkdir(parents=True)
    (tmp_path / "pool" / "sandboxes").mkdir(parents=True)
    return InProcess(HelperContext(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache",
                                   pool_root=tmp_path / "pool", runsc="/bin/false"))


@pytest.fixture
def pipes() -> Iterator[dict[str, int]]:
    r, w = os.pipe()
    yield {"stdin": r, "stdout": w, "stderr": w}
    os.close(r)
    os.close(w)


def launch(**over: Any) -> dict[str, Any]:
    return {"kind": "run", "sandbox": SID, "instance": IID, "cpu": 1.0, "memory_mb": 512, **over}


@pytest.mark.parametrize("args", [
    launch(sandbox="../etc"),
    launch(instance="x"),
    launch(kind="exec"),
    launch(cpu=0),
    launch(memory_mb=1),
    launch(net=0),
    launch(rootfs="/"),
    launch(image_sandbox="/etc", image_snapshot="x"),
])
async def test_bad_launch_arguments(priv: InProcess, pipes: dict[str, int], args: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        await priv.call("runtime.launch", args, fds=pipes)


async def test_launch_needs_its_fds_and_only_those(priv: InProcess, pipes: dict[str, int]) -> None:
    with pytest.raises(InvalidRequest):
        await priv.call("runtime.launch", launch())
    with pytest.raises(InvalidRequest):
        await priv.call("runtime.launch", launch(), fds={**pipes, "extra": pipes["stdin"]})


async def test_launch_of_an_instance_of_another_sandbox(priv: InProcess, pipes: dict[str, int]) -> None:
    with pytest.raises(Conflict):
        await priv.call("runtime.launch", launch(instance="other-sandbox-abcde"), fds=pipes)


async def test_launch_refuses_ids_runsc_would_confuse(priv: InProcess, pipes: dict[str, int],
                                                      tmp_path: Path) -> None:
    # runsc matches container ids by unique prefix: a new id must not be a prefix of a known one,
    # nor extend one, nor repeat one.
    (tmp_path / "data" / "runsc" / f"{IID}0_sandbox:{IID}0.state").write_text("{}")
    with pytest.raises(Conflict, match="collides"):
        await priv.call("runtime.launch", launch(), fds=pipes)


async def test_launch_refuses_a_planted_root(priv: InProcess, pipes: dict[str, int], tmp_path: Path) -> None:
    sandboxes = tmp_path / "pool" / "sandboxes"
    (sandboxes / SID).symlink_to("/")  # the sandbox dir is a symlink to the host's root
    with pytest.raises(InvalidPath):
        await priv.call("runtime.launch", launch(), fds=pipes)
    (sandboxes / SID).unlink()
    (sandboxes / SID).mkdir()
    (sandboxes / SID / "rootfs").symlink_to("/")
    with pytest.raises(InvalidPath):
        await priv.call("runtime.launch", launch(), fds=pipes)
    (sandboxes / SID / "rootfs").unlink()
    (sandboxes / SID / "rootfs").mkdir()  # a plain directory is not a subvolume
    with pytest.raises(InvalidPath, match="subvolume"):
        await priv.call("runtime.launch", launch(), fds=pipes)
    assert not (tmp_path / "data" / "bundles").exists()


async def test_instance_verbs_need_the_exact_id(priv: InProcess, tmp_path: Path) -> None:
    (tmp_path / "data" / "runsc" / f"{IID}_sandbox:{IID}.state").write_text("{}")
    prefix = IID[:-1] + "x"  # well-formed, unknown
    with pytest.raises(NotFound):
        await priv.call("runtime.pause", {"instance": prefix})
    with pytest.raises(NotFound):
        await priv.call("runtime.resume", {"instance": prefix})
    assert await priv.call("runtime.delete", {"instance": prefix}) == {"deleted": False}
    assert await priv.call("runtime.state", {"instance": prefix}) == {"status": None}
    await priv.call("runtime.kill", {"instance": prefix})  # idempotent: nothing to kill


async def test_checkpoint_refuses_a_planted_image_dir(priv: InProcess, tmp_path: Path) -> None:
    (tmp_path / "data" / "runsc" / f"{IID}_sandbox:{IID}.state").write_text("{}")
    snap = tmp_path / "pool" / "sandboxes" / SID / "snapshots" / "snap-1"
    snap.mkdir(parents=True)
    (snap / "checkpoint").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InvalidPath):
        await priv.call("runtime.checkpoint", {"instance": IID, "sandbox": SID, "snapshot": "snap-1"})
    with pytest.raises(Conflict):
        await priv.call("runtime.checkpoint", {"instance": IID, "sandbox": "other", "snapshot": "snap-1"})


CGROUPS = Path("/sys/fs/cgroup")


def _fake_runsc(name: str, root: Path, instance: str) -> subprocess.Popen[bytes]:
    """A process that looks like a runsc sentry (or gofer) of ``instance`` under ``root`` in /proc."""
    return subprocess.Popen(["bash", "-c", f'exec -a {name} "$0" "$@"', sys.executable, "-c",
                             "import time; time.sleep(300)", f"--root={root}", instance])


async def test_sweep_kills_the_sentries_runsc_lost_track_of_and_keeps_the_rest(priv: InProcess,
                                                                               tmp_path: Path) -> None:
    root = tmp_path / "data" / "runsc"
    other = f"{SID}-fghij"
    stray, kept = _fake_runsc("runsc-sandbox", root, IID), _fake_runsc("runsc-sandbox", root, other)
    elsewhere = _fake_runsc("runsc-sandbox", tmp_path / "another-node", f"{SID}-klmno")
    try:
        ctx = HelperContext(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
        async def seen() -> bool:
            return {stray.pid, kept.pid} <= set(runsc_processes(Runsc(ctx)))
        await await_for(seen, 30, "the fake sentries in /proc")
        assert elsewhere.pid not in runsc_processes(Runsc(ctx)), "another node's runsc root is not ours"
        assert await priv.call("runtime.sweep", {"keep": [other]}) == {"killed": [IID]}
        assert stray.wait(timeout=30) == -9
        assert kept.poll() is None and elsewhere.poll() is None
    finally:
        for p in (stray, kept, elsewhere):
            p.kill()
            p.wait()


@pytest.fixture
def empty_cgroups() -> Iterator[list[Path]]:
    """Empty cgroups of IID in every controller with a ``space`` hierarchy (removed afterwards)."""
    controllers = [c for c in CGROUPS.iterdir() if (c / "space").is_dir()] if CGROUPS.is_dir() else []
    if not controllers:
        pytest.skip("no cgroup v1 'space' hierarchy here")
    made = [c / "space" / IID for c in controllers]
    try:
        for group in made:
            group.mkdir()
        yield made
    finally:
        for group in made:
            if group.exists():
                group.rmdir()


def _existing(paths: list[Path]) -> list[Path]:
    return [p for p in paths if p.exists()]


async def test_delete_removes_the_empty_cgroups_of_a_start_cut_short(priv: InProcess,
                                                                     empty_cgroups: list[Path]) -> None:
    """runsc makes the instance's cgroups before it starts the sentry; killed in between, it
    leaves them, and runsc itself no longer knows the instance."""
    assert await priv.call("runtime.delete", {"instance": IID}) == {"deleted": False}
    assert _existing(empty_cgroups) == []


@pytest.mark.parametrize("shim_pid", [0, 1, -5, 1 << 22, "7"])
async def test_a_shim_pid_that_is_not_a_pid_is_refused(priv: InProcess, pipes: dict[str, int],
                                                       shim_pid: Any) -> None:
    with pytest.raises(InvalidRequest):
        await priv.call("runtime.launch", launch(shim_pid=shim_pid), fds=pipes)


def test_the_agent_cannot_have_the_helper_move_a_process_that_is_not_its_own_shim(
        priv: InProcess, pipes: dict[str, int]) -> None:
    """A compromised agent names a process to move out of its cgroups: another's child (here the
    shell's own ``sleep``), or its own child that is not a shim. Refused before anything is done:
    the process stays in its cgroups, and no runsc runs."""
    shell = subprocess.Popen(["sh", "-c", "sleep 60; :", "-m", "space.runtime.shim"])
    plain = subprocess.Popen(["sleep", "60"])
    try:
        grandchild = int(wait_for(
            lambda: (Path(f"/proc/{shell.pid}/task/{shell.pid}/children").read_text().split() or [None])[0],
            10, "the shell's sleep"))
        for victim, why in ((grandchild, "not the caller's child"), (plain.pid, "is not a shim")):
            before = Path(f"/proc/{victim}/cgroup").read_text()
            with pytest.raises(Conflict, match=why):
                asyncio.run(priv.call("runtime.launch", launch(shim_pid=victim), fds=pipes))
            assert Path(f"/proc/{victim}/cgroup").read_text() == before
    finally:
        for p in (shell, plain):
            p.kill()
            p.wait(timeout=10)
