"""Fixtures: a guest daemon behind the real shim, and a GuestConnection to it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from space.node.guest_client import GuestConnection
from tests.guest.guest_harness import HostGuest


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
    c = await GuestConnection.connect(guest.socket, timeout=15)
    try:
        yield c
    finally:
        await c.close()
