"""Pool verbs: subvolumes and trees of the btrfs pool, named by ``REL`` and acted on by fd.

Every verb opens the pool root, resolves its ``REL`` arguments under it (:mod:`.confine`) and
mutates through btrfs ioctls and ``*at`` calls (:mod:`.btrfs_ioctl`), so neither a symlink nor a
mount planted in the agent-owned part of the pool can redirect a root operation outside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from space.errors import Conflict, InvalidPath, NotFound, RuntimeFailure
from space.node.helper import btrfs_ioctl as ioc
from space.node.helper import privileged
from space.node.helper.confine import (
    CONFINED,
    PoolRoot,
    Resolved,
    mount_id_of,
    openat2,
    parse_rel,
    umount_fd,
)
from space.node.helper.verbs import Call, HelperContext, check, verb
from space.node.storage.mountinfo import mounts

_libc = ctypes.CDLL(None, use_errno=True)

log = structlog.get_logger(__name__)

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass(frozen=True)
class RelArgs:
    rel: str


_LIMIT_MAX = 1 << 60  # bytes: beyond any pool, below the kernel's "no limit" value


@dataclass(frozen=True)
class SnapshotArgs:
    src: str
    dst: str
    readonly: bool = False
    #: A sandbox's root: born in the qgroup of every sandbox root (:data:`SANDBOXES_QGROUP`), with
    #: this limit on the bytes it writes (None: only the group's). Only while quotas are on.
    sandbox_root: bool = False
    limit_bytes: int | None = field(default=None, metadata=check(lambda v: 0 < v <= _LIMIT_MAX, "1..2**60"))


@dataclass(frozen=True)
class LimitArgs:
    rel: str
    limit_bytes: int | None = field(default=None, metadata=check(lambda v: 0 < v <= _LIMIT_MAX, "1..2**60"))


@dataclass(frozen=True)
class QuotaArgs:
    #: Bytes of the pool no sandbox root may take: the node's own work (snapshots' memory images,
    #: receives, templates, its state) always has this much.
    reserve_bytes: int = field(metadata=check(lambda v: 0 <= v <= _LIMIT_MAX, "0..2**60"))
    #: False: quotas are on already, only move the cap (the periodic call).
    enable: bool = True


#: The qgroup that holds every sandbox root's (level 1, id 1): its limit keeps the reserve free.
SANDBOXES_QGROUP = ioc.qgroup_id(1, 1)


@dataclass(frozen=True)
class ReadonlyArgs:
    rel: str
    ro: bool = True


def pool_root_of(ctx: HelperContext) -> Path:
    return ctx.pool_root if ctx.pool_root is not None else ctx.data_dir / "pool"


def _os_failure(exc: OSError, what: str, rel: str) -> Exception:
    if exc.errno == errno.EEXIST:
        return Conflict(f"already exists: {rel}", path=rel)
    if exc.errno == errno.ENOENT:
        return NotFound(f"no such pool path: {rel}", path=rel)
    return RuntimeFailure(f"{what} {rel}: {os.strerror(exc.errno or 0)}", path=rel,
                          errno=errno.errorcode.get(exc.errno or 0, str(exc.errno)))


def _open_subvolume(r: Resolved) -> int:
    """The subvolume at ``r``, open for ioctls; NotFound or InvalidPath (not a subvolume)."""
    fd = r.open()
    try:
        if os.fstat(fd).st_ino != ioc.SUBVOLUME_INO:
            raise InvalidPath(f"not a subvolume: {r.rel}", path=r.rel)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- create / snapshot / flags --------------------------------------------------------------------


def _create(root: Path, rel: str) -> None:
    with PoolRoot.open(root) as pool, pool.resolve(rel, create_parents=True) as r:
        if r.lstat() is not None:
            raise Conflict(f"already exists: {rel}", path=rel)
        try:
            ioc.subvol_create(r.parent_fd, r.name)
        except OSError as exc:
            raise _os_failure(exc, "cannot create subvolume", rel) from None


@verb("subvol.create", RelArgs, cap=60)
async def subvol_create(ctx: HelperContext, args: RelArgs, call: Call) -> dict[str, Any]:
    await asyncio.to_thread(_create, pool_root_of(ctx), args.rel)
    return {}


#: A sandbox root's quota at birth: its limit (None: none of its own) and the qgroups it joins.
RootQuota = tuple[int | None, tuple[int, ...]]


def _snapshot(root: Path, src: str, dst: str, readonly: bool, limit: RootQuota | None = None) -> None:
    with PoolRoot.open(root) as pool:
        try:
            with pool.resolve(src) as s:
                src_fd = _open_subvolume(s)
        except NotFound:
            # As before the split: a missing source is "not a subvolume", not a missing resource.
            raise InvalidPath(f"not a subvolume: {src}", path=src) from None
        try:
            with pool.resolve(dst, create_parents=True) as d:
                # An existing directory at dst would not receive the snapshot *inside* it (the
                # ioctl takes a name), but dst must be exactly the new subvolume: refuse.
                if d.lstat() is not None:
                    raise Conflict(f"already exists: {dst}", path=dst)
                try:
                    if limit is None:
                        ioc.snapshot(src_fd, d.parent_fd, d.name, readonly=readonly)
                    else:
                        ioc.snapshot(src_fd, d.parent_fd, d.name, readonly=readonly,
                                     limit_bytes=limit[0], parent_qgroups=limit[1])
                except OSError as exc:
                    if exc.errno == errno.EXDEV:
                        raise InvalidPath(f"{src} and {dst} are on different filesystems", path=dst) from None
                    raise _os_failure(exc, "cannot snapshot to", dst) from None
        finally:
            os.close(src_fd)


@verb("subvol.snapshot", SnapshotArgs, cap=60)
async def subvol_snapshot(ctx: HelperContext, args: SnapshotArgs, call: Call) -> dict[str, Any]:
    limit = (args.limit_bytes, (SANDBOXES_QGROUP,)) if args.sandbox_root else None
    await asyncio.to_thread(_snapshot, pool_root_of(ctx), args.src, args.dst, args.readonly, limit)
    return {}


# -- quotas ---------------------------------------------------------------------------------------
# Simple quotas (squota, Linux >= 6.7): every extent is charged to the subvolume that wrote it, for
# its whole life, whoever shares it later. A sandbox root made by snapshotting a template is charged
# only for what the sandbox writes (the template's extents stay the template's), and snapshotting
# the root does not uncharge it (under full qgroups, a sandbox's exclusive bytes drop as soon as a
# snapshot shares them, so "snapshot, write again" would escape the limit). Nor does squota walk
# back-references at every commit as full qgroups do. See docs/notes/quotas.md.


def _enable_quotas(root: Path, reserve: int, enable: bool) -> dict[str, Any]:
    with PoolRoot.open(root) as pool:
        fd = openat2(pool.fd, ".", _DIR, CONFINED)  # the root's fd is O_PATH: no ioctls on it
    try:
        if not enable:
            return _cap_sandboxes(fd, reserve)
        try:
            ioc.enable_simple_quota(fd)  # a no-op when a quota mode is on already
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTTY, errno.EPERM):
                raise
            return {"enabled": False, "error": f"the kernel refused simple quotas: {os.strerror(exc.errno or 0)}"}
        with contextlib.suppress(FileExistsError):
            ioc.qgroup_create(fd, SANDBOXES_QGROUP)
        return _cap_sandboxes(fd, reserve)
    finally:
        os.close(fd)


def _cap_sandboxes(fd: int, reserve: int) -> dict[str, Any]:
    """Let all sandbox roots together grow only by what is free beyond ``reserve``: the limit of
    their qgroup becomes what they hold + the pool's free bytes - ``reserve``. Templates, snapshot
    images and received streams are not in that qgroup, so the limit follows them as they come and
    go (the agent calls this again every few seconds and after each such change). The usage is the
    last commit's, so between commits the cap errs on the tight side, never the loose one."""
    st = os.fstatvfs(fd)
    free = st.f_bavail * st.f_frsize
    held = ioc.qgroup_excl(fd, SANDBOXES_QGROUP) or 0
    cap = max(held + free - reserve, 1 << 20)
    ioc.qgroup_limit(fd, SANDBOXES_QGROUP, cap)
    return {"enabled": True, "sandboxes_bytes": held, "sandboxes_limit_bytes": cap, "free_bytes": free,
            "reserve_bytes": reserve}


