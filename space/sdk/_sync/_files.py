# Generated from space/sdk/_async/_files.py by scripts/unasync.py: do not edit.
"""Files inside a sandbox; content moves as a stream in both directions, never whole in memory."""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterable, Iterator, Iterable
from pathlib import Path
from urllib.parse import quote

from space import errors
from space.sdk._local import CHUNK_SIZE, AtomicWriter, Readable, download_target, open_read
from space.sdk._models import JSON

from ._http import SyncHTTP

Data = bytes | bytearray | memoryview | Iterable[bytes] | Iterable[bytes] | Readable


def _chunks(data: Iterable[bytes] | Iterable[bytes] | Readable) -> Iterator[bytes]:
    # A file-like object is read in fixed chunks: iterating a binary file would split it at b"\n".
    if isinstance(data, Readable):
        while chunk := data.read(CHUNK_SIZE):
            yield chunk
    elif isinstance(data, Iterable):
        for chunk in data:
            yield chunk
    else:
        for chunk in data:
            yield chunk


class Files:
    def __init__(self, http: SyncHTTP, sandbox_id: str) -> None:
        self._http = http
        self._path = f"/v1/sandboxes/{quote(sandbox_id, safe='')}/files"

    def read(self, path: str) -> bytes:
        resp = self._http.request("GET", self._path, params={"path": path})
        return resp.content

    def read_stream(self, path: str) -> Iterator[bytes]:
        with self._http.stream("GET", self._path, params={"path": path}) as resp:
            for chunk in resp.iter_bytes(CHUNK_SIZE):
                yield chunk

    def write(self, path: str, data: Data) -> JSON:
        """Write ``data`` (bytes, an open binary file or an iterable of chunks) to ``path``."""
        content = bytes(data) if isinstance(data, bytes | bytearray | memoryview) else _chunks(data)
        headers = {"Content-Type": "application/octet-stream"}
        params = {"path": path}
        return self._http.json("PUT", self._path, params=params, content=content, headers=headers)

    def upload(self, local_path: str | os.PathLike[str], path: str) -> JSON:
        with open_read(local_path) as f:
            return self.write(path, f)

    def download(self, path: str, local_path: str | os.PathLike[str]) -> Path:
        """Stream ``path`` into ``local_path`` (into it, if it is a directory); return where it landed.

        The local file appears only once the whole content arrived.
        """
        target = download_target(local_path, path)
        with self._http.stream("GET", self._path, params={"path": path}) as resp:
            with AtomicWriter(target) as out:
                for chunk in resp.iter_bytes(CHUNK_SIZE):
                    out.write(chunk)
        return target

    def list(self, path: str, depth: int = 1) -> builtins.list[JSON]:
        body = self._http.json("GET", f"{self._path}/list", params={"path": path, "depth": depth})
        return list(body.get("entries", []))

    def stat(self, path: str) -> JSON:
        return self._http.json("GET", f"{self._path}/stat", params={"path": path})

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except errors.NotFound:
            return False
        return True

    def mkdir(self, path: str) -> JSON:
        return self._http.json("POST", f"{self._path}/mkdir", json={"path": path})

    def move(self, src: str, dst: str) -> JSON:
        return self._http.json("POST", f"{self._path}/move", json={"src": src, "dst": dst})

    def remove(self, path: str, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        self._http.request("DELETE", self._path, params=params)
