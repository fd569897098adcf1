"""btrfs subvolume operations as ioctls on file descriptors.

The helper never hands a path string to btrfs-progs for a mutation: ``btrfs subvolume ...``
re-resolves its arguments with ``realpath``, so a directory swapped for a symlink between our check
and its use would redirect a root operation. The ioctls below act on fds the caller resolved with
:mod:`.confine`, on a *name* inside a parent fd.

Layouts and numbers follow ``include/uapi/linux/btrfs.h`` (Linux 6.x):

- ``struct btrfs_ioctl_vol_args { __s64 fd; char name[BTRFS_PATH_NAME_MAX + 1]; }`` (4096 bytes,
  BTRFS_PATH_NAME_MAX = 4087)
- ``struct btrfs_ioctl_vol_args_v2 { __s64 fd; __u64 transid; __u64 flags; union { ...; __u64
  unused[4]; }; union { char name[BTRFS_SUBVOL_NAME_MAX + 1]; __u64 devid; __u64 subvolid; }; }``
  (4096 bytes, BTRFS_SUBVOL_NAME_MAX = 4039)
- ``BTRFS_IOC_SUBVOL_CREATE    _IOW(0x94, 14, struct btrfs_ioctl_vol_args)``
- ``BTRFS_IOC_SNAP_DESTROY     _IOW(0x94, 15, struct btrfs_ioctl_vol_args)``
- ``BTRFS_IOC_SNAP_CREATE_V2   _IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2)``
- ``BTRFS_IOC_SUBVOL_GETFLAGS  _IOR(0x94, 25, __u64)``
- ``BTRFS_IOC_SUBVOL_SETFLAGS  _IOW(0x94, 26, __u64)``
- ``BTRFS_IOC_SNAP_DESTROY_V2  _IOW(0x94, 63, struct btrfs_ioctl_vol_args_v2)`` (Linux >= 5.7)
- ``BTRFS_IOC_GET_SUBVOL_ROOTREF _IOWR(0x94, 61, struct btrfs_ioctl_get_subvol_rootref_args)``:
  ``{ __u64 min_treeid; struct { __u64 treeid, dirid; } rootref[255]; __u8 num_items; __u8
  align[7]; }`` (4096 bytes; EOVERFLOW: more to come from the updated min_treeid)
- ``BTRFS_IOC_INO_LOOKUP_USER _IOWR(0x94, 62, struct btrfs_ioctl_ino_lookup_user_args)``:
  ``{ __u64 dirid, treeid; char name[BTRFS_VOL_NAME_MAX + 1]; char path[4080 - 256]; }`` (4096)
- ``BTRFS_SUBVOL_RDONLY (1ULL << 1)``
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

# <asm-generic/ioctl.h>: dir(2 bits) << 30 | size(14) << 16 | type(8) << 8 | nr(8)
_IOC_WRITE = 1
_IOC_READ = 2


def _ioc(direction: int, kind: int, nr: int, size: int) -> int:
    assert size < (1 << 14)
    return (direction << 30) | (size << 16) | (kind << 8) | nr


def _iow(kind: int, nr: int, size: int) -> int:
    return _ioc(_IOC_WRITE, kind, nr, size)


def _ior(kind: int, nr: int, size: int) -> int:
    return _ioc(_IOC_READ, kind, nr, size)


def _iowr(kind: int, nr: int, size: int) -> int:
    return _ioc(_IOC_READ | _IOC_WRITE, kind, nr, size)


BTRFS_IOCTL_MAGIC = 0x94
BTRFS_PATH_NAME_MAX = 4087
BTRFS_SUBVOL_NAME_MAX = 4039
BTRFS_SUBVOL_RDONLY = 1 << 1

_VOL_ARGS = struct.Struct(f"=q{BTRFS_PATH_NAME_MAX + 1}s")
_VOL_ARGS_V2 = struct.Struct(f"=qQQ4Q{BTRFS_SUBVOL_NAME_MAX + 1}s")
_U64 = struct.Struct("=Q")
BTRFS_VOL_NAME_MAX = 255
_MAX_ROOTREF = 255
_ROOTREF = struct.Struct(f"=Q{2 * _MAX_ROOTREF}QB7x")
_INO_LOOKUP_USER = struct.Struct(f"=QQ{BTRFS_VOL_NAME_MAX + 1}s{4080 - BTRFS_VOL_NAME_MAX - 1}s")
assert _VOL_ARGS.size == _VOL_ARGS_V2.size == _ROOTREF.size == _INO_LOOKUP_USER.size == 4096

BTRFS_IOC_SUBVOL_CREATE = _iow(BTRFS_IOCTL_MAGIC, 14, _VOL_ARGS.size)
BTRFS_IOC_SNAP_DESTROY = _iow(BTRFS_IOCTL_MAGIC, 15, _VOL_ARGS.size)
BTRFS_IOC_SNAP_CREATE_V2 = _iow(BTRFS_IOCTL_MAGIC, 23, _VOL_ARGS_V2.size)
BTRFS_IOC_SUBVOL_GETFLAGS = _ior(BTRFS_IOCTL_MAGIC, 25, _U64.size)
BTRFS_IOC_SUBVOL_SETFLAGS = _iow(BTRFS_IOCTL_MAGIC, 26, _U64.size)
BTRFS_IOC_GET_SUBVOL_ROOTREF = _iowr(BTRFS_IOCTL_MAGIC, 61, _ROOTREF.size)
BTRFS_IOC_INO_LOOKUP_USER = _iowr(BTRFS_IOCTL_MAGIC, 62, _INO_LOOKUP_USER.size)
BTRFS_IOC_SNAP_DESTROY_V2 = _iow(BTRFS_IOCTL_MAGIC, 63, _VOL_ARGS_V2.size)

#: Inode number of every subvolume's root directory (BTRFS_FIRST_FREE_OBJECTID).
SUBVOLUME_INO = 256


def _name(name: str, limit: int) -> bytes:
    raw = os.fsencode(name)
    if not raw or b"/" in raw or b"\0" in raw or raw in (b".", b"..") or len(raw) > limit:
        raise ValueError(f"not a single path component: {name!r}")
    return raw


def _call(fd: int, request: int, buf: bytearray) -> None:
    # A mutable buffer is passed to the kernel as is; an immutable one is capped at 1024 bytes.
    fcntl.ioctl(fd, request, buf, True)


def subvol_create(parent_fd: int, name: str) -> None:
    """Create an empty subvolume ``name`` in directory ``parent_fd`` (EEXIST if taken)."""
    buf = bytearray(_VOL_ARGS.pack(0, _name(name, BTRFS_PATH_NAME_MAX)))
    _call(parent_fd, BTRFS_IOC_SUBVOL_CREATE, buf)


def snapshot(src_fd: int, dst_parent_fd: int, name: str, *, readonly: bool) -> None:
    """Snapshot the subvolume open as ``src_fd`` to ``name`` in ``dst_parent_fd``."""
    flags = BTRFS_SUBVOL_RDONLY if readonly else 0
    buf = bytearray(_VOL_ARGS_V2.pack(src_fd, 0, flags, 0, 0, 0, 0, _name(name, BTRFS_SUBVOL_NAME_MAX)))
    _call(dst_parent_fd, BTRFS_IOC_SNAP_CREATE_V2, buf)


def destroy(parent_fd: int, name: str) -> None:
    """Delete subvolume ``name`` in ``parent_fd`` with its contents.

    The kernel refuses (ENOTEMPTY) while it holds nested subvolumes, and (EROFS) when the *parent*
    is a read-only subvolume; a read-only subvolume itself is deleted fine by root.
    """
    buf = bytearray(_VOL_ARGS_V2.pack(0, 0, 0, 0, 0, 0, 0, _name(name, BTRFS_SUBVOL_NAME_MAX)))
    try:
        _call(parent_fd, BTRFS_IOC_SNAP_DESTROY_V2, buf)
    except OSError as exc:
        if exc.errno not in (errno.ENOTTY, errno.EOPNOTSUPP):
            raise
        # Kernels before 5.7 know only the v1 call (same semantics, name-only).
        old = bytearray(_VOL_ARGS.pack(0, _name(name, BTRFS_PATH_NAME_MAX)))
        _call(parent_fd, BTRFS_IOC_SNAP_DESTROY, old)


def get_flags(fd: int) -> int:
    buf = bytearray(_U64.size)
    _call(fd, BTRFS_IOC_SUBVOL_GETFLAGS, buf)
    value: int = _U64.unpack(buf)[0]
    return value


def set_flags(fd: int, flags: int) -> None:
    _call(fd, BTRFS_IOC_SUBVOL_SETFLAGS, bytearray(_U64.pack(flags)))


def is_readonly(fd: int) -> bool:
    return bool(get_flags(fd) & BTRFS_SUBVOL_RDONLY)


def set_readonly(fd: int, ro: bool) -> None:
    flags = get_flags(fd)
    wanted = flags | BTRFS_SUBVOL_RDONLY if ro else flags & ~BTRFS_SUBVOL_RDONLY
    if wanted != flags:
        set_flags(fd, wanted)


def child_subvolumes(fd: int) -> list[tuple[str, str]]:
    """Subvolumes directly nested in the subvolume whose root ``fd`` is open on.

    Each is *(directory path relative to that root, "" for the root itself; its name)*, from the
    filesystem's own root refs: no tree walk, so it costs the same for a full root filesystem as
    for an empty one. The caller opens the directory confined and checks the entry again.
    """
    refs: list[tuple[int, int]] = []
    min_treeid = 0
    while True:
        buf = bytearray(_ROOTREF.pack(min_treeid, *([0] * (2 * _MAX_ROOTREF)), 0))
        try:
            _call(fd, BTRFS_IOC_GET_SUBVOL_ROOTREF, buf)
            more = False
        except OSError as exc:
            if exc.errno != errno.EOVERFLOW:  # EOVERFLOW: the buffer is full, ask again
                raise
            more = True
        values = _ROOTREF.unpack(buf)
        count = values[-1]
        pairs = values[1:-1]
        refs += [(pairs[2 * i], pairs[2 * i + 1]) for i in range(count)]
        if not more:
            break
        min_treeid = values[0]
    out = []
    for treeid, dirid in refs:
        buf = bytearray(_INO_LOOKUP_USER.pack(dirid, treeid, b"", b""))
        _call(fd, BTRFS_IOC_INO_LOOKUP_USER, buf)
        _, _, name, path = _INO_LOOKUP_USER.unpack(buf)
        out.append((os.fsdecode(path.split(b"\0", 1)[0]).rstrip("/"), os.fsdecode(name.split(b"\0", 1)[0])))
    return out
