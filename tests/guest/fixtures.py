"""Fixtures for tests that talk to a guest daemon behind the real shim (a host child process):
``guest`` and a ``conn`` to it. Imported by the conftests and test modules that need them."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest

from space.node.sandboxes.guest_client import GuestConnection
from tests.guest.guest_harness import HostGuest, connected


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@functools.cache
def _login_shell_hangs() -> bool:
    """Commands given as ``shell`` run as ``bash -l`` as this machine's root, through root's login
    profile: a profile that hangs makes those tests time out for a reason that is not theirs."""
    try:
        subprocess.run(["/bin/bash", "-lc", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return True
    return False


@pytest.fixture
def guest() -> Iterator[HostGuest]:
    if _login_shell_hangs():
        pytest.fail("`bash -lc true` as root did not finish in 20 s: this machine's login profile hangs "
                    "(e.g. a stale /root/.pyenv/shims/.pyenv-shim lock from an interrupted `pyenv rehash`)")
    g = HostGuest().start()
    try:
        yield g
    finally:
        g.stop()  # and the commands it started


@pytest.fixture
async def conn(guest: HostGuest) -> AsyncIterator[GuestConnection]:
    async with connected(guest.socket, timeout=15) as c:
        yield c
