"""The node's one btrfs filesystem: templates, sandbox roots and their snapshots all live in it.

Layout under :attr:`Pool.root`::

    templates/<name>@<digest16>        read-only subvolume (a template)
    templates/<name>@<digest16>.json   its manifest, written once the template is complete
    sandboxes/<id>/                    plain directory: rootfs subvolume, snapshots/*, bundle/, state
    tmp/                               work in progress (builds); anything here may be deleted

Where the filesystem comes from, in order: something already mounted at ``<data_dir>/pool``; a
``data_dir`` that is itself on btrfs (the pool is then a plain directory in it); a dedicated
``device``; else a sparse loop file ``<data_dir>/pool.img`` created on first start. Opening is
idempotent and serialized by a lock file, so a restart after a crash adopts the existing mount or
loop device instead of leaking a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import stat
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

import structlog

from space.errors import InvalidPath, InvalidRequest, NotFound, RuntimeFailure
from space.node.helper import privileged
from space.node.helper.backend import InProcess, Privileged
from space.node.helper.verbs import HelperContext
from space.node.storage.mountinfo import Mount, mounts

log = structlog.get_logger(__name__)

AREAS = ("templates", "sandboxes", "tmp")
#: The pool holds files a sandbox wrote: setuid-root binaries (gVisor lets a guest root chmod 4755)
#: and device nodes (debootstrap makes them, a received stream can carry any). The host must never
#: honour either: every pool, whatever its kind, is a mount with these flags (inside a sandbox
#: nothing changes: this runsc ignores the setuid bit with or without them, and a sandbox's /dev
#: is its own tmpfs). nodev is possible since no template build runs on the host any more.
POOL_FLAGS = ("nosuid", "nodev")
MOUNT_OPTIONS = ",".join(("noatime", *POOL_FLAGS))
#: Per-mount flags a remount keeps as they were (remount,bind sets all of them at once).
_KEPT_FLAGS = ("ro", "noexec", "noatime", "nodiratime", "relatime", "strictatime")
#: Inode number of every subvolume's root directory (BTRFS_FIRST_FREE_OBJECTID).
_SUBVOLUME_INO = 256
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class PoolKind(StrEnum):
    LOOP = "loop"  # we attach and mount <data_dir>/pool.img
    DEVICE = "device"  # we mount a dedicated block device
    DIRECTORY = "directory"  # data_dir already is on btrfs: nothing to mount
    MOUNTED = "mounted"  # someone else mounted a btrfs at <data_dir>/pool: never unmount it


@contextlib.asynccontextmanager
async def file_lock(
    path: Path, *, on_contended: Callable[[], Awaitable[None]] | None = None
) -> AsyncIterator[None]:
    """Exclusive ``flock`` on ``path`` across processes, waited for in a thread.

    ``on_contended`` runs once if another holder makes us wait. Closing the descriptor releases the
    lock, also when the process dies, so a crash never leaves a stale lock behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        contended = False
    except BlockingIOError:
        contended = True
    except BaseException:
        os.close(fd)
        raise
    if contended:
        try:
            if on_contended is not None:
                await on_contended()
        except BaseException:
            os.close(fd)
            raise
        waiter = asyncio.get_running_loop().run_in_executor(None, fcntl.flock, fd, fcntl.LOCK_EX)
        try:
            await asyncio.shield(waiter)
        except BaseException:
            # Cancelled while the thread waits: it may still get the lock later; let it go then.
            waiter.add_done_callback(lambda _: os.close(fd))
            raise
    try:
        yield
    finally:
        os.close(fd)


def _mount_at(path: Path) -> Mount | None:
    found = [m for m in mounts() if m.target == str(path)]
    return found[-1] if found else None  # the top of a stack of mounts is what the path shows


def _fstype_of(path: Path) -> str:
    """Filesystem type of the mount that contains ``path`` (longest mount-point prefix wins)."""
    target = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts():
        prefix = m.target.rstrip("/") + "/"
        if (target == m.target or target.startswith(prefix) or m.target == "/") and (
            best is None or len(m.target) >= len(best.target)
        ):
            best = m
    return best.fstype if best else ""


