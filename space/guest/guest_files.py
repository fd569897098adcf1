"""The ``fs.*`` requests: file reads and uploads, stat, listings, mkdir, move and remove."""

from __future__ import annotations

import os
import time

if __package__:
    from . import protocol
    from .guest_base import GuestError, arg, close_fd, norm_path, write_all
    from .guest_users import User, group_name, owner_name, resolve_user
else:  # top-level inside the sandbox: daemon.py put this directory on sys.path
    import protocol  # type: ignore[no-redef, import-not-found]
    from guest_base import GuestError, arg, close_fd, norm_path, write_all  # type: ignore[no-redef, import-not-found]
    from guest_users import User, group_name, owner_name, resolve_user  # type: ignore[no-redef, import-not-found]

TYPE_CHECKING = False  # type checkers read it as true; importing typing costs boot time (see daemon.py)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .daemon import Daemon
    from .guest_base import Header

UPLOAD_IDLE = 120.0
MAX_LIST_ENTRIES = 100_000


class Upload:
    def __init__(self) -> None:
        import queue

        self.q: queue.Queue[tuple[bytes, bool] | None] = queue.Queue(maxsize=64)
        self.aborted = False

    def drain(self) -> None:
        while not self.q.empty():
            self.q.get_nowait()


def _kind(mode: int) -> str:
    import stat as st

    return ("dir" if st.S_ISDIR(mode) else "file" if st.S_ISREG(mode) else
            "symlink" if st.S_ISLNK(mode) else "other")


def file_entry(path: str) -> Header:
    import stat as st

    s = os.lstat(path)
    m = s.st_mode
    kind = _kind(m)
    target = None
    resolved: Header | None = None
    if kind == "symlink":
        try:
            target = os.readlink(path)
        except OSError:
            target = None
        try:  # what the link leads to, all links followed (None when broken or looping)
            t = os.stat(path)
            resolved = {"path": os.path.realpath(path), "type": _kind(t.st_mode), "mode": st.S_IMODE(t.st_mode)}
        except OSError:
            resolved = None
    return {"name": os.path.basename(path) or "/", "path": path, "type": kind, "size": s.st_size,
            "mode": st.S_IMODE(m), "mtime": s.st_mtime, "owner": owner_name(s.st_uid),
            "group": group_name(s.st_gid), "symlink_target": target, "resolved": resolved}


def _makedirs(path: str, user: User | None) -> None:
    """mkdir -p that chowns exactly the directories it created."""
    missing: list[str] = []
    p = path
    while not os.path.isdir(p):
        if os.path.lexists(p):
            raise GuestError("conflict", f"{p} exists and is not a directory")
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:
            if not os.path.isdir(d):
                raise GuestError("conflict", f"{d} exists and is not a directory") from None
            continue
        if user is not None:
            os.chown(d, user.uid, user.gid)


