"""Every object store test runs on a local directory and on a real S3-protocol server (moto).

The moto server listens on 127.0.0.1 on a port the kernel picks, one per test session; each test
gets a bucket of its own, and the S3 store sits under a prefix so prefix handling is exercised too.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from moto.server import ThreadedMotoServer

from space.objstore import ObjectStore


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials the way production passes them: the standard AWS environment variables."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "space-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "space-test-secret")
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


def make_bucket(endpoint: str) -> str:
    bucket = f"space-{uuid.uuid4().hex[:12]}"
    httpx.put(f"{endpoint}/{bucket}", timeout=10).raise_for_status()
    return bucket


@dataclass
class Backend:
    """An object store under test, plus a way to tamper with what it holds behind its back."""

    kind: str
    store: ObjectStore
    #: Replace the stored bytes of a key without going through ObjectStore's checks.
    tamper: Callable[[str, bytes], Awaitable[None]]


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        root = tmp_path / "objects"
        store = ObjectStore.from_url(str(root))

        async def tamper_file(key: str, data: bytes) -> None:
            (root / key).write_bytes(data)

        return Backend("local", store, tamper_file)
    request.getfixturevalue("s3_credentials")
    endpoint: str = request.getfixturevalue("s3_endpoint")
    bucket = make_bucket(endpoint)
    s3 = ObjectStore.from_url(f"s3://{bucket}/space/test?endpoint={endpoint}&region=us-east-1")

    async def tamper_object(key: str, data: bytes) -> None:
        await s3.put_bytes(key, data)

    return Backend("s3", s3, tamper_object)


@pytest.fixture
def store(backend: Backend) -> ObjectStore:
    return backend.store
