"""Fixtures for the SDK seam tests: the fake API and both clients wired to it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from space import AsyncClient, Client
from tests.sdk.fake_api import API_KEY, URL, FakeAPI


@pytest.fixture
def fake() -> FakeAPI:
    return FakeAPI()


@pytest.fixture
def client(fake: FakeAPI) -> Iterator[Client]:
    with Client(URL, API_KEY, transport=fake.transport) as c:
        yield c


@pytest.fixture
async def aclient(fake: FakeAPI) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(URL, API_KEY, transport=fake.transport) as c:
        yield c


@pytest.fixture
def fake_transport(fake: FakeAPI) -> httpx.BaseTransport:
    return fake.transport
