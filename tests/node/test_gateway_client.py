"""The node agent's client of the gateway's control socket, against a control server on a real unix
socket that speaks the gateway's protocol (newline-delimited JSON, one answer per request on its
connection, connections served concurrently) and holds answers back as each test needs.

Aspects:
- calls about different sandbox addresses are in flight at once (a burst of claims does not queue
  on one connection), on no more connections than the client's bound
- calls about one address reach the gateway one at a time in the order they were made (a delete
  never overtakes the put before it)
- a gateway restarted behind idle connections is reached again on the next call; after ``close``
  no earlier connection is used
- a call cancelled while waiting for its answer leaves nothing behind that the next call would read
  as its own; an answer that is not JSON is a clear error
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from space.errors import Unavailable
from space.node.network.gateway_client import GatewayClient
from tests.waiting import until

pytestmark = pytest.mark.anyio


class ControlServer:
    """The gateway's control protocol; ``hold`` decides when each request is answered."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[dict[str, Any]] = []
        self.outstanding: dict[str, int] = {}
        self.most_outstanding = 0
        self.same_address_overlap = False
        self.connections = 0
        self.hold: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        self.answer: Callable[[dict[str, Any]], bytes] = lambda req: json.dumps(
            {"ok": True, "n": req.get("n")}).encode() + b"\n"
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, str(self.path))

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        await self._server.wait_closed()
        self.path.unlink(missing_ok=True)

    def total_outstanding(self) -> int:
        return sum(self.outstanding.values())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while line := await reader.readline():
                req = json.loads(line)
                self.seen.append(req)
                key = str(req.get("ip"))
                if req.get("ip") is not None and self.outstanding.get(key):
                    self.same_address_overlap = True
                self.outstanding[key] = self.outstanding.get(key, 0) + 1
                self.most_outstanding = max(self.most_outstanding, self.total_outstanding())
                if self.hold is not None:
                    await self.hold(req)
                self.outstanding[key] -= 1
                writer.write(self.answer(req))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[ControlServer]:
    srv = ControlServer(tmp_path / "control.sock")
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def test_calls_about_different_addresses_are_in_flight_at_once(server: ControlServer) -> None:
    everyone_in = asyncio.Event()

    async def hold(req: dict[str, Any]) -> None:
        if server.total_outstanding() >= 5:
            everyone_in.set()
        await everyone_in.wait()  # no answer until five requests wait together

    server.hold = hold
    client = GatewayClient(server.path, timeout=5)
    try:
        replies = await asyncio.gather(*(client.call("put", ip=f"10.0.0.{i}", n=i) for i in range(5)))
    finally:
        await client.close()
    assert [r["n"] for r in replies] == list(range(5))
    assert server.most_outstanding == 5


async def test_no_more_connections_than_the_bound(server: ControlServer) -> None:
    both_in = asyncio.Event()

    async def hold(req: dict[str, Any]) -> None:
        if server.total_outstanding() >= 2:
            both_in.set()
        await both_in.wait()  # the first two wait for each other: all seven calls are under way meanwhile

    server.hold = hold
    client = GatewayClient(server.path, timeout=5, connections=2)
    try:
        replies = await asyncio.gather(*(client.call("put", ip=f"10.0.0.{i}", n=i) for i in range(7)))
        assert [r["n"] for r in replies] == list(range(7))
        assert server.most_outstanding == 2 and server.connections == 2
        await client.call("stats")  # an idle connection is used again, no new one
        assert server.connections == 2
    finally:
        await client.close()


async def test_calls_about_one_address_arrive_one_at_a_time_in_order(server: ControlServer) -> None:
    other_address_in = asyncio.Event()

    async def hold(req: dict[str, Any]) -> None:
        if req["n"] == 9:
            other_address_in.set()
        if req["n"] == 0:
            # The first put is answered only once a call about another address has arrived: that
            # one was not queued behind it, and nothing about its own address may pass it meanwhile.
            await other_address_in.wait()

    server.hold = hold
    client = GatewayClient(server.path, timeout=5)
    try:
        calls = [asyncio.create_task(client.call(op, ip="10.0.0.7", n=n))
                 for n, op in enumerate(("put", "delete", "put", "reset"))]
        calls.append(asyncio.create_task(client.call("put", ip="10.0.0.8", n=9)))  # another address passes
        replies = await asyncio.gather(*calls)
    finally:
        await client.close()
    assert [r["n"] for r in replies] == [0, 1, 2, 3, 9]
    same = [(r["op"], r["n"]) for r in server.seen if r["ip"] == "10.0.0.7"]
    assert same == [("put", 0), ("delete", 1), ("put", 2), ("reset", 3)]
    assert not server.same_address_overlap
    assert server.seen[1] == {"op": "put", "ip": "10.0.0.8", "n": 9}  # not behind the slow put
    assert client._order == {}  # nothing kept per address once its calls are done


async def test_a_restarted_gateway_is_reached_again(server: ControlServer) -> None:
    client = GatewayClient(server.path, timeout=5)
    try:
        await asyncio.gather(*(client.call("put", ip=f"10.0.0.{i}", n=i) for i in range(3)))
        await server.stop()  # every idle connection of the client is now dead
        await server.start()
        assert (await client.call("put", ip="10.0.0.1", n=5))["n"] == 5
        before = server.connections
        await client.close()
        assert (await client.call("stats", n=6))["n"] == 6
        assert server.connections == before + 1  # close() left nothing to reuse
    finally:
        await client.close()


async def test_a_cancelled_call_leaves_no_answer_for_the_next(server: ControlServer) -> None:
    release = asyncio.Event()

    async def hold(req: dict[str, Any]) -> None:
        if req["n"] == 1:
            await release.wait()

    server.hold = hold
    client = GatewayClient(server.path, timeout=5, connections=1)
    try:
        first = asyncio.create_task(client.call("put", ip="10.0.0.1", n=1))
        await until(lambda: len(server.seen) == 1, 5, "the first request reached the gateway")
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        release.set()  # its answer now comes, on a connection nobody may read again
        assert (await client.call("put", ip="10.0.0.2", n=2))["n"] == 2
    finally:
        await client.close()


async def test_a_refusal_and_an_answer_that_is_not_json_are_clear_errors(server: ControlServer) -> None:
    client = GatewayClient(server.path, timeout=5)
    try:
        server.answer = lambda req: json.dumps(
            {"ok": False, "error": {"code": "invalid_request", "message": "bad ip"}}).encode() + b"\n"
        with pytest.raises(Unavailable, match=r"refused put.*bad ip"):
            await client.call("put", ip="x")
        server.answer = lambda req: b"not json\n"
        with pytest.raises(Unavailable, match="unreachable"):
            await client.call("put", ip="10.0.0.1")
        server.answer = lambda req: json.dumps({"ok": True, "n": req.get("n")}).encode() + b"\n"
        assert (await client.call("put", ip="10.0.0.1", n=3))["n"] == 3
    finally:
        await client.close()
