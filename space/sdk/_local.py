"""Local-file helpers for uploads and downloads.

The async client calls these directly: each read or write moves at most one chunk (1 MiB) to or
from the page cache, which costs less than a thread hop and keeps one source for both clients.
"""

from __future__ import annotations

import os
import posixpath
import secrets
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol, runtime_checkable

CHUNK_SIZE = 1024 * 1024


@runtime_checkable
class Readable(Protocol):
    """A binary file-like object (an open file, ``sys.stdin.buffer``, ``io.BytesIO``)."""

    def read(self, size: int = -1, /) -> bytes: ...


def open_read(path: str | os.PathLike[str]) -> BinaryIO:
    return open(path, "rb")  # the caller closes it


def download_target(local_path: str | os.PathLike[str], remote_path: str) -> Path:
    """Where a download lands: ``local_path``, or inside it when it is a directory (like ``cp``)."""
    target = Path(local_path)
    if target.is_dir():
        target = target / posixpath.basename(remote_path.rstrip("/"))
    return target


class AtomicWriter:
    """Writes to a temporary file beside ``target`` and renames it into place only on success."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self._tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
        # os.open with 0o666 (not mkstemp's 0o600) so the result gets the usual umask-derived mode.
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self._file = os.fdopen(fd, "wb")
        self.written = 0

    def write(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self.written += len(chunk)

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._file.close()
        if exc_type is None:
            os.replace(self._tmp, self.target)
        else:
            self._tmp.unlink(missing_ok=True)
