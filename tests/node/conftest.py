"""Fixtures for node tests: real btrfs pools on small sparse loop files (see poolkit), always torn
down, with a check that no loop device stays attached."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from space.node.storage.pool import Pool
from tests.node.poolkit import PoolFactory, btrfs_unavailable


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def require_btrfs() -> None:
    """Skips the test when real btrfs pools cannot be made here (not root, no btrfs-progs)."""
    reason = btrfs_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def module_pools(require_btrfs: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolFactory]:
    """Pools that live for the whole test module."""
    factory = PoolFactory(tmp_path_factory.mktemp("pools"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def btrfs_pool(module_pools: PoolFactory) -> Pool:
    """One fresh 4 GB (sparse) btrfs loop pool per test module."""
    return module_pools("shared")


@pytest.fixture
def pool_factory(require_btrfs: None, tmp_path: Path) -> Iterator[PoolFactory]:
    """Pools private to one test (for open/teardown behaviour and second nodes)."""
    factory = PoolFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()