def op_fs_read(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    import stat as st

    path = norm_path(h.get("path"))
    offset = arg(h, "offset", int, 0)
    length = arg(h, "length", int)
    if offset < 0 or (length is not None and length < 0):
        raise GuestError("invalid_request", "offset and length must not be negative")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        s = os.fstat(fd)
        if st.S_ISDIR(s.st_mode):
            raise GuestError("invalid_request", f"{path} is a directory")
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        sent = 0
        while length is None or sent < length:
            want = protocol.MAX_PAYLOAD if length is None else min(protocol.MAX_PAYLOAD, length - sent)
            data = os.read(fd, want)
            if not data:
                break
            d.writer.send({"t": "chunk", "id": rid}, data)
            sent += len(data)
    finally:
        os.close(fd)
    return {"size": s.st_size, "read": sent}


def op_fs_write(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    try:
        return _fs_write(d, rid, h)
    except OSError as exc:
        import errno

        # A full disk (or quota) is the caller's 507, not an internal error.
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise GuestError("insufficient_storage", f"not enough disk space: {exc.strerror}") from None
        raise


def _receive(up: Upload, fd: int) -> None:
    """Write the upload's chunks to ``fd`` until its end."""
    import queue

    idle_since = time.monotonic()
    while True:
        if up.aborted:
            raise GuestError("invalid_request", "upload aborted")
        try:
            item = up.q.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() - idle_since > UPLOAD_IDLE:
                raise GuestError("invalid_request", "upload stalled") from None
            continue
        idle_since = time.monotonic()
        if item is None:
            raise GuestError("invalid_request", "upload aborted")
        data, eof = item
        if data:
            write_all(fd, data)
        if eof:
            return


def _fs_write(d: Daemon, rid: Any, h: Header) -> Header:
    with d.lock:
        up = d.uploads.get(rid)
    if up is None:
        raise GuestError("invalid_request", "duplicate or missing upload id")
    path = norm_path(h.get("path"))
    mode = arg(h, "mode", int, 0o644) & 0o7777
    mkdirs = bool(h.get("mkdirs", True))
    user = resolve_user(h["user"]) if h.get("user") is not None else None
    if path == "/":
        raise GuestError("invalid_path", "cannot write to /")
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise GuestError("conflict", f"{path} is a directory")
    if mkdirs:
        _makedirs(parent, user)
    elif not os.path.isdir(parent):
        raise GuestError("not_found", f"directory not found: {parent}")
    if not h.get("atomic", True):
        _write_in_place(up, path, mode, user)
        return {"entry": file_entry(path)}
    tmp = os.path.join(parent, f".space-upload-{os.urandom(8).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        _receive(up, fd)
        os.fchmod(fd, mode)
        if user is not None:
            os.fchown(fd, user.uid, user.gid)
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
    except BaseException:
        if fd >= 0:
            close_fd(fd)
        try:  # noqa: SIM105 -- contextlib costs boot time
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return {"entry": file_entry(path)}


def _write_in_place(up: Upload, path: str, mode: int, user: User | None) -> None:
    """Truncate and write ``path`` itself, as E2B's envd does: a watcher of the directory sees the
    file's own create/chmod/write events (no temporary name), an existing file keeps its inode and
    mode, and readers may see it half written."""
    import stat as st

    existed = os.path.lexists(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        if not existed and st.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)  # the umask took bits away
        if user is not None:
            os.fchown(fd, user.uid, user.gid)
        _receive(up, fd)
    except BaseException:
        close_fd(fd)
        if not existed:
            try:  # noqa: SIM105 -- contextlib costs boot time
                os.unlink(path)
            except OSError:
                pass
        raise
    os.close(fd)


def op_fs_stat(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    return {"entry": file_entry(norm_path(h.get("path")))}


def op_fs_list(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    import stat as st

    path = norm_path(h.get("path"))
    depth = arg(h, "depth", int, 1)
    if depth < 1:
        raise GuestError("invalid_request", "depth must be at least 1")
    if not st.S_ISDIR(os.stat(path).st_mode):
        raise GuestError("invalid_request", f"{path} is not a directory")
    entries: list[Header] = []
    truncated = False

    def walk(directory: str, level: int) -> None:
        nonlocal truncated
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            if directory == path:
                raise
            return  # an unreadable subdirectory does not spoil the listing
        for name in names:
            if len(entries) >= MAX_LIST_ENTRIES:
                truncated = True
                return
            child = os.path.join(directory, name)
            try:
                entry = file_entry(child)
            except OSError:
                continue
            entries.append(entry)
            if level > 1 and entry["type"] == "dir":
                walk(child, level - 1)

    walk(path, depth)
    return {"entries": entries, "truncated": truncated}


def op_fs_mkdir(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    path = norm_path(h.get("path"))
    user = resolve_user(h["user"]) if h.get("user") is not None else None
    if os.path.isdir(path):
        return {"entry": file_entry(path)}
    if os.path.lexists(path):
        raise GuestError("conflict", f"{path} exists and is not a directory")
    if h.get("parents", True):
        _makedirs(path, user)
    else:
        os.mkdir(path, 0o755)
        if user is not None:
            os.chown(path, user.uid, user.gid)
    return {"entry": file_entry(path)}


def op_fs_move(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    src = norm_path(h.get("src"), "src")
    dst = norm_path(h.get("dst"), "dst")
    if src == "/" or dst == "/":
        raise GuestError("invalid_path", "cannot move /")
    if not os.path.lexists(src):
        raise GuestError("not_found", f"not found: {src}")
    if os.path.isdir(dst) and not os.path.islink(dst):
        raise GuestError("conflict", f"{dst} exists and is a directory")
    if (dst + "/").startswith(src + "/"):
        raise GuestError("invalid_request", "cannot move a directory into itself")
    if not os.path.isdir(os.path.dirname(dst)):
        raise GuestError("not_found", f"directory not found: {os.path.dirname(dst)}")
    try:
        os.rename(src, dst)
    except OSError as exc:
        import errno

        if exc.errno != errno.EXDEV:
            raise
        import shutil

        shutil.move(src, dst)
    return {"entry": file_entry(dst)}


def op_fs_remove(d: Daemon, rid: Any, h: Header, payload: bytes) -> Header:
    import stat as st

    path = norm_path(h.get("path"))
    if path == "/":
        raise GuestError("forbidden", "cannot remove /")
    s = os.lstat(path)
    if st.S_ISDIR(s.st_mode):
        if h.get("recursive"):
            import shutil

            shutil.rmtree(path)
        else:
            try:
                os.rmdir(path)
            except OSError as exc:
                import errno

                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise GuestError("conflict", f"directory not empty: {path}") from None
                raise
    else:
        os.unlink(path)
    return {}


OPS: dict[str, Callable[[Daemon, Any, Header, bytes], Header]] = {
    "fs.read": op_fs_read, "fs.write": op_fs_write, "fs.stat": op_fs_stat, "fs.list": op_fs_list,
    "fs.mkdir": op_fs_mkdir, "fs.move": op_fs_move, "fs.remove": op_fs_remove,
}
