"""The control plane's node client over real mutual TLS (a uvicorn server with a node certificate
on loopback): it reaches the node it names, and is refused in the handshake by a node that is
another one, even at the very address the row names (a join token holder that advertised another
node's address under a new id gets nothing from it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from space.cluster import pki
from space.cluster.identity import ControlPlaneTLS
from space.errors import Unavailable
from space.node.api.client import NodeClient
from space.node.membership import NodeTLSFiles
from tests.e2e.harness import free_port
from tests.waiting import until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def node_a(tmp_path: Path) -> AsyncIterator[tuple[pki.ClusterCA, str]]:
    """A server holding node-a's certificate (issued for 127.0.0.1), requiring client certificates."""
    import asyncio

    ca = pki.ClusterCA.create()
    files = NodeTLSFiles.under(tmp_path)
    files.key.parent.mkdir(parents=True)
    key = pki.new_key()
    pki.write_private(files.key, key)
    pki.write_private(files.cert, ca.sign_node(pki.csr_for_key(key, "node-a"), node_id="node-a", hosts=["127.0.0.1"]))
    pki.write_private(files.ca, ca.cert_pem)
    app = FastAPI()

    @app.get("/v1/node")
    async def info() -> dict[str, str]:
        return {"id": "node-a"}

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, ssl_certfile=str(files.cert), ssl_keyfile=str(files.key),
                            log_level="warning", lifespan="off")
    config.load()
    config.ssl = files.server_context()
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started, 10, "the node server to listen")
        yield ca, f"https://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_the_client_reaches_the_node_it_names(node_a: tuple[pki.ClusterCA, str]) -> None:
    ca, url = node_a
    client = NodeClient("node-a", url, "", tls=ControlPlaneTLS(ca, "test").context())
    try:
        assert await client.call("GET", "/v1/node") == {"id": "node-a"}
    finally:
        await client.aclose()


async def test_a_node_at_the_address_another_row_names_is_refused(node_a: tuple[pki.ClusterCA, str]) -> None:
    ca, url = node_a
    client = NodeClient("node-x", url, "", tls=ControlPlaneTLS(ca, "test").context())
    try:
        with pytest.raises(Unavailable, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
            await client.call("GET", "/v1/node")
        with pytest.raises(Unavailable):
            await client.open_stream("GET", "/v1/node")
    finally:
        await client.aclose()


def test_identity_names_are_dns_labels_and_distinct() -> None:
    names = {pki.identity_name(n) for n in ("node-a", "Node_A", "node.a", "a" * 50)}
    assert len(names) == 4
    assert all(len(n.split(".")[0]) <= 63 and n.endswith(pki.IDENTITY_SUFFIX) for n in names)
