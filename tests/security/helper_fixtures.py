"""Fixtures of the root helper's adversarial tests: real btrfs loop pools, a helper context on one,
and a stand-in ``runsc`` that plays the compromised agent winning a race.

The stand-in runs where root ``runsc`` would, with the arguments the helper gives it: before it uses
a path it was handed, it runs the swap the test wrote (the agent replacing a checked directory with
a symlink), then records what that path shows. A helper that hands runsc a descriptor instead of a
name is not fooled by the swap; one that hands it a name is.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.node.storage.pool import Pool
from tests.node.poolkit import PoolFactory, btrfs_unavailable


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def helper_pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolFactory]:
    reason = btrfs_unavailable()
    if reason:
        pytest.skip(reason)
    factory = PoolFactory(tmp_path_factory.mktemp("helper-pools"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def agent_pools() -> Iterator[PoolFactory]:
    """Pools whose parent directories other users may pass through (as the node's data dir is to
    its agent): what an unprivileged process can do there is then up to the pool's own modes."""
    reason = btrfs_unavailable()
    if reason:
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="helper-agent-pools-"))
    os.chmod(base, 0o711)
    factory = PoolFactory(base)
    try:
        yield factory
    finally:
        factory.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def helper_pool(helper_pools: PoolFactory) -> Pool:
    """One real 4 GB (sparse) btrfs loop pool per module."""
    return helper_pools("helper")


FAKE_RUNSC = r"""#!/bin/bash
# A stand-in for root runsc: runs the test's swap, then uses the paths it was given.
set -eu
cmd="" img="" pidf=""
while [ $# -gt 0 ]; do
    case "$1" in
        --image-path) img="$2"; shift ;;
        --pid-file) pidf="$2"; shift ;;
        run|restore|checkpoint) cmd="$1" ;;
    esac
    shift
done
echo "$cmd $img" >> "{log}"
{swap}
case "$cmd" in
    restore) cat "$img/marker" >> "{log}" ;;
    checkpoint) echo memory > "$img/checkpoint.img" ;;
esac
if [ -n "$pidf" ]; then echo 4242 > "$pidf"; fi
exit 0
"""


def fake_runsc(where: Path, swap: str) -> tuple[Path, Path]:
    """A stand-in runsc at ``where`` that runs ``swap`` (shell) before using its paths; (it, its log)."""
    log = where / "runsc.log"
    script = where / "runsc"
    script.write_text(FAKE_RUNSC.replace("{log}", str(log)).replace("{swap}", swap))
    script.chmod(stat.S_IRWXU)
    return script, log


def reset_dir(path: Path) -> None:
    """``path`` gone (a symlink unlinked, never followed), whatever it is."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if child.is_symlink() or not child.is_dir():
                child.unlink()
            else:
                child.rmdir()
        path.rmdir()


def owner(path: Path) -> int:
    return os.lstat(path).st_uid
