"""Raw HTTP/1.1 clients for the API's bounds tests: what a hostile client sends byte by byte (a
declared body it never sends, headers dripped one byte at a time), which httpx would not do."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

from tests.e2e.harness import Server


class RawAnswer:
    """A response as read off the socket: status, lowercased headers, body (maybe cut short)."""

    def __init__(self, raw: bytes) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}

    def error(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` body's inner object (a chunked body is joined first)."""
        body = self.body
        if self.headers.get("transfer-encoding") == "chunked":
            body = _dechunk(body)
        doc = json.loads(body)
        assert isinstance(doc, dict) and isinstance(doc.get("error"), dict), doc
        err: dict[str, Any] = doc["error"]
        return err


def _dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


@contextlib.contextmanager
def raw_connection(server: Server, timeout: float = 5.0) -> Iterator[socket.socket]:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    try:
        yield s
    finally:
        s.close()


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_answer(s: socket.socket, deadline: float) -> RawAnswer | None:
    """The response the server sends by ``deadline`` (monotonic), None if it sent none; a
    connection it closed without answering is an empty answer (status 0)."""
    raw = b""
    while time.monotonic() < deadline:
        s.settimeout(max(0.05, min(1.0, deadline - time.monotonic())))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            if _complete(raw):
                return RawAnswer(raw)
            continue
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return RawAnswer(raw) if raw else RawAnswer(b"HTTP/1.1 0 closed\r\n\r\n")
        raw += chunk
        if _complete(raw):
            return RawAnswer(raw)
    return RawAnswer(raw) if _complete(raw) else None


def _complete(raw: bytes) -> bool:
    head_, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    low = head_.lower()
    if b"transfer-encoding: chunked" in low:
        return body.endswith(b"0\r\n\r\n")
    for line in low.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return True


def send_until_answered(s: socket.socket, chunks: Iterator[bytes], deadline: float) -> RawAnswer | None:
    """Send ``chunks`` one by one, stopping as soon as the server answers (or closes, or stops
    reading); then wait for its answer until ``deadline``."""
    s.setblocking(False)
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                if time.monotonic() > deadline:
                    return None
                try:
                    sent = s.send(view)
                except BlockingIOError:
                    if _readable(s):
                        return read_answer(s, deadline)
                    select.select([s], [s], [], max(0.0, deadline - time.monotonic()))  # room, or an answer
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    return read_answer(s, deadline)
                view = view[sent:]
            if _readable(s):
                return read_answer(s, deadline)
    finally:
        s.setblocking(True)
    return read_answer(s, deadline)


def _readable(s: socket.socket) -> bool:
    return bool(select.select([s], [], [], 0)[0])


def chunked(piece: bytes, count: int) -> Iterator[bytes]:
    """``count`` chunks of ``piece`` in chunked transfer encoding, never the last chunk."""
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    for _ in range(count):
        yield frame


def api_key(server: Server, role: str, tenant: str = "default") -> str:
    with server.client() as api:
        r = api.post("/v1/apikeys", json={"tenant": tenant, "role": role, "name": f"bounds-{role}"})
        assert r.status_code == 201, r.text
        return str(r.json()["key"])
