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
- ``BTRFS_IOC_GET_SUBVOL_INFO _IOR(0x94, 60, struct btrfs_ioctl_get_subvol_info_args)``: ``{ __u64
  treeid; char name[256]; __u64 parent_id, dirid, generation, flags; __u8 uuid[16], parent_uuid[16],
  received_uuid[16]; __u64 ctransid, otransid, stransid, rtransid; struct btrfs_ioctl_timespec { __u64
  sec; __u32 nsec; } ctime, otime, stime, rtime; __u64 reserved[8]; }`` (504 bytes; Linux >= 4.18)
- ``BTRFS_IOC_INO_LOOKUP_USER _IOWR(0x94, 62, struct btrfs_ioctl_ino_lookup_user_args)``:
  ``{ __u64 dirid, treeid; char name[BTRFS_VOL_NAME_MAX + 1]; char path[4080 - 256]; }`` (4096)
- ``BTRFS_SUBVOL_RDONLY (1ULL << 1)``, ``BTRFS_SUBVOL_QGROUP_INHERIT (1ULL << 2)``: the v2 args'
  first union is then ``{ __u64 size; struct btrfs_qgroup_inherit *qgroup_inherit; }``
- ``BTRFS_IOC_INO_LOOKUP       _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)``: ``{ __u64
  treeid, objectid; char name[4080]; }`` (treeid 0: the kernel fills in the fd's subvolume id)
- ``BTRFS_IOC_QUOTA_CTL        _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args { __u64 cmd, status; })``,
  ``BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA 4`` (Linux >= 6.7)
- ``BTRFS_IOC_QGROUP_ASSIGN    _IOW(0x94, 41, { __u64 assign, src, dst; })``
- ``BTRFS_IOC_QGROUP_CREATE    _IOW(0x94, 42, { __u64 create, qgroupid; })``
- ``BTRFS_IOC_QGROUP_LIMIT     _IOR(0x94, 43, { __u64 qgroupid; struct btrfs_qgroup_limit lim; })``
  (``_IOR`` in the header, though the kernel only reads it)
- ``struct btrfs_qgroup_limit { __u64 flags, max_rfer, max_excl, rsv_rfer, rsv_excl; }``,
  ``BTRFS_QGROUP_LIMIT_MAX_EXCL (1ULL << 1)``
- ``struct btrfs_qgroup_inherit { __u64 flags, num_qgroups, num_ref_copies, num_excl_copies; struct
  btrfs_qgroup_limit lim; __u64 qgroups[]; }``, ``BTRFS_QGROUP_INHERIT_SET_LIMITS (1ULL << 0)``
- ``BTRFS_IOC_TREE_SEARCH     _IOWR(0x94, 17, struct btrfs_ioctl_search_args)``: ``{ struct
  btrfs_ioctl_search_key { __u64 tree_id, min_objectid, max_objectid, min_offset, max_offset,
  min_transid, max_transid; __u32 min_type, max_type, nr_items, unused; __u64 unused1..4; }; char
  buf[4096 - 104]; }``, each result a ``{ __u64 transid, objectid, offset; __u32 type, len; }``
  header and its item; the quota tree is tree 8, a qgroup's usage its ``BTRFS_QGROUP_INFO_KEY``
  (242) item at offset qgroupid: ``{ __u64 generation, rfer, rfer_cmpr, excl, excl_cmpr; }``
