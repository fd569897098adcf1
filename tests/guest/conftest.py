"""Fixtures: a guest daemon behind the real shim, and a GuestConnection to it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from space.node.guest_client import GuestConnection
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
        g.stop()


@pytest.fixture
async def conn(guest: HostGuest) -> AsyncIterator[GuestConnection]:
    async with connected(guest.socket, timeout=15) as c:
        yield c