@verb("pool.quota", QuotaArgs, cap=120, audit=False)
async def pool_quota(ctx: HelperContext, args: QuotaArgs, call: Call) -> dict[str, Any]:
    """Turn quotas on in the pool (idempotent) and cap what all sandbox roots together may hold
    at the pool's size less ``reserve_bytes``."""
    return await asyncio.to_thread(_enable_quotas, pool_root_of(ctx), args.reserve_bytes, args.enable)


def limit_subvolume(pool: PoolRoot, fd: int, limit: int) -> bool:
    """Hold the subvolume open at ``fd`` to ``limit`` bytes of its own writes (False: quotas are
    off in this pool, nothing holds it)."""
    qgroup = ioc.qgroup_id(0, ioc.subvolume_id(fd))
    top = openat2(pool.fd, ".", _DIR, CONFINED)  # as _limit does: not through the subvolume itself
    try:
        ioc.qgroup_limit(top, qgroup, limit)
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ENOENT, errno.EINVAL):
            return False
        raise
    finally:
        os.close(top)
    return True


def _limit(root: Path, rel: str, limit: int | None) -> None:
    with PoolRoot.open(root) as pool:
        with pool.resolve(rel) as r:
            fd = _open_subvolume(r)
        try:
            qgroup = ioc.qgroup_id(0, ioc.subvolume_id(fd))
        finally:
            os.close(fd)
        # Through the top level, not the root itself: the ioctl's transaction reserves metadata in
        # the subvolume it is called on, and a root at its limit would refuse a change of it.
        top = openat2(pool.fd, ".", _DIR, CONFINED)
    try:
        ioc.qgroup_limit(top, qgroup, limit)
        with contextlib.suppress(FileExistsError):
            ioc.qgroup_assign(top, qgroup, SANDBOXES_QGROUP)
    except OSError as exc:
        raise _os_failure(exc, "cannot limit", rel) from None
    finally:
        os.close(top)


