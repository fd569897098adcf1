"""The gateway's audit journal: append-only, fsync'd in small batches, kept until the node acks it.

Layout: ``seg-<first seq>.jsonl`` segments of one JSON record per line, ``acked`` holding the
highest acknowledged seq, and ``id``: the journal's identity, made once and put in every record, so
that the control plane stores each record once however often it is shipped (a retried drain, two
leaders at once), and a reinstalled node, whose seqs start over, is another journal. A restart
never appends to an old segment (its last line may be torn): it opens a new one, numbering on from
the highest seq seen (or acked), so seqs only grow. ``ack`` deletes whole segments at or below the
watermark; reads skip the rest of what was acked.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import secrets
from pathlib import Path
from typing import IO, Any

SEGMENT_BYTES = 4 << 20
FLUSH_EVERY = 0.05  # seconds: how stale the on-disk journal may be after a crash


class Journal:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.acked = self._read_acked()
        self.id = self._identity()
        last = self.acked
        for first, path in self._segments():
            seq = _last_seq(path)
            if seq is None:
                path.unlink(missing_ok=True)  # created, never written: its number is free again
                last = max(last, first - 1)
            else:
                last = max(last, seq)
        self.last = last
        self._file: IO[str] | None = None
        self._file_first = 0
        self._dirty = 0
        self._flusher: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    # ---- writing ---------------------------------------------------------------------------------

    def append(self, tenant: str, sandbox: str, action: str, target: str, result: str,
               details: dict[str, Any] | None = None) -> int:
        self.last += 1
        rec = {"seq": self.last, "journal": self.id, "at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
               "tenant": tenant, "sandbox": sandbox, "action": action, "target": target, "result": result,
               "details": details or {}}
        f = self._open()
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._dirty += 1
        if self._wake is not None:
            self._wake.set()
        else:
            self.flush()  # no event loop running the batcher: every record is durable at once
        return self.last

    def _open(self) -> IO[str]:
        if self._file is not None and self._file.tell() >= SEGMENT_BYTES:
            self._close_file()
        if self._file is None:
            self._file_first = self.last
            path = self.dir / f"seg-{self.last:020d}.jsonl"
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across appends
            _fsync_dir(self.dir)
        return self._file

    def _close_file(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None

    def flush(self) -> None:
        """Write and fsync what is pending (synchronously)."""
        if self._file is not None and self._dirty:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._dirty = 0

    async def run_flusher(self) -> None:
        """Batch fsyncs: at most every FLUSH_EVERY seconds, off the event loop."""
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wake.wait()
                await asyncio.sleep(FLUSH_EVERY)
                self._wake.clear()
                if self._file is not None and self._dirty:
                    self._dirty = 0
                    self._file.flush()
                    await loop.run_in_executor(None, os.fsync, self._file.fileno())
        finally:
            self._wake = None

    def start(self) -> None:
        self._flusher = asyncio.get_running_loop().create_task(self.run_flusher())

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        self._close_file()

    # ---- reading and acking ------------------------------------------------------------------------

    def read(self, after: int = 0, limit: int = 1000) -> tuple[list[dict[str, Any]], int]:
        """Records with seq > ``after`` not yet acked, oldest first; and the seq to pass next time."""
        if self._file is not None:
            self._file.flush()
        start = max(after, self.acked)
        out: list[dict[str, Any]] = []
        segs = self._segments()
        for i, (_first, path) in enumerate(segs):
            nxt = segs[i + 1][0] if i + 1 < len(segs) else None
            if nxt is not None and nxt - 1 <= start:
                continue  # this whole segment is at or below the start
            for line in _lines(path):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line from a crash
                if not isinstance(rec, dict) or not isinstance(rec.get("seq"), int) or rec["seq"] <= start:
                    continue
                out.append(rec)
                if len(out) >= limit:
                    return out, int(rec["seq"])
        return out, int(out[-1]["seq"]) if out else start

    def ack(self, upto: int) -> int:
        """Drop records up to ``upto`` (never beyond what was written); the new watermark."""
        upto = min(int(upto), self.last)
        if upto <= self.acked:
            return self.acked
        self.acked = upto
        tmp = self.dir / ".acked.tmp"
        tmp.write_text(str(upto))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / "acked")
        segs = self._segments()
        for i, (first, path) in enumerate(segs):
            current = self._file is not None and first == self._file_first
            last = segs[i + 1][0] - 1 if i + 1 < len(segs) else self.last
            if last <= upto:
                if current:
                    self._close_file()
                path.unlink(missing_ok=True)
        _fsync_dir(self.dir)
        return self.acked

    def _identity(self) -> str:
        path = self.dir / "id"
        try:
            with open(path, "rb") as f:  # the gateway's own directory; bounded all the same
                value = f.read(64).decode(errors="replace").strip()
            if value and value.isalnum():
                return value
        except FileNotFoundError:
            pass
        value = secrets.token_hex(8)
        tmp = path.with_name(f".id.{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(value + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return value

    def _read_acked(self) -> int:
        try:
            return int((self.dir / "acked").read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _segments(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.dir.glob("seg-*.jsonl"):
            with contextlib.suppress(ValueError):
                out.append((int(p.stem[4:]), p))
        return sorted(out)


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []


def _last_seq(path: Path) -> int | None:
    for line in reversed(_lines(path)):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("seq"), int):
            return int(rec["seq"])
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
