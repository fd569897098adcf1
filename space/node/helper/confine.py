"""Pool-relative names (``REL``) resolved by file descriptor, never escaping the pool.

After the privilege split the agent owns the pool's plain directories, so any of them may be
swapped for a symlink or have something mounted on it between a check and a use. The helper
therefore resolves every ``REL`` from one fd of the pool root with ``openat2(RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)``, one component at a time, and then
acts on *(parent fd, last name)* with ``*at`` calls and ioctls: no path string is walked again.

Python 3.11 has no ``os.openat2``, so it is the raw syscall through ctypes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from space.errors import InvalidPath, NotFound, RuntimeFailure

_SYS_OPENAT2 = 437  # same number on every architecture (asm-generic/unistd.h)
# <linux/openat2.h>
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10  # as if the directory were /: its symlinks never lead out of it
CONFINED = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_OPEN_HOW = struct.Struct("=QQQ")  # struct open_how { __u64 flags, mode, resolve; }
BTRFS_SUPER_MAGIC = 0x9123683E

#: The pool's areas a verb may name; anything else at the top (pool.img, ...) is out of reach.
AREAS = ("templates", "sandboxes", "tmp", "trash")
COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,160}")
#: Two at least (no verb acts on an area itself); six at most (sandboxes/<id>/snapshots/<snap>/
#: rootfs is five; the sixth leaves room for a nested subvolume in a test tree).
MIN_PARTS, MAX_PARTS = 2, 6

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MNT_DETACH = 2


def openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """``openat2(2)``; raises OSError with the kernel's errno."""
    how = ctypes.create_string_buffer(_OPEN_HOW.pack(flags, mode, resolve), _OPEN_HOW.size)
    for _ in range(8):
        fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd), ctypes.c_char_p(os.fsencode(path)),
                           how, ctypes.c_size_t(_OPEN_HOW.size))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):  # EAGAIN: a rename or mount raced the lookup
            break
    raise OSError(err, f"openat2 {path!r}: {os.strerror(err)}")


def fs_type(fd: int) -> int:
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit; f_type comes first
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    value: int = struct.unpack_from("=l", buf.raw)[0] & 0xFFFFFFFF
    return value


def umount_fd(fd: int, *, lazy: bool = False) -> None:
    """Unmount the mount whose root ``fd`` is open on, through its magic link (no path walk)."""
    if _libc.umount2(f"/proc/self/fd/{fd}".encode(), MNT_DETACH if lazy else 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def mount_id_of(fd: int) -> int:
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "mnt_id":
            return int(value)
    raise RuntimeFailure("no mnt_id in fdinfo")


def path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def parse_rel(rel: str) -> tuple[str, ...]:
    """The components of a valid ``REL``, or InvalidPath."""
    if not isinstance(rel, str):
        raise InvalidPath("a pool path must be a string")
    parts = tuple(rel.split("/"))
    if not MIN_PARTS <= len(parts) <= MAX_PARTS:
        raise InvalidPath(f"a pool path has {MIN_PARTS} to {MAX_PARTS} components: {rel[:200]!r}", path=rel[:200])
    if parts[0] not in AREAS:
        raise InvalidPath(f"a pool path starts with one of {', '.join(AREAS)}: {rel[:200]!r}", path=rel[:200])
    for part in parts[1:]:
        if COMPONENT.fullmatch(part) is None:
            raise InvalidPath(f"invalid pool path component {part[:200]!r}", path=rel[:200])
    return parts


def _refused(exc: OSError, what: str) -> Exception:
    if exc.errno == errno.ENOENT:
        return NotFound(f"no such pool path: {what}", path=what)
    if exc.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
        # ELOOP: a symlink; EXDEV: a mount point or an escape; ENOTDIR: a file where a dir must be.
        return InvalidPath(f"pool path leaves the pool or crosses a link or mount: {what}", path=what,
                           errno=errno.errorcode.get(exc.errno or 0, str(exc.errno)))
    return exc


@dataclass
class Resolved:
    """The last component of a REL, as a name in its (open) parent directory."""

    parent_fd: int
    name: str
    rel: str

    def lstat(self) -> os.stat_result | None:
        try:
            return os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open(self, flags: int = os.O_RDONLY | os.O_DIRECTORY) -> int:
        """Open the entry itself, under the same confinement (refuses a symlink or a mount on it)."""
        try:
            return openat2(self.parent_fd, self.name, flags | os.O_CLOEXEC, CONFINED)
        except OSError as exc:
            raise _refused(exc, self.rel) from None

    def host_path(self) -> str:
        """Where the entry is in the host's mount tree (for matching mountinfo, and logs)."""
        return path_of(self.parent_fd).rstrip("/") + "/" + self.name


class PoolRoot:
    """One open fd of the pool's root; every REL is resolved from it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def open(cls, root: Path) -> PoolRoot:
        fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if fs_type(fd) != BTRFS_SUPER_MAGIC:
                raise RuntimeFailure(f"the pool root {root} is not on btrfs", path=str(root))
        except BaseException:
            os.close(fd)
            raise
        return cls(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PoolRoot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> str:
        return path_of(self.fd)

    def open_dir(self, parts: tuple[str, ...], *, create: bool = False, what: str = "") -> int:
        """An ``O_RDONLY|O_DIRECTORY`` fd of the directory ``parts`` beneath the root.

        With ``create``, missing directories are made (0755) one component at a time.
        """
        fd = os.dup(self.fd)
        try:
            for part in parts:
                try:
                    nxt = openat2(fd, part, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, CONFINED)
                except FileNotFoundError:
                    if not create:
                        raise
                    with suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    nxt = openat2(fd, part, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, CONFINED)
                os.close(fd)
                fd = nxt
        except OSError as exc:
            os.close(fd)
            raise _refused(exc, what or "/".join(parts)) from None
        return fd

    @contextmanager
    def resolve(self, rel: str, *, create_parents: bool = False) -> Iterator[Resolved]:
        """``rel`` as *(parent fd, name)*; NotFound if a parent is missing (and not to be made)."""
        parts = parse_rel(rel)
        parent = self.open_dir(parts[:-1], create=create_parents, what=rel)
        try:
            yield Resolved(parent, parts[-1], rel)
        finally:
            os.close(parent)

    def open_mount_root(self, host_path: str) -> int | None:
        """An ``O_PATH`` fd of what is mounted at ``host_path`` (beneath the root), or None.

        Mount targets come from mountinfo and may lie under other mounts (``dev/pts`` under a
        bind of ``/dev``), so crossing mounts is allowed here, but symlinks and escapes are not:
        what gets unmounted is always something at a real path beneath the pool.
        """
        base = self.path.rstrip("/") + "/"
        if not host_path.startswith(base):
            return None
        rel = host_path[len(base):]
        head, _, last = rel.rpartition("/")
        if not last or last in (".", ".."):
            return None
        resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
        try:
            parent = openat2(self.fd, head or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, resolve)
        except OSError as exc:
            raise _refused(exc, rel) from None
        try:
            # Plain openat on the last component: lands on the root of the top mount there.
            return os.open(last, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except FileNotFoundError:
            return None
        finally:
            os.close(parent)
