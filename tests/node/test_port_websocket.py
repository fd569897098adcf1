"""The port proxy's WebSocket client (:class:`ClientSocket`) against a hostile or odd server on
loopback, speaking raw bytes: what it sends, what it accepts, what it refuses and how it ends."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from space.node.network.port_websocket import MAX_MESSAGE, ClientSocket, Closed, HandshakeFailed, Refused, sendable

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]


def switching(head: bytes, extra: bytes = b"") -> bytes:
    key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
               if line.lower().startswith(b"sec-websocket-key:"))
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    return (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            b"sec-websocket-accept: " + accept + b"\r\n" + extra + b"\r\n")


def frame(op: int, data: bytes, fin: bool = True) -> bytes:
    n = len(data)
    length = bytes([n]) if n < 126 else bytes([126]) + struct.pack("!H", n)
    return bytes([(0x80 if fin else 0) | op]) + length + data


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    b0, b1 = await reader.readexactly(2)
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack("!H", await reader.readexactly(2))[0]
    mask = await reader.readexactly(4)
    data = await reader.readexactly(n)
    return b0 & 0x0F, bytes(c ^ mask[i % 4] for i, c in enumerate(data))


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[ClientSocket]]]:
    servers: list[asyncio.Server] = []
    sockets: list[ClientSocket] = []
    heads: list[bytes] = []

    async def start(handler: Handler, target: str = "/", timeout: float = 5.0) -> ClientSocket:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            heads.append(head)
            try:
                await handler(reader, writer, head)
            finally:
                writer.close()

        srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        servers.append(srv)
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.sockets[0].getsockname()[1])
        ws = await ClientSocket.open(reader, writer, host="localhost:8080", target=target,
                                     headers=[("cookie", "a=b")], subprotocols=["chat"], timeout=timeout)
        sockets.append(ws)
        return ws

    start.heads = heads  # type: ignore[attr-defined]
    yield start  # type: ignore[misc]
    for ws in sockets:
        ws.abort()
    for srv in servers:
        srv.close()
        await srv.wait_closed()


async def test_the_request_is_sent_as_written_with_one_host(serve: Callable[..., Awaitable[ClientSocket]]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(switching(head, b"sec-websocket-protocol: chat\r\n"))
        await writer.drain()
        await reader.read()

    ws = await serve(handler, target="/a%2Fb/c?q=a%20b")
    head = serve.heads[0].decode()  # type: ignore[attr-defined]
    assert head.startswith("GET /a%2Fb/c?q=a%20b HTTP/1.1\r\n")  # not re-quoted into %252F
    assert [line for line in head.split("\r\n") if line.lower().startswith("host:")] == ["Host: localhost:8080"]
    assert "cookie: a=b" in head.lower() and "sec-websocket-protocol: chat" in head.lower()
    assert ws.subprotocol == "chat"


async def test_frames_that_come_with_the_101_are_kept(serve: Callable[..., Awaitable[ClientSocket]]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(switching(head) + frame(1, b"hello") + frame(2, b"\x00\x01"))  # one write, one read
        await writer.drain()
        await reader.read()

    ws = await serve(handler)
    assert await ws.recv() == "hello"
    assert await ws.recv() == b"\x00\x01"


async def test_fragments_are_one_message_and_pings_are_answered(
        serve: Callable[..., Awaitable[ClientSocket]]) -> None:
    pong: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(switching(head))
        writer.write(frame(9, b"ping?") + frame(1, b"ab", fin=False) + frame(0, b"c", fin=False) + frame(0, b"d"))
        await writer.drain()
        pong.set_result(await read_frame(reader))
        await reader.read()

    ws = await serve(handler)
    assert await ws.recv() == "abcd"
    assert await asyncio.wait_for(pong, 5) == (10, b"ping?")


async def test_a_message_over_the_bound_closes_with_1009_at_its_header(
        serve: Callable[..., Awaitable[ClientSocket]]) -> None:
    closing: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(switching(head) + bytes([0x82, 127]) + struct.pack("!Q", MAX_MESSAGE + 1) + b"x" * 1000)
        await writer.drain()
        closing.set_result(await read_frame(reader))
        await reader.read()

    ws = await serve(handler)
    end = await ws.recv()
    assert isinstance(end, Closed) and end.code == 1009
    op, data = await asyncio.wait_for(closing, 5)
    assert op == 8 and struct.unpack("!H", data[:2])[0] == 1009


async def test_text_that_is_not_utf8_closes_with_1007(serve: Callable[..., Awaitable[ClientSocket]]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(switching(head) + frame(1, b"\xff\xfe"))
        await writer.drain()
        await reader.read()

    ws = await serve(handler)
    end = await ws.recv()
    assert isinstance(end, Closed) and end.code == 1007


async def test_the_servers_close_code_and_a_server_that_just_goes(
        serve: Callable[..., Awaitable[ClientSocket]]) -> None:
    async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(switching(head) + frame(8, struct.pack("!H", 4000) + b"bye"))
        await writer.drain()
        await reader.read()

    async def vanishes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(switching(head))
        await writer.drain()

    assert await (await serve(closes)).recv() == Closed(4000, "bye")
    assert await (await serve(vanishes)).recv() == Closed(1006)
    assert sendable(1006) == 1011 and sendable(1005) == 1000 and sendable(4000) == 4000 and sendable(999) == 1011


async def test_refusals_and_nonsense(serve: Callable[..., Awaitable[ClientSocket]]) -> None:
    async def refuses(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 4\r\nx-why: no\r\n\r\nnope")
        await writer.drain()

    async def nonsense(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async def hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        pass

    async def says_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        await reader.read()

    with pytest.raises(Refused) as refused:
        await serve(refuses)
    assert refused.value.response.status_code == 403 and refused.value.response.body == b"nope"
    assert refused.value.response.headers["x-why"] == "no"
    with pytest.raises(HandshakeFailed):
        await serve(nonsense)
    with pytest.raises(HandshakeFailed, match="closed during"):
        await serve(hangs_up)
    with pytest.raises(HandshakeFailed, match="within"):
        await serve(says_nothing, timeout=0.2)