async def _harden(mounted: Mount) -> None:
    """:data:`POOL_FLAGS` on the mount at ``mounted.target`` (a remount of its per-mount flags
    only: the filesystem's own options, and its other mounts, stay as they are)."""
    if all(flag in mounted.options for flag in POOL_FLAGS):
        return
    kept = [o for o in mounted.options if o in _KEPT_FLAGS]
    await privileged.run("mount", "-o", ",".join(["remount", "bind", *kept, *POOL_FLAGS]), mounted.target)
    log.info("pool.hardened", target=mounted.target, flags=",".join(POOL_FLAGS))


def _is_self_bind(mountpoint: Path, data_dir: Path) -> bool:
    """The mount at ``mountpoint`` is a DIRECTORY pool's bind of itself: same filesystem (and
    subvolume) as the data dir, where another filesystem or subvolume mounted there would not be."""
    try:
        return os.stat(mountpoint).st_dev == os.stat(data_dir).st_dev
    except OSError:
        return False


#: ioctl LOOP_GET_STATUS64 and its struct loop_info64's leading fields: the backing file's
#: device and inode (both u64; 232 bytes in all).
_LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64_SIZE = 232


def _loop_backs(device: str, image: Path) -> bool:
    """Whether loop ``device`` is backed by the file ``image``, by the file's identity (device and
    inode). Not by the path the kernel shows: that is the path through the mount the loop was set
    up through, and a loop set up in another mount namespace (the previous container of a node
    agent's pod) shows a path relative to that mount (``/data/pool.img``), not this one's."""
    if not os.path.basename(device).startswith("loop"):
        return False
    try:
        want = os.stat(image)
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = fcntl.ioctl(fd, _LOOP_GET_STATUS64, bytes(_LOOP_INFO64_SIZE))
    except OSError:  # not a loop device, or one with nothing attached
        return False
    finally:
        os.close(fd)
    backing_dev, backing_ino = struct.unpack_from("=QQ", info)
    return (backing_dev, backing_ino) == (want.st_dev, want.st_ino)


def _same_device(a: str | Path, b: str | Path) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return stat.S_ISBLK(sa.st_mode) and stat.S_ISBLK(sb.st_mode) and sa.st_rdev == sb.st_rdev


def check_name(value: str, what: str = "name") -> str:
    """Names that become path components: no separators, no dot-dot, bounded length."""
    if not _NAME.fullmatch(value):
        raise InvalidRequest(f"invalid {what}: {value!r}", field=what)
    return value