@verb("subvol.limit", LimitArgs, cap=60)
async def subvol_limit(ctx: HelperContext, args: LimitArgs, call: Call) -> dict[str, Any]:
    """Set the limit on the bytes a sandbox root writes (None: no limit of its own) and make it a
    member of the sandbox roots' qgroup."""
    await asyncio.to_thread(_limit, pool_root_of(ctx), args.rel, args.limit_bytes)
    return {}


def _flags(root: Path, rel: str, ro: bool | None) -> bool:
    with PoolRoot.open(root) as pool, pool.resolve(rel) as r:
        fd = _open_subvolume(r)
        try:
            if ro is not None:
                ioc.set_readonly(fd, ro)
            return ioc.is_readonly(fd)
        except OSError as exc:
            raise _os_failure(exc, "cannot change the flags of", rel) from None
        finally:
            os.close(fd)


@verb("subvol.set_readonly", ReadonlyArgs, cap=60)
async def subvol_set_readonly(ctx: HelperContext, args: ReadonlyArgs, call: Call) -> dict[str, Any]:
    return {"readonly": await asyncio.to_thread(_flags, pool_root_of(ctx), args.rel, args.ro)}


@verb("subvol.is_readonly", RelArgs, cap=30)
async def subvol_is_readonly(ctx: HelperContext, args: RelArgs, call: Call) -> dict[str, Any]:
    return {"readonly": await asyncio.to_thread(_flags, pool_root_of(ctx), args.rel, None)}


@verb("subvol.generation", RelArgs, cap=60, audit=False)
async def subvol_generation(ctx: HelperContext, args: RelArgs, call: Call) -> dict[str, Any]:
    """The subvolume's generation after its file system's pending writes are committed
    (``syncfs``): a backup compares it with the one its last link saw to skip a sandbox whose
    files did not change."""
    return {"generation": await asyncio.to_thread(_generation, pool_root_of(ctx), args.rel)}


def _generation(root: Path, rel: str) -> int:
    with PoolRoot.open(root) as pool, pool.resolve(rel) as r:
        fd = _open_subvolume(r)
        try:
            if _libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            return ioc.generation(fd)
        except OSError as exc:
            raise _os_failure(exc, "cannot read the generation of", rel) from None
        finally:
            os.close(fd)


