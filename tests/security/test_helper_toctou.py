"""Finding 3: no path the node agent can change after the root helper checked it reaches root.

The agent owns the plain directories of the pool (``sandboxes/<id>/``, ``snapshots/<snap>/``), so it
can swap a checked directory for a symlink at any moment. Each test here is that compromised agent
winning the race between the helper's check and root's use: the stand-in runsc (or, for the verb
that runs no tool, the seam between the check and the write) performs the swap first. Root must act
on what was checked, never on where the name points afterwards.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from space.errors import Conflict
from space.node.helper.backend import InProcess
from space.node.helper.verbs import HelperContext
from space.node.network import rootfs as rootfs_net
from space.node.storage.pool import Pool
from tests.security.helper_fixtures import anyio_backend, fake_runsc, helper_pool, helper_pools, owner, reset_dir

__all__ = ["anyio_backend", "helper_pool", "helper_pools"]

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]

AGENT_UID = 65534  # the agent's uid as the helper knows it (nobody: owns nothing here)


@pytest.fixture
async def sandbox(helper_pool: Pool) -> AsyncIterator[str]:
    """A sandbox dir with a real rootfs subvolume (and its /etc) in the pool; removed after."""
    sid = f"sbx-{uuid.uuid4().hex[:8]}"
    await helper_pool.create_subvolume(helper_pool.sandbox_dir(sid) / "rootfs")
    (helper_pool.sandbox_dir(sid) / "rootfs" / "etc").mkdir()
    yield sid
    for d in sorted(helper_pool.sandbox_dir("x").parent.glob(f"{sid}*")):
        await helper_pool.delete_subvolume(d)


def helper(pool: Pool, tmp_path: Path, runsc: Path | None = None) -> InProcess:
    return InProcess(HelperContext(data_dir=pool.data_dir, cache_dir=tmp_path / "cache", pool_root=pool.root,
                                   runsc=str(runsc or "/bin/false"), agent_uid=AGENT_UID))


@pytest.fixture
def pipes() -> Iterator[dict[str, int]]:
    r, w = os.pipe()
    yield {"stdin": r, "stdout": w, "stderr": w}
    os.close(r)
    os.close(w)


async def test_a_restore_image_swapped_for_a_symlink_after_the_check_is_not_what_runsc_restores(
        helper_pool: Pool, sandbox: str, tmp_path: Path, pipes: dict[str, int]) -> None:
    # The snapshot whose memory image the agent asks to restore, and another sandbox's image (a
    # different tenant's memory) that it would rather have root restore.
    image = helper_pool.sandbox_dir(sandbox) / "snapshots" / "snap-1" / "checkpoint"
    image.mkdir(parents=True)
    (image / "marker").write_text("the checked image\n")
    foreign = tmp_path / "another-tenants-image"
    foreign.mkdir()
    (foreign / "marker").write_text("FOREIGN IMAGE\n")
    runsc, log = fake_runsc(tmp_path, f'mv "{image}" "{image}.moved"; ln -s "{foreign}" "{image}"')
    iid = f"{sandbox}-abcde"
    try:
        await helper(helper_pool, tmp_path, runsc).call("runtime.launch", {
            "kind": "restore", "sandbox": sandbox, "instance": iid, "cpu": 1.0, "memory_mb": 256,
            "image_sandbox": sandbox, "image_snapshot": "snap-1"}, fds=pipes)
        seen = log.read_text()
        assert "FOREIGN IMAGE" not in seen, f"root runsc restored the image the swap pointed at:\n{seen}"
        assert "the checked image" in seen, seen
    finally:
        reset_dir(helper_pool.data_dir / "bundles" / iid)


async def test_a_checkpoint_dir_swapped_for_a_symlink_after_the_check_gets_no_root_write_nor_chown(
        helper_pool: Pool, sandbox: str, tmp_path: Path) -> None:
    snaps = helper_pool.sandbox_dir(sandbox) / "snapshots"
    (snaps / "snap-1").mkdir(parents=True)
    # What the agent wants root to write into, and to hand over to it: a root-owned directory
    # elsewhere on the host (another node's snapshot, say) holding a root-only file.
    decoy = tmp_path / "decoy"
    (decoy / "checkpoint").mkdir(parents=True)
    (decoy / "checkpoint" / "secret.img").write_text("root's alone\n")
    os.chmod(decoy / "checkpoint" / "secret.img", 0o600)
    runsc, _ = fake_runsc(tmp_path, f'mv "{snaps}/snap-1" "{snaps}/snap-1.moved"; ln -s "{decoy}" "{snaps}/snap-1"')
    iid = f"{sandbox}-abcde"
    state = helper_pool.data_dir / "runsc" / f"{iid}_sandbox:{iid}.state"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text("{}")
    try:
        await helper(helper_pool, tmp_path, runsc).call(
            "runtime.checkpoint", {"instance": iid, "sandbox": sandbox, "snapshot": "snap-1"})
        assert not (decoy / "checkpoint" / "checkpoint.img").exists(), "root runsc wrote through the swapped path"
        assert owner(decoy / "checkpoint") == 0 and owner(decoy / "checkpoint" / "secret.img") == 0, \
            "the helper gave the agent a directory the swap pointed at"
        moved = snaps / "snap-1.moved" / "checkpoint"
        assert (moved / "checkpoint.img").read_text() == "memory\n"
        assert owner(moved / "checkpoint.img") == AGENT_UID
    finally:
        state.unlink()


async def test_a_sandbox_dir_swapped_after_the_check_does_not_redirect_configure_net(
        helper_pool: Pool, sandbox: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rootfs.configure_net runs no tool: the race is between its check and its writes, which is
    # where the stand-in swap goes (the seam: rootfs_net.configure, whatever it is given).
    (helper_pool.data_dir / "network.json").write_text(json.dumps({"slot": "10.208.16.0/20"}))
    elsewhere = tmp_path / "another-node-sandbox"
    (elsewhere / "rootfs" / "etc").mkdir(parents=True)
    (elsewhere / "rootfs" / "etc" / "resolv.conf").write_text("nameserver 192.0.2.53\n")
    real = rootfs_net.configure
    sdir = helper_pool.sandbox_dir(sandbox)

    def swapped_then(*args: Any, **kwargs: Any) -> Any:
        os.rename(sdir, sdir.with_name(sdir.name + ".moved"))
        os.symlink(elsewhere, sdir)
        return real(*args, **kwargs)

    patch: Callable[..., Any] = swapped_then
    monkeypatch.setattr(rootfs_net, "configure", patch)
    try:
        await helper(helper_pool, tmp_path).call("rootfs.configure_net", {"sandbox": sandbox, "ca_pem": None})
        assert (elsewhere / "rootfs" / "etc" / "resolv.conf").read_text() == "nameserver 192.0.2.53\n", \
            "root wrote where the swapped sandbox dir pointed"
        moved = sdir.with_name(sdir.name + ".moved") / "rootfs" / "etc" / "resolv.conf"
        assert moved.read_text().startswith("nameserver 10.208.16.1\n")
    finally:
        if sdir.is_symlink():
            sdir.unlink()
        (helper_pool.data_dir / "network.json").unlink()


async def test_a_checkpoint_into_a_directory_the_agent_owns_is_refused(
        helper_pool: Pool, sandbox: str, tmp_path: Path) -> None:
    # A snapshot's image directory the helper once handed to the agent (as it does after every
    # checkpoint), now holding the agent's symlink where root runsc writes the image.
    image = helper_pool.sandbox_dir(sandbox) / "snapshots" / "snap-2" / "checkpoint"
    image.mkdir(parents=True)
    victim = tmp_path / "root-owned-file"
    victim.write_text("root's own content\n")
    os.symlink(victim, image / "checkpoint.img")
    os.chown(image, AGENT_UID, -1)
    runsc, _ = fake_runsc(tmp_path, ":")
    iid = f"{sandbox}-fghij"
    state = helper_pool.data_dir / "runsc" / f"{iid}_sandbox:{iid}.state"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text("{}")
    try:
        with pytest.raises(Conflict):
            await helper(helper_pool, tmp_path, runsc).call(
                "runtime.checkpoint", {"instance": iid, "sandbox": sandbox, "snapshot": "snap-2"})
        assert victim.read_text() == "root's own content\n", "root runsc wrote through the agent's symlink"
    finally:
        state.unlink()
