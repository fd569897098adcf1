"""A node going away for good: the mark that says so, and the count its leaving waits on.

A node pod is stopped both when it is replaced (a DaemonSet rollout: the sandboxes stay, the next
agent adopts them) and when its machine goes away (a scale-down, a replacement: the sandboxes must
move first). ``space node leave`` -- the pod's ``preStop`` hook, or an operator retiring a machine --
tells the two apart (:mod:`space.node.kubernetes`), and for a node that is leaving:

1. writes the **mark** ``<data-dir>/leaving.json`` (as root; the agent reads it);
2. the agent reports it in every heartbeat's answer, and the leading controller drains the node
   (cordon, then every sandbox moved elsewhere with its processes: ``node.drain``);
3. waits until the agent's **count** of the sandboxes it holds (``<data-dir>/node/owned``, which the
   agent rewrites when it changes, with the mark it answered with) is 0 for this mark, or its
   deadline; then the pod stops. (A count from before the mark would say 0 for a sandbox created
   a moment ago: only a count the agent wrote as it reported the mark counts.)

A new agent clears the mark as it starts: a node that came back is not leaving any more.

Root reads the count the unprivileged agent writes, and the agent the mark root writes: each is
read as hostile input (no symlink, no FIFO, a regular file of bounded size, a plain value).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from space.node.storage.ownership import node_state_dir

MARK = "leaving.json"
OWNED = "owned"
#: The most either file may hold: what is longer is not ours.
_MAX_BYTES = 4096


def mark_path(data_dir: Path) -> Path:
    return data_dir / MARK


def owned_path(data_dir: Path) -> Path:
    return node_state_dir(data_dir) / OWNED


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    """``data`` as ``path``, whole or not at all: a temporary file made with O_EXCL|O_NOFOLLOW (never
    an existing file or a link someone planted) renamed over it (a rename replaces a link, it does
    not follow it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _read_bounded(path: Path) -> bytes | None:
    """The file's bytes if it is a regular file of at most _MAX_BYTES (None otherwise, or if absent).
    Opened without following a link and without blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_BYTES:
            return None
        return os.read(fd, _MAX_BYTES + 1)[:_MAX_BYTES]
    finally:
        os.close(fd)


def mark(data_dir: Path, reason: str) -> float:
    """Say that this node is going away for good, and why; the mark's time (its identity)."""
    since = time.time()
    _write_atomically(mark_path(data_dir), json.dumps({"reason": reason[:200], "since": since}).encode(), 0o644)
    return since


def clear(data_dir: Path) -> bool:
    """Withdraw the mark (a new agent starting; ``space node leave --cancel``); whether there was one."""
    try:
        mark_path(data_dir).unlink()
    except FileNotFoundError:
        return False
    return True


def read_mark(data_dir: Path) -> dict[str, Any] | None:
    """``{"reason", "since"}`` if this node is leaving, else None (also for a file that is not a mark)."""
    data = _read_bounded(mark_path(data_dir))
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("reason"), str) \
            or not isinstance(doc.get("since"), int | float) or isinstance(doc.get("since"), bool):
        return None
    return {"reason": doc["reason"][:200], "since": float(doc["since"])}


def write_owned(data_dir: Path, count: int, since: float | None) -> None:
    """The agent's count of the sandboxes it holds, as it answered a heartbeat with the mark of
    time ``since`` (None: no mark)."""
    _write_atomically(owned_path(data_dir), f"{count} {'-' if since is None else repr(since)}\n".encode(), 0o644)


def read_owned(data_dir: Path, since: float | None = None) -> int | None:
    """The agent's last count; with ``since``, only one written as it reported that mark (None:
    none such, or not a count)."""
    data = _read_bounded(owned_path(data_dir))
    if data is None:
        return None
    count, _, seen = data.decode("ascii", "replace").strip().partition(" ")
    if not (count.isdigit() and len(count) <= 9):
        return None
    if since is not None:
        try:
            if float(seen) != since:
                return None
        except ValueError:
            return None
    return int(count)


class Heartbeats:
    """The agent's side, at each heartbeat: the mark read, the count written when it (or the mark
    it goes with) changed."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._written: tuple[int, float | None] | None = None

    def report(self, owned: int) -> dict[str, Any] | None:
        leaving = read_mark(self.data_dir)
        now = (owned, None if leaving is None else leaving["since"])
        if now != self._written:
            try:
                write_owned(self.data_dir, *now)
                self._written = now
            except OSError:  # the next heartbeat writes it (its leaving waits on it meanwhile)
                pass
        return leaving


def wait_until_empty(data_dir: Path, since: float, timeout: float, say: Callable[[str], object], *,
                     poll: float = 1.0, say_every: float = 10.0) -> int | None:
    """Wait until the agent, answering with the mark of time ``since``, holds no sandbox, at most
    ``timeout`` seconds, telling ``say`` how many are left now and then; the last count (None: the
    agent has not answered with this mark)."""
    deadline = time.monotonic() + timeout
    told = -say_every
    while True:
        left = read_owned(data_dir, since)
        now = time.monotonic()
        if left == 0 or now >= deadline:
            return left
        if now - told >= say_every:
            say(f"{'?' if left is None else left} sandbox(es) still on this node")
            told = now
        time.sleep(min(poll, max(0.0, deadline - now)))