class Pool:
    """One mounted btrfs filesystem; every path argument must lie inside :attr:`root`.

    Subvolume operations are privileged verbs (``subvol.*``, ``tree.*``) on the path relative to
    the root, run through :attr:`priv`: in this process by default, or by the root helper.
    """

    def __init__(
        self,
        root: Path,
        *,
        kind: PoolKind,
        data_dir: Path,
        image: Path | None = None,
        device: Path | None = None,
        priv: Privileged | None = None,
    ) -> None:
        self.root = root
        self.kind = kind
        self.data_dir = data_dir
        self.image = image
        self.device = device
        self.priv: Privileged = priv if priv is not None else InProcess(
            HelperContext(data_dir=data_dir, cache_dir=Path("/var/cache/space"), pool_root=root))
        #: Whether sandbox roots get disk limits (quotas on: :meth:`enable_quotas`).
        self.quotas = False
        #: Bytes of the pool sandboxes can never take (with quotas on).
        self.reserve_bytes = 0

    def __repr__(self) -> str:
        return f"Pool(root={str(self.root)!r}, kind={self.kind.value}, device={self.device})"

    # -- opening and closing -------------------------------------------------------------------

    @classmethod
    async def open(cls, data_dir: Path, *, size_gb: int = 64, device: Path | None = None,
                   priv: Privileged | None = None) -> Pool:
        """Adopt or set up the pool of ``data_dir`` (see the module docstring for the order).

        ``size_gb`` only sizes a new (sparse) loop file; an existing one is never resized. A device
        or loop file is formatted only if it holds no filesystem at all. ``priv`` runs the
        subvolume verbs (default: in this process).
        """
        data_dir = _absolute(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        async with file_lock(data_dir / "pool.lock"):
            pool = await cls._attach(data_dir, size_gb=size_gb, device=device)
            if priv is not None:
                pool.priv = priv
            for area in AREAS:
                (pool.root / area).mkdir(exist_ok=True)
        log.info("pool.opened", root=str(pool.root), kind=pool.kind.value, device=str(pool.device))
        return pool

    @classmethod
    async def _attach(cls, data_dir: Path, *, size_gb: int, device: Path | None) -> Pool:
        mountpoint = data_dir / "pool"
        image = data_dir / "pool.img"
        mounted = _mount_at(mountpoint)
        if mounted is not None:
            if mounted.fstype != "btrfs":
                raise RuntimeFailure(
                    f"{mountpoint} is a {mounted.fstype} mount, not btrfs", path=str(mountpoint)
                )
            # Adopted (after a crash, an upgrade, or the operator's own): the flags hold whatever
            # mounted it.
            await _harden(mounted)
            if _loop_backs(mounted.source, image):
                return cls(mountpoint, kind=PoolKind.LOOP, data_dir=data_dir, image=image,
                           device=Path(mounted.source))
            if device is not None and _same_device(mounted.source, device):
                return cls(mountpoint, kind=PoolKind.DEVICE, data_dir=data_dir, device=device)
            if _is_self_bind(mountpoint, data_dir):
                return cls(mountpoint, kind=PoolKind.DIRECTORY, data_dir=data_dir)
            return cls(mountpoint, kind=PoolKind.MOUNTED, data_dir=data_dir, device=Path(mounted.source))

        mountpoint.mkdir(exist_ok=True)
        if device is None and _fstype_of(data_dir) == "btrfs":
            # A plain directory of the host's btrfs: bound onto itself, so that it is a mount of
            # its own, which can carry the flags (the host's filesystem keeps its own).
            await privileged.run("mount", "--bind", str(mountpoint), str(mountpoint))
            bound = _mount_at(mountpoint)
            assert bound is not None
            await _harden(bound)
            return cls(mountpoint, kind=PoolKind.DIRECTORY, data_dir=data_dir)

        if device is not None:
            source, kind = device, PoolKind.DEVICE
        else:
            if not image.exists():
                _create_sparse(image, size_gb)
                log.info("pool.image_created", image=str(image), size_gb=size_gb)
            source, kind = await _attach_loop(image), PoolKind.LOOP
        await _ensure_btrfs(source)
        await privileged.run("mount", "-t", "btrfs", "-o", MOUNT_OPTIONS, str(source), str(mountpoint))
        return cls(mountpoint, kind=kind, data_dir=data_dir, image=image if kind is PoolKind.LOOP else None,
                   device=source)

    async def teardown(self) -> None:
        """Delete every sandbox and tmp subvolume; then unmount and detach what :meth:`open` mounted.

        Templates stay inside the pool file (a later open finds them again). A pool someone else
        mounted, or one that is a plain directory on a btrfs host, is emptied but stays mounted.
        """
        async with file_lock(self.data_dir / "pool.lock"):
            if _mount_at(self.root) is not None or self.kind is PoolKind.DIRECTORY:
                for area in ("sandboxes", "tmp"):
                    base = self.root / area
                    if base.is_dir():
                        for child in sorted(base.iterdir()):
                            try:
                                await self.delete_subvolume(child)
                            except InvalidPath as exc:  # a name no verb accepts: not ours
                                log.warning("pool.teardown_skipped", path=str(child), error=exc.message)
            if self.kind in (PoolKind.LOOP, PoolKind.DEVICE, PoolKind.DIRECTORY) and _mount_at(self.root) is not None:
                await privileged.run("umount", str(self.root))  # a DIRECTORY's is its bind onto itself
            if self.kind is PoolKind.LOOP and self.image is not None:
                for dev in await _loops_of(self.image):
                    await privileged.run("losetup", "-d", dev)
        log.info("pool.teardown", root=str(self.root), kind=self.kind.value)

    # -- subvolumes ----------------------------------------------------------------------------

    def _inside(self, path: Path) -> Path:
        """Refuse any path outside the pool: these operations delete and snapshot as root."""
        norm = Path(os.path.normpath(os.path.abspath(path)))
        if norm == self.root or self.root not in norm.parents:
            raise InvalidPath(f"path is outside the pool: {path}", path=str(path))
        return norm

    def _rel(self, path: Path) -> str:
        """``path`` as the verbs name it; they refuse (InvalidPath) what is not a valid REL."""
        return self._inside(path).relative_to(self.root).as_posix()

    async def create_subvolume(self, path: Path) -> None:
        """A new empty subvolume (missing parent directories are made); Conflict if taken."""
        await self.priv.call("subvol.create", {"rel": self._rel(path)})

    async def snapshot(self, src: Path, dst: Path, *, readonly: bool = False,
                       sandbox_root: bool = False, limit_bytes: int | None = None) -> None:
        """Snapshot subvolume ``src`` (else InvalidPath) to ``dst`` (Conflict if it exists).

        ``sandbox_root``: ``dst`` is a sandbox's root, born with its disk limit ``limit_bytes``
        (None: no limit of its own) inside the share of the pool all sandbox roots may take. The
        limit counts only what the sandbox writes, never what it shares with ``src``.
        """
        args: dict[str, Any] = {"src": self._rel(src), "dst": self._rel(dst), "readonly": readonly}
        if sandbox_root and self.quotas:
            args.update(sandbox_root=True, limit_bytes=limit_bytes)
        await self.priv.call("subvol.snapshot", args)

    # -- disk limits ---------------------------------------------------------------------------

    async def enable_quotas(self, reserve_bytes: int) -> dict[str, Any]:
        """Turn on the pool's simple quotas (per-sandbox disk limits) and cap all sandbox roots
        together at the pool's size less ``reserve_bytes``. Only on a pool this node owns (a loop
        file or a device): quotas are filesystem-wide, and a host's own btrfs is not ours to
        change. Without them (an older kernel) sandboxes run without disk limits: logged."""
        if self.kind not in (PoolKind.LOOP, PoolKind.DEVICE):
            res: dict[str, Any] = {"enabled": False, "error": f"a {self.kind.value} pool is not the node's own"}
        else:
            res = await self.priv.call("pool.quota", {"reserve_bytes": reserve_bytes})
        self.quotas = bool(res.get("enabled"))
        self.reserve_bytes = reserve_bytes
        if self.quotas:
            log.info("pool.quotas", **res)
        else:
            log.warning("pool.no_disk_limits", reason=res.get("error"))
        return res

    async def refresh_reserve(self) -> None:
        """Move the cap on all sandbox roots to what is free now less the reserve (templates,
        snapshots and deletions change what is free outside them)."""
        if self.quotas:
            await self.priv.call("pool.quota", {"reserve_bytes": self.reserve_bytes, "enable": False})

    async def set_disk_limit(self, root: Path, limit_bytes: int | None) -> None:
        """Change the disk limit of the sandbox root ``root`` (no-op while quotas are off)."""
        if self.quotas:
            await self.priv.call("subvol.limit", {"rel": self._rel(root), "limit_bytes": limit_bytes})

    async def begin_build(self, work: Path, base: Path | None = None) -> None:
        """A template build's work tree (``tmp/build-<name>@<digest16>``), made by the helper: empty,
        or a writable snapshot of the read-only template ``base``. Only such a tree takes build
        verbs (``template.*``); Conflict if it exists."""
        await self.priv.call("template.begin", {"work": self._rel(work),
                                                "base": self._rel(base) if base is not None else None})

    async def finish_build(self, work: Path, final: Path) -> None:
        """Publish the build at ``work`` as the read-only template ``final``."""
        await self.priv.call("template.finish", {"work": self._rel(work), "dest": self._rel(final)})

    async def delete_subvolume(self, path: Path) -> None:
        """Delete ``path`` and every subvolume beneath it, deepest first.

        ``path`` may be a subvolume or a plain directory holding subvolumes (a sandbox dir with its
        rootfs and snapshots/*), or a plain file; a missing path is not an error. Mounts left
        beneath it are unmounted first.
        """
        await self.priv.call("tree.delete", {"rel": self._rel(path)})
        log.debug("pool.deleted", path=str(path))

    async def set_readonly(self, path: Path, ro: bool = True) -> None:
        await self.priv.call("subvol.set_readonly", {"rel": self._rel(path), "ro": ro})

    async def is_readonly(self, path: Path) -> bool:
        res = await self.priv.call("subvol.is_readonly", {"rel": self._rel(path)})
        return bool(res["readonly"])

    async def generation(self, path: Path) -> int:
        """The subvolume's generation once pending writes are committed: unchanged between two
        calls means its files did not change."""
        res = await self.priv.call("subvol.generation", {"rel": self._rel(path)})
        return int(res["generation"])

    async def is_subvolume(self, path: Path) -> bool:
        # Needs no privilege (lstat); the verbs re-check by fd wherever it matters.
        path = self._inside(path)
        try:
            st = path.lstat()
        except FileNotFoundError:
            return False
        return stat.S_ISDIR(st.st_mode) and st.st_ino == _SUBVOLUME_INO

    # -- accounting ----------------------------------------------------------------------------

    async def usage(self) -> dict[str, int]:
        st = os.statvfs(self.root)
        size = st.f_blocks * st.f_frsize
        return {
            "size_bytes": size,
            "used_bytes": size - st.f_bfree * st.f_frsize,
            "free_bytes": st.f_bavail * st.f_frsize,
        }

    async def exclusive_bytes(self, path: Path) -> int | None:
        """Bytes only ``path`` holds (not shared with its template or snapshots); None if unknown."""
        try:
            res = await self.priv.call("subvol.du", {"rel": self._rel(path)})
        except NotFound:
            return None
        value = res.get("exclusive_bytes")
        return value if isinstance(value, int) else None

    # -- layout --------------------------------------------------------------------------------

    def template_path(self, name: str, digest: str) -> Path:
        return self.root / "templates" / f"{check_name(name, 'template name')}@{digest[:16]}"

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.root / "sandboxes" / check_name(sandbox_id, "sandbox id")

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"


def default_reserve(size_bytes: int) -> int:
    """The share of a pool no sandbox may take: 5 % of it, at least 1 GiB (at most half)."""
    return min(max(size_bytes // 20, 1 << 30), size_bytes // 2)


def _create_sparse(image: Path, size_gb: int) -> None:
    tmp = image.with_name(image.name + ".tmp")
    with open(tmp, "wb") as f:
        f.truncate(size_gb * 1024**3)
    os.replace(tmp, image)  # never leave a half-sized image under the real name


async def _loops_of(image: Path) -> list[str]:
    res = await privileged.run("losetup", "-j", str(image), "-n", "-O", "NAME")
    return [line.strip() for line in res.text.splitlines() if line.strip()]


async def _attach_loop(image: Path) -> Path:
    """The loop device backing ``image``: an existing one (left by a crash) or a new one."""
    existing = await _loops_of(image)
    if existing:
        log.info("pool.loop_reused", image=str(image), device=existing[0])
        return Path(existing[0])
    res = await privileged.run("losetup", "--find", "--show", str(image))
    return Path(res.text.strip())


async def _ensure_btrfs(source: Path) -> None:
    """mkfs.btrfs ``source`` only when it holds no filesystem at all; never reformat."""
    probe = await privileged.run("blkid", "-p", "-o", "value", "-s", "TYPE", str(source), check=False)
    fstype = probe.text.strip()
    if probe.returncode == 0:
        if fstype == "btrfs":
            return
        raise RuntimeFailure(f"{source} holds a {fstype or 'foreign'} filesystem; refusing to format it",
                             device=str(source))
    if probe.returncode != 2:  # 2: nothing found; anything else is a probe failure
        raise RuntimeFailure(f"cannot probe {source}: {probe.stderr.decode(errors='replace').strip()}",
                             device=str(source))
    await privileged.run("mkfs.btrfs", "-q", "-L", "space-pool", str(source), timeout=300)
    log.info("pool.formatted", device=str(source))


def _absolute(path: Path) -> Path:
    # Canonical, because /proc/self/mountinfo and sysfs report canonical paths.
    return Path(os.path.realpath(path))
