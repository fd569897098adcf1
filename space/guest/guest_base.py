"""What every part of the guest daemon shares: its errors, its log, the frame writer, argument checks.

Standard library only, like all of the guest (see daemon.py, which also explains why the guest
modules are imported either as ``space.guest.*`` or as top-level modules).
"""

from __future__ import annotations

import os
import threading

if __package__:
    from . import protocol
else:  # top-level inside the sandbox: daemon.py put this directory on sys.path
    import protocol  # type: ignore[no-redef, import-not-found]

TYPE_CHECKING = False  # type checkers read it as true; importing typing costs boot time (see daemon.py)
if TYPE_CHECKING:
    from typing import Any, TypeAlias

    Header: TypeAlias = dict[str, Any]


class GuestError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_ERRNO_CODES: dict[str, str] = {
    "ENOENT": "not_found", "EEXIST": "conflict", "ENOTEMPTY": "conflict", "EBUSY": "conflict",
    "EACCES": "forbidden", "EPERM": "forbidden", "EROFS": "forbidden", "ENOTDIR": "invalid_path",
    "EISDIR": "invalid_request", "ENAMETOOLONG": "invalid_path", "ELOOP": "invalid_path",
    "EINVAL": "invalid_request", "EXDEV": "invalid_request",
    "ENOSPC": "insufficient_storage", "EDQUOT": "insufficient_storage",
}


def os_error(exc: OSError, what: str = "") -> GuestError:
    import errno

    name = errno.errorcode.get(exc.errno or 0, "")
    code = _ERRNO_CODES.get(name, "internal")
    where = what or (exc.filename if isinstance(exc.filename, str) else "")
    return GuestError(code, f"{exc.strerror or exc}: {where}" if where else str(exc.strerror or exc))


_log_budget = [200]


def log(msg: str) -> None:
    """Log to stderr, sparingly: a broken host must not make the guest spend its life logging."""
    if _log_budget[0] <= 0:
        return
    _log_budget[0] -= 1
    try:  # noqa: SIM105 -- contextlib costs boot time
        os.write(2, f"space-guest[{os.getpid()}]: {msg}\n".encode(errors="replace"))
    except OSError:
        pass


class Writer:
    """Serializes frames onto fd 1, in writes of at most MAX_WRITE bytes (gVisor stalls bigger ones)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._broken = False

    def send(self, header: Header, payload: bytes = b"") -> None:
        data = protocol.encode(header, payload)
        with self.lock:
            self.write_locked(data)

    def write_locked(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(1, view[: protocol.MAX_WRITE])
            except OSError as exc:
                # No host (EPIPE) or a channel being swapped: drop the frame, the replay buffer has it.
                if not self._broken:
                    log(f"channel write failed: {exc}")
                self._broken = True
                return
            self._broken = False
            view = view[n:]

    def reply(self, rid: Any, result: Header) -> None:
        parts = {k: v for k, v in result.items() if k in ("entries", "commands")}
        for key, items in parts.items():
            batches = protocol.batch_items(items)
            for batch in batches[:-1]:
                self.send({"t": "chunk", "id": rid, "part": key, key: batch})
            result[key] = batches[-1]
        self.send({"t": "res", "id": rid, "ok": True, **result})

    def fail(self, rid: Any, code: str, message: str) -> None:
        self.send({"t": "res", "id": rid, "ok": False, "error": {"code": code, "message": message[:2000]}})


def arg(h: Header, key: str, kind: type | tuple[type, ...], default: Any = None,
        *, required: bool = False) -> Any:
    v = h.get(key, default)
    if v is None and not required:
        return default
    if isinstance(v, bool) and kind in (int, float):
        raise GuestError("invalid_request", f"{key} must be {kind}")
    if not isinstance(v, kind):
        raise GuestError("invalid_request", f"{key} is missing or has the wrong type")
    return v


def norm_path(p: Any, key: str = "path") -> str:
    """Lexically normalize an absolute path; refuse one whose ``..`` climbs above ``/``."""
    if not isinstance(p, str) or not p:
        raise GuestError("invalid_path", f"{key} must be a non-empty string")
    if "\x00" in p:
        raise GuestError("invalid_path", f"{key} contains a NUL byte")
    if not p.startswith("/"):
        raise GuestError("invalid_path", f"{key} must be absolute: {p!r}")
    parts: list[str] = []
    for seg in p.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if not parts:
                raise GuestError("invalid_path", f"{key} escapes the root: {p!r}")
            parts.pop()
        else:
            parts.append(seg)
    return "/" + "/".join(parts)


def close_fd(fd: int) -> None:
    try:  # noqa: SIM105 -- contextlib costs boot time
        os.close(fd)
    except OSError:
        pass


def poke(fd: int) -> None:
    """Wake a thread that polls the read end of a self-pipe whose write end is ``fd``."""
    try:  # noqa: SIM105 -- contextlib costs boot time
        os.write(fd, b"x")
    except OSError:
        pass  # already awake (pipe full)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view[: protocol.MAX_WRITE])
        except BlockingIOError:  # a pty master is non-blocking (the pump reads it)
            import select

            select.select([], [fd], [])
            continue
        view = view[n:]
