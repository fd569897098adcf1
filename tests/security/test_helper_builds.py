"""Finding 3: the root helper does not do what a compromised agent asks with template builds.

The node agent (uid ``space-node``) calls the helper's ``template.*`` verbs. Compromised, it would
build on a tree of its own making (a sandbox's root, a tree with symlinks aimed at the host), swap
the tree between a check and a use, or point debootstrap anywhere. Here the test is that agent,
calling the verbs as it would (the in-process backend runs exactly what the helper's RPC runs):

- ``tmp/`` is root's: the agent's uid cannot make or rename anything there;
- a build verb on a tree ``template.begin`` did not make, or made and then replaced, is refused;
- debootstrap only fills the empty tree begun for it, from a mirror the operator allowed;
- what a build step runs, runs in gVisor: not the host's kernel, not its processes.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space.errors import Conflict, InvalidPath, InvalidRequest
from space.node.helper.backend import InProcess
from space.node.helper.verbs import HelperContext
from space.node.storage.ownership import give_node_state
from space.node.storage.pool import Pool
from space.node.templates.store import BASE_SPEC, DEFAULT_CACHE_DIR, TemplateInfo, TemplateStore
from tests.node.poolkit import PoolFactory, run_async
from tests.security.helper_fixtures import agent_pools, anyio_backend, helper_pool, helper_pools

__all__ = ["agent_pools", "anyio_backend", "helper_pool", "helper_pools"]

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]


def agent_ids() -> tuple[int, int]:
    try:
        pw = pwd.getpwnam("space-node")
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        return 65534, 65534


@pytest.fixture(scope="module")
def base(helper_pool: Pool) -> TemplateInfo:
    return run_async(TemplateStore(helper_pool, DEFAULT_CACHE_DIR).ensure(BASE_SPEC))


@pytest.fixture
def priv(helper_pool: Pool) -> InProcess:
    return InProcess(HelperContext(data_dir=helper_pool.data_dir, cache_dir=DEFAULT_CACHE_DIR,
                                   pool_root=helper_pool.root))


def work_name() -> str:
    return f"build-t{uuid.uuid4().hex[:8]}@{uuid.uuid4().hex[:16]}"


@pytest.fixture
async def work(helper_pool: Pool) -> AsyncIterator[Path]:
    path = helper_pool.tmp_dir / work_name()
    yield path
    await helper_pool.delete_subvolume(path)


def as_agent(*argv: str) -> subprocess.CompletedProcess[str]:
    uid, gid = agent_ids()
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=60)


def test_the_agent_can_make_nothing_in_the_helpers_area(agent_pools: PoolFactory) -> None:
    pool = agent_pools("owned")
    uid, gid = agent_ids()
    (pool.root / "tmp" / "left-by-a-crash").mkdir(exist_ok=True)
    give_node_state(pool.data_dir, pool.root, pool.data_dir / "cache", uid, gid)

    st = (pool.root / "tmp").stat()
    assert st.st_uid == 0 and st.st_mode & 0o022 == 0, f"tmp/ is {st.st_uid}:{oct(st.st_mode)}"
    made = as_agent("mkdir", str(pool.root / "tmp" / work_name()))
    assert made.returncode != 0, "the agent made a directory in tmp/"
    assert list((pool.root / "tmp").iterdir()) == [], "what a crash left in tmp/ is gone at start"
    assert as_agent("mkdir", str(pool.root / "sandboxes" / "s1")).returncode == 0  # its own area


async def test_a_step_on_a_tree_the_helper_did_not_begin_is_refused_and_runs_nothing(
        priv: InProcess, helper_pool: Pool, base: TemplateInfo, work: Path) -> None:
    # The agent's own "build": a snapshot of a root (it could be any sandbox's) at a build's name.
    await priv.call("subvol.snapshot", {"src": f"templates/{base.path.name}", "dst": f"tmp/{work.name}"})

    with pytest.raises(InvalidPath, match="not a build this helper began"):
        await priv.call("template.step", {"work": f"tmp/{work.name}", "kind": "run",
                                          "args": ["touch /etc/ran-as-host-root"]})
    assert not (work / "etc" / "ran-as-host-root").exists()
    for verb, args in (("template.script", {"script": "clean"}),
                       ("template.debootstrap", {"suite": "bookworm", "mirror": "http://deb.debian.org/debian"})):
        with pytest.raises(InvalidPath, match="not a build this helper began"):
            await priv.call(verb, {"work": f"tmp/{work.name}", **args})


async def test_a_begun_tree_replaced_under_its_name_is_refused(
        priv: InProcess, helper_pool: Pool, base: TemplateInfo, work: Path) -> None:
    rel = f"tmp/{work.name}"
    await priv.call("template.begin", {"work": rel, "base": f"templates/{base.path.name}"})
    await priv.call("tree.delete", {"rel": rel})
    await priv.call("subvol.snapshot", {"src": f"templates/{base.path.name}", "dst": rel})  # same name

    with pytest.raises(InvalidPath, match="not a build this helper began"):
        await priv.call("template.step", {"work": rel, "kind": "run", "args": ["true"]})


async def test_debootstrap_fills_only_the_empty_tree_begun_for_it_from_an_allowed_mirror(
        priv: InProcess, helper_pool: Pool, base: TemplateInfo, work: Path) -> None:
    rel = f"tmp/{work.name}"
    await priv.call("template.begin", {"work": rel, "base": f"templates/{base.path.name}"})
    # Over a root (which may hold symlinks aimed at the host): never.
    with pytest.raises(Conflict):
        await priv.call("template.debootstrap", {"work": rel, "suite": "bookworm",
                                                 "mirror": "http://deb.debian.org/debian"})
    # From a mirror the operator did not allow (here a closed port of this machine): refused before
    # anything runs.
    await priv.call("tree.delete", {"rel": rel})
    await priv.call("template.begin", {"work": rel})
    with pytest.raises(InvalidRequest, match="mirror"):
        await priv.call("template.debootstrap", {"work": rel, "suite": "bookworm",
                                                 "mirror": "http://127.0.0.1:9/debian"})
    assert os.listdir(work) == []


async def test_a_build_step_runs_in_gvisor_not_on_the_host(
        priv: InProcess, helper_pool: Pool, base: TemplateInfo, work: Path) -> None:
    rel = f"tmp/{work.name}"
    await priv.call("template.begin", {"work": rel, "base": f"templates/{base.path.name}"})
    lines: list[str] = []

    async def line(text: str) -> None:
        lines.append(text)

    probe = ("echo kernel=$(uname -r); echo pids=$(ls /proc | grep -c '^[0-9]'); "
             "echo init=$(cat /proc/1/comm); echo host-root=$(ls /proc/1/root/ | head -3 | tr '\\n' ,)")
    res = await priv.call("template.step", {"work": rel, "kind": "run", "args": [probe]}, on_line=line)

    assert res == {"returncode": 0}, lines
    seen = dict(entry.split("=", 1) for entry in lines if "=" in entry)
    assert seen["kernel"] != os.uname().release, f"the step ran on the host's kernel: {lines}"
    assert int(seen["pids"]) < 10, f"the step saw the host's processes: {lines}"
    assert seen["init"] != "systemd" and seen["init"] != "init", lines


async def test_write_file_stays_in_the_tree_and_copies_only_a_regular_file(
        priv: InProcess, helper_pool: Pool, base: TemplateInfo, work: Path, tmp_path: Path) -> None:
    rel = f"tmp/{work.name}"
    await priv.call("template.begin", {"work": rel, "base": f"templates/{base.path.name}"})
    # The tree's author aimed a directory at a host path (absolute, as a symlink in a root is).
    outside = tmp_path / "host-dir"
    outside.mkdir()
    os.symlink(str(outside), work / "opt" / "to-host")
    blob = tmp_path / "blob"
    blob.write_bytes(b"payload\n")
    fd = os.open(blob, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # The symlink resolves inside the tree, where that directory does not exist.
        with pytest.raises(InvalidPath):
            await priv.call("template.write_file", {"work": rel, "dest": "/opt/to-host/x", "mode": "0644"},
                            fds={"stdin": fd})
    finally:
        os.close(fd)
    assert os.listdir(outside) == [], "root wrote through the tree's symlink onto the host"
    r, w = os.pipe()
    try:
        with pytest.raises(InvalidRequest, match="regular file"):
            await priv.call("template.write_file", {"work": rel, "dest": "/opt/y", "mode": "0644"},
                            fds={"stdin": r})
    finally:
        os.close(r)
        os.close(w)