# -- tree.delete ----------------------------------------------------------------------------------


def _unmount_beneath(pool: PoolRoot, path: str) -> None:
    """Unmount whatever is mounted at or below ``path``, deepest first.

    A killed debootstrap leaves its target's /proc mounted; a crashed runtime may leave mounts in
    a sandbox dir; either would make the delete fail. Each mount is reached through a confined
    open of its mount point and unmounted through that fd, after checking (by mount id) that the
    fd is on that very mount, so no path string is walked as root. Holding the fd makes the mount
    busy by definition, so it is always a lazy detach: gone from the tree at once, freed by the
    kernel when its last user (a leftover process, or our fd) goes.
    """
    prefix = path.rstrip("/") + "/"
    for _ in range(100):  # stacked mounts come off one at a time
        table = mounts()
        beneath = [m for m in table if m.target == path or m.target.startswith(prefix)]
        if not beneath:
            return
        target = max(beneath, key=lambda m: m.target.count("/")).target
        ids = {m.mount_id for m in beneath if m.target == target}
        fd = pool.open_mount_root(target)
        if fd is None:
            raise RuntimeFailure(f"cannot reach the mount at {target}", path=target)
        try:
            if mount_id_of(fd) not in ids:
                raise RuntimeFailure(f"{target} is not the mount point it was listed as", path=target)
            umount_fd(fd, lazy=True)
        except OSError as exc:
            raise RuntimeFailure(f"cannot unmount {target}: {os.strerror(exc.errno or 0)}", path=target) from None
        finally:
            os.close(fd)
        log.warning("pool.unmounted_leftover", target=target)
    raise RuntimeFailure(f"cannot clear the mounts beneath {path}", path=path)


def _open_dir(parent_fd: int, name: str) -> int:
    return openat2(parent_fd, name, _DIR, CONFINED)


def _walk_for_subvolumes(fd: int) -> list[tuple[str, str]]:
    """Subvolumes beneath directory ``fd`` as *(dir path, name)*, by walking: never descends into
    one, never follows a symlink, never crosses a mount (each directory is opened confined). Only
    for kernels without the root-ref ioctls (before 4.18)."""
    found: list[tuple[str, str]] = []

    def walk(dir_fd: int, at: str) -> None:
        for entry in list(os.scandir(dir_fd)):
            if not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_ino == ioc.SUBVOLUME_INO:
                found.append((at, entry.name))
                continue
            child = _open_dir(dir_fd, entry.name)
            try:
                walk(child, f"{at}/{entry.name}" if at else entry.name)
            finally:
                os.close(child)

    walk(fd, "")
    return found