- a qgroup id is ``level << 48 | id``; a subvolume's own qgroup is ``0/<subvolume id>``
"""

from __future__ import annotations

import ctypes
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
_SUBVOL_INFO = struct.Struct("=Q256s4Q16s16s16s4Q" + "QI4x" * 4 + "8Q")
assert _SUBVOL_INFO.size == 504
BTRFS_IOC_GET_SUBVOL_INFO = _ior(BTRFS_IOCTL_MAGIC, 60, _SUBVOL_INFO.size)
BTRFS_IOC_GET_SUBVOL_ROOTREF = _iowr(BTRFS_IOCTL_MAGIC, 61, _ROOTREF.size)
BTRFS_IOC_INO_LOOKUP_USER = _iowr(BTRFS_IOCTL_MAGIC, 62, _INO_LOOKUP_USER.size)
BTRFS_IOC_SNAP_DESTROY_V2 = _iow(BTRFS_IOCTL_MAGIC, 63, _VOL_ARGS_V2.size)

BTRFS_SUBVOL_QGROUP_INHERIT = 1 << 2
_VOL_ARGS_V2_INHERIT = struct.Struct(f"=qQQQQ2Q{BTRFS_SUBVOL_NAME_MAX + 1}s")  # size, pointer, unused[2]
_INO_LOOKUP = struct.Struct("=QQ4080s")
_QUOTA_CTL = struct.Struct("=QQ")
_QGROUP_ASSIGN = struct.Struct("=QQQ")
_QGROUP_CREATE = struct.Struct("=QQ")
_QGROUP_LIMIT = struct.Struct("=Q5Q")
_QGROUP_INHERIT = struct.Struct("=4Q5Q")  # without the qgroups[] that follow
assert _VOL_ARGS_V2_INHERIT.size == _INO_LOOKUP.size == 4096
BTRFS_IOC_INO_LOOKUP = _iowr(BTRFS_IOCTL_MAGIC, 18, _INO_LOOKUP.size)
BTRFS_IOC_QUOTA_CTL = _iowr(BTRFS_IOCTL_MAGIC, 40, _QUOTA_CTL.size)
BTRFS_IOC_QGROUP_ASSIGN = _iow(BTRFS_IOCTL_MAGIC, 41, _QGROUP_ASSIGN.size)
BTRFS_IOC_QGROUP_CREATE = _iow(BTRFS_IOCTL_MAGIC, 42, _QGROUP_CREATE.size)
BTRFS_IOC_QGROUP_LIMIT = _ior(BTRFS_IOCTL_MAGIC, 43, _QGROUP_LIMIT.size)
_SEARCH_KEY = struct.Struct("=7Q4L4Q")
_SEARCH_HEADER = struct.Struct("=3Q2L")
_QGROUP_INFO = struct.Struct("=5Q")
BTRFS_IOC_TREE_SEARCH = _iowr(BTRFS_IOCTL_MAGIC, 17, 4096)
BTRFS_QUOTA_TREE_OBJECTID = 8
BTRFS_QGROUP_INFO_KEY = 242
BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA = 4
BTRFS_QGROUP_LIMIT_MAX_EXCL = 1 << 1
BTRFS_QGROUP_INHERIT_SET_LIMITS = 1 << 0
_CLEAR_VALUE = (1 << 64) - 1  # a limit of (u64)-1 clears it (fs/btrfs/qgroup.c)

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


def snapshot(src_fd: int, dst_parent_fd: int, name: str, *, readonly: bool,
             limit_bytes: int | None = None, parent_qgroups: tuple[int, ...] = ()) -> None:
    """Snapshot the subvolume open as ``src_fd`` to ``name`` in ``dst_parent_fd``.

    With ``limit_bytes`` or ``parent_qgroups`` (quotas enabled), the new subvolume's qgroup is born
    with that exclusive-bytes limit and as a member of those qgroups: one ioctl, so no window
    exists in which the subvolume is writable without its limit.
    """
    flags = BTRFS_SUBVOL_RDONLY if readonly else 0
    raw_name = _name(name, BTRFS_SUBVOL_NAME_MAX)
    if limit_bytes is None and not parent_qgroups:
        buf = bytearray(_VOL_ARGS_V2.pack(src_fd, 0, flags, 0, 0, 0, 0, raw_name))
        _call(dst_parent_fd, BTRFS_IOC_SNAP_CREATE_V2, buf)
        return
    lim_flags = BTRFS_QGROUP_LIMIT_MAX_EXCL if limit_bytes is not None else 0
    inherit = _QGROUP_INHERIT.pack(BTRFS_QGROUP_INHERIT_SET_LIMITS, len(parent_qgroups), 0, 0,
                                   lim_flags, 0, limit_bytes or 0, 0, 0)
    inherit += b"".join(_U64.pack(q) for q in parent_qgroups)
    held = ctypes.create_string_buffer(inherit, len(inherit))  # the kernel copies it in from here
    buf = bytearray(_VOL_ARGS_V2_INHERIT.pack(src_fd, 0, flags | BTRFS_SUBVOL_QGROUP_INHERIT, len(inherit),
                                              ctypes.addressof(held), 0, 0, raw_name))
    _call(dst_parent_fd, BTRFS_IOC_SNAP_CREATE_V2, buf)
    del held


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


def generation(fd: int) -> int:
    """The transaction that last changed the subvolume open as ``fd`` (its root item's
    generation): equal across two looks means nothing in it changed in between."""
    buf = bytearray(_SUBVOL_INFO.size)
    _call(fd, BTRFS_IOC_GET_SUBVOL_INFO, buf)
    value: int = _SUBVOL_INFO.unpack(buf)[4]
    return value


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


# -- quotas ---------------------------------------------------------------------------------------


def qgroup_id(level: int, ident: int) -> int:
    return (level << 48) | ident


def subvolume_id(fd: int) -> int:
    """The id of the subvolume ``fd`` is in (so its own qgroup is ``0/<id>``)."""
    buf = bytearray(_INO_LOOKUP.pack(0, SUBVOLUME_INO, b""))
    _call(fd, BTRFS_IOC_INO_LOOKUP, buf)
    treeid: int = _INO_LOOKUP.unpack(buf)[0]
    return treeid


def enable_simple_quota(fd: int) -> None:
    """Turn on simple quotas (squota) on the filesystem of ``fd``; EINVAL/EOPNOTSUPP before 6.7,
    and the kernel refuses while another quota mode is on."""
    _call(fd, BTRFS_IOC_QUOTA_CTL, bytearray(_QUOTA_CTL.pack(BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA, 0)))


def qgroup_create(fd: int, qgroup: int) -> None:
    """Create ``qgroup`` (EEXIST if it is there)."""
    _call(fd, BTRFS_IOC_QGROUP_CREATE, bytearray(_QGROUP_CREATE.pack(1, qgroup)))


def qgroup_assign(fd: int, member: int, parent: int) -> None:
    """Make ``member`` a child of ``parent`` (EEXIST if it is already)."""
    _call(fd, BTRFS_IOC_QGROUP_ASSIGN, bytearray(_QGROUP_ASSIGN.pack(1, member, parent)))


def qgroup_limit(fd: int, qgroup: int, max_excl: int | None) -> None:
    """Limit the exclusive bytes of ``qgroup`` (None: no limit, the kernel's CLEAR_VALUE)."""
    value = _CLEAR_VALUE if max_excl is None else max_excl
    _call(fd, BTRFS_IOC_QGROUP_LIMIT,
          bytearray(_QGROUP_LIMIT.pack(qgroup, BTRFS_QGROUP_LIMIT_MAX_EXCL, 0, value, 0, 0)))


def qgroup_excl(fd: int, qgroup: int) -> int | None:
    """The exclusive bytes ``qgroup`` holds as of the last transaction commit (None: no such
    qgroup, or quotas are off)."""
    u64_max = (1 << 64) - 1
    key = _SEARCH_KEY.pack(BTRFS_QUOTA_TREE_OBJECTID, 0, 0, qgroup, qgroup, 0, u64_max,
                           BTRFS_QGROUP_INFO_KEY, BTRFS_QGROUP_INFO_KEY, 1, 0, 0, 0, 0, 0)
    buf = bytearray(key + bytes(4096 - len(key)))
    try:
        _call(fd, BTRFS_IOC_TREE_SEARCH, buf)
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # no quota tree
            return None
        raise
    if _SEARCH_KEY.unpack_from(buf)[9] < 1:  # nr_items found
        return None
    _, _, offset, kind, length = _SEARCH_HEADER.unpack_from(buf, _SEARCH_KEY.size)
    if offset != qgroup or kind != BTRFS_QGROUP_INFO_KEY or length < _QGROUP_INFO.size:
        return None
    excl: int = _QGROUP_INFO.unpack_from(buf, _SEARCH_KEY.size + _SEARCH_HEADER.size)[3]
    return excl
