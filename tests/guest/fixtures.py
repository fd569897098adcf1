"""Fixtures for tests that talk to a guest daemon behind the real shim (a host child process):
``guest`` and a ``conn`` to it. Imported by the conftests and test modules that need them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from space.node.sandboxes.guest_client import GuestConnection
from tests.guest.guest_harness import HostGuest, connected


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def guest() -> Iterator[HostGuest]:
    g = HostGuest().start()
    try:
        yield g
    finally:
        g.stop()  # and the commands it started


@pytest.fixture
async def conn(guest: HostGuest) -> AsyncIterator[GuestConnection]:
    async with connected(guest.socket, timeout=15) as c:
        yield c