def _nested_subvolumes(fd: int) -> list[tuple[str, str]]:
    try:
        return ioc.child_subvolumes(fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        return _walk_for_subvolumes(fd)


def _destroy_subvolume(parent_fd: int, name: str) -> None:
    """Delete subvolume ``name`` of ``parent_fd`` and every subvolume nested in it, deepest first."""
    fd = _open_dir(parent_fd, name)
    try:
        nested = _nested_subvolumes(fd)
        if nested and ioc.is_readonly(fd):
            ioc.set_readonly(fd, False)  # a read-only subvolume cannot lose an entry
        for where, child in nested:
            # The kernel named it; reach it again confined and make sure it still is a subvolume.
            holder = openat2(fd, where or ".", _DIR, CONFINED)
            try:
                if os.stat(child, dir_fd=holder, follow_symlinks=False).st_ino != ioc.SUBVOLUME_INO:
                    raise OSError(errno.EXDEV, f"{where}/{child} is no longer a subvolume")
                _destroy_subvolume(holder, child)
            finally:
                os.close(holder)
    finally:
        os.close(fd)
    # Root may delete a read-only subvolume as is (checked on 6.18: no flag change needed).
    ioc.destroy(parent_fd, name)


def _remove_plain_dir(parent_fd: int, name: str) -> None:
    """Remove plain directory ``name`` of ``parent_fd``: subvolumes in it through the ioctl, all
    else with unlinkat/rmdir by dir fd."""
    fd = _open_dir(parent_fd, name)
    try:
        for entry in list(os.scandir(fd)):
            if entry.is_dir(follow_symlinks=False):
                if entry.stat(follow_symlinks=False).st_ino == ioc.SUBVOLUME_INO:
                    _destroy_subvolume(fd, entry.name)
                else:
                    _remove_plain_dir(fd, entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _delete(root: Path, rel: str) -> None:
    parts = parse_rel(rel)
    with PoolRoot.open(root) as pool:
        try:
            parent = pool.open_dir(parts[:-1], what=rel)
        except NotFound:
            return  # a missing path is not an error
        try:
            _delete_at(pool, Resolved(parent, parts[-1], rel))
        finally:
            os.close(parent)
    log.debug("pool.deleted", rel=rel)


def delete_entry(root: Path, area: str, name: str) -> None:
    """Delete ``area/name`` of the pool like tree.delete, whatever ``name`` is (an entry listed
    from the directory, possibly one no REL would accept)."""
    with PoolRoot.open(root) as pool:
        parent = pool.open_dir((area,), what=area)
        try:
            _delete_at(pool, Resolved(parent, name, f"{area}/{name}"))
        finally:
            os.close(parent)


def _delete_at(pool: PoolRoot, r: Resolved) -> None:
    if r.lstat() is None:
        return
    _unmount_beneath(pool, r.host_path())
    st = r.lstat()
    if st is None:
        return
    try:
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(r.name, dir_fd=r.parent_fd)  # a symlink is removed, never followed
        elif st.st_ino == ioc.SUBVOLUME_INO:
            _destroy_subvolume(r.parent_fd, r.name)
        else:
            _remove_plain_dir(r.parent_fd, r.name)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV):
            raise InvalidPath(f"a link or mount appeared beneath {r.rel} while deleting it", path=r.rel) from None
        raise _os_failure(exc, "cannot delete", r.rel) from None


@verb("tree.delete", RelArgs, cap=600)
async def tree_delete(ctx: HelperContext, args: RelArgs, call: Call) -> dict[str, Any]:
    await asyncio.to_thread(_delete, pool_root_of(ctx), args.rel)
    return {}


# -- accounting -----------------------------------------------------------------------------------


@verb("subvol.du", RelArgs, cap=300)
async def subvol_du(ctx: HelperContext, args: RelArgs, call: Call) -> dict[str, Any]:
    """Bytes only ``rel`` holds (``btrfs filesystem du``'s exclusive column); None if unknown."""
    with PoolRoot.open(pool_root_of(ctx)) as pool, pool.resolve(args.rel) as r:
        fd = r.open()
    try:
        # du walks by path strings, so it gets the fd's magic link: it stays on what we resolved.
        res = await privileged.run("btrfs", "filesystem", "du", "-s", "--raw", f"/proc/self/fd/{fd}",
                                   check=False, timeout=300, pass_fds=(fd,))
    finally:
        os.close(fd)
    lines = res.text.splitlines()
    if res.returncode != 0 or len(lines) < 2:
        return {"exclusive_bytes": None}
    try:
        return {"exclusive_bytes": int(lines[1].split()[1])}
    except (IndexError, ValueError):
        return {"exclusive_bytes": None}


def _apparent_bytes(top: int) -> int:
    """Apparent size of the regular files beneath the directory fd ``top`` (closed here), walked by
    descriptor: no symlink followed, no other filesystem entered."""
    total = 0
    dev = os.fstat(top).st_dev
    stack = [top]
    try:
        while stack:
            fd = stack.pop()
            try:
                for name in os.listdir(fd):
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_size
                    elif stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
                        with contextlib.suppress(OSError):
                            stack.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                                 | os.O_CLOEXEC, dir_fd=fd))
            finally:
                os.close(fd)
    finally:
        for fd in stack:
            os.close(fd)
    return total


@verb("tree.size", RelArgs, cap=300)
async def tree_size(ctx: HelperContext, args: RelArgs, call: Call) -> dict[str, Any]:
    """Apparent size of the files in ``rel`` (a template's size as a user would count it; the agent
    cannot read all of a guest's files)."""
    with PoolRoot.open(pool_root_of(ctx)) as pool, pool.resolve(args.rel) as r:
        fd = r.open()
    return {"bytes": await asyncio.to_thread(_apparent_bytes, fd)}
