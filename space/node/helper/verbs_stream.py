"""Stream verbs: ``btrfs send`` and ``btrfs receive`` on file descriptors the caller passes.

No pipeline runs here: the caller compresses (``zstd``) on its side of a pipe, so the helper never
parses a compressed object-storage stream as root, only the raw send stream, and that through
``btrfs receive -C`` (chrooted into a root-only staging directory, so a hostile stream cannot
write through a symlink it created). A received subvolume must be exactly the one the caller
named -- a stream chooses its own subvolume name (finding F5 of ``docs/notes/privilege-split.md``)
-- and only then is it moved to where the caller wants it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import re
import secrets
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from space import childenv
from space.errors import Conflict, InvalidPath, InvalidRequest, RuntimeFailure
from space.node.helper import btrfs_ioctl as ioc
from space.node.helper import verbs_pool
from space.node.helper.confine import CONFINED, PoolRoot, openat2, parse_rel
from space.node.helper.verbs import Call, HelperContext, check, verb

log = structlog.get_logger(__name__)

#: A subvolume's own name: a sandbox or snapshot id (``rootfs``), or a template ``<name>@<d16>``.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}(@[0-9a-f]{16})?")
STREAM_CAP = 1800.0
#: How much of a failed tool's stderr an error carries.
TAIL_CHARS = 2000
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_RENAME_NOREPLACE = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]


def _is_rel(value: str) -> bool:
    try:
        parse_rel(value)
    except InvalidPath:
        return False
    return True


@dataclass(frozen=True)
class SendArgs:
    rel: str = field(metadata=check(_is_rel, "a pool path"))
    parent: str | None = field(default=None, metadata=check(_is_rel, "a pool path"))


@dataclass(frozen=True)
class ReceiveArgs:
    #: The directory the subvolume lands in (``templates``, ``sandboxes/<id>/snapshots/<snap>``).
    dest: str
    name: str = field(metadata=check(lambda v: NAME_RE.fullmatch(v) is not None, "a subvolume name"))


# -- running a tool on passed fds -----------------------------------------------------------------


async def run_on_fds(argv: Sequence[str], *, stdin: int | None = None, stdout: int | None = None,
                     pass_fds: Sequence[int] = ()) -> tuple[int, str]:
    """Run ``argv`` with the given fds as stdin/stdout (else /dev/null), stderr captured; return
    its exit code and stderr tail. Cancellation (the verb's timeout, or its caller going away)
    kills the whole process group and reaps it before re-raising."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=stdin if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=stdout if stdout is not None else asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
        env=childenv.tool(),
    )
    try:
        _, err = await proc.communicate()
    except BaseException:
        await asyncio.shield(_reap(proc))
        raise
    rc = proc.returncode
    assert rc is not None
    return rc, err.decode("utf-8", "replace").strip()[-TAIL_CHARS:]


async def _reap(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, 9)
    with contextlib.suppress(ProcessLookupError):
        await proc.wait()


def _fd(call: Call, role: str, verb_name: str) -> int:
    fd = call.fds.get(role)
    if fd is None:
        raise InvalidRequest(f"{verb_name} needs an fd passed as {role!r}")
    return fd


def _failure(what: str, argv: Sequence[str], rc: int, err: str) -> RuntimeFailure:
    last = err.splitlines()[-1] if err else "no output"
    return RuntimeFailure(f"{what} failed (exit {rc}): {last}", argv=list(argv), returncode=rc, stderr=err)


# -- stream.send ----------------------------------------------------------------------------------


def _open_readonly_subvolume(pool: PoolRoot, rel: str) -> int:
    with pool.resolve(rel) as r:
        fd = verbs_pool._open_subvolume(r)
    try:
        if not ioc.is_readonly(fd):
            # btrfs send refuses it too, but only after the caller's pipe is set up: say why here.
            raise Conflict(f"only a read-only subvolume can be sent: {rel}", path=rel)
    except BaseException:
        os.close(fd)
        raise
    return fd


@verb("stream.send", SendArgs, cap=STREAM_CAP, fds=("stdout",))
async def stream_send(ctx: HelperContext, args: SendArgs, call: Call) -> dict[str, Any]:
    """``btrfs send -q [-p PARENT] REL`` into the passed fd (the raw stream: the caller compresses)."""
    out = _fd(call, "stdout", "stream.send")
    opened: list[int] = []
    try:
        with PoolRoot.open(verbs_pool.pool_root_of(ctx)) as pool:
            opened.append(_open_readonly_subvolume(pool, args.rel))
            if args.parent is not None:
                opened.append(_open_readonly_subvolume(pool, args.parent))
        src = opened[0]
        argv = ["btrfs", "send", "-q"]
        if args.parent is not None:
            argv += ["-p", f"/proc/self/fd/{opened[1]}"]
        # btrfs-progs resolves these magic links once, to what we opened confined.
        argv.append(f"/proc/self/fd/{src}")
        started = time.monotonic()
        rc, err = await run_on_fds(argv, stdout=out, pass_fds=opened)
    finally:
        for fd in opened:
            os.close(fd)
    if rc != 0:
        raise _failure(f"btrfs send of {args.rel}", argv, rc, err)
    log.info("stream.sent", rel=args.rel, parent=args.parent, seconds=round(time.monotonic() - started, 2))
    return {}


# -- stream.receive -------------------------------------------------------------------------------


def _make_staging(pool: PoolRoot) -> tuple[str, int]:
    """A fresh ``tmp/recv-<rand>`` (0700) and an fd of it."""
    tmp = pool.open_dir(("tmp",), create=True)
    try:
        name = f"recv-{secrets.token_hex(8)}"
        os.mkdir(name, 0o700, dir_fd=tmp)
        return name, openat2(tmp, name, _DIR, CONFINED)
    finally:
        os.close(tmp)


def _adopt(root: Path, staging_fd: int, dest: str, name: str) -> None:
    """Check what the receive left in the staging dir and move it to ``dest/name``."""
    # A fresh open of the dir: btrfs lists through an fd only the entries it had when opened.
    fresh = openat2(staging_fd, ".", _DIR, CONFINED)
    try:
        found = sorted(os.listdir(fresh))
    finally:
        os.close(fresh)
    if found != [name]:
        raise RuntimeFailure(f"the stream must hold exactly the subvolume {name!r}, it held {found[:5]}",
                             name=name, found=found[:5])
    st = os.stat(name, dir_fd=staging_fd, follow_symlinks=False)
    if st.st_ino != ioc.SUBVOLUME_INO or not stat.S_ISDIR(st.st_mode):
        raise RuntimeFailure(f"the stream's {name!r} is not a subvolume", name=name)
    sub = openat2(staging_fd, name, _DIR, CONFINED)
    try:
        if not ioc.is_readonly(sub):
            # btrfs receive makes it read-only only once the stream is complete.
            raise RuntimeFailure(f"the stream's {name!r} is incomplete (not read-only)", name=name)
        rel = f"{dest}/{name}"
        with PoolRoot.open(root) as pool, pool.resolve(rel) as target:
            if target.lstat() is not None:
                raise Conflict(f"already exists: {rel}", path=rel)
            # A read-only subvolume cannot change its parent directory (EROFS: its ".." entry), so
            # it is writable for the move only. The received UUID stays, so deltas still apply.
            ioc.set_readonly(sub, False)
            try:
                if _libc.renameat2(staging_fd, name.encode(), target.parent_fd, name.encode(),
                                   _RENAME_NOREPLACE) != 0:
                    err = ctypes.get_errno()
                    if err == errno.EEXIST:
                        raise Conflict(f"already exists: {rel}", path=rel)
                    raise RuntimeFailure(f"cannot move the received {name} to {dest}: {os.strerror(err)}",
                                         path=rel)
            finally:
                ioc.set_readonly(sub, True)
    finally:
        os.close(sub)


def _discard(root: Path, staging: str) -> None:
    verbs_pool._delete(root, f"tmp/{staging}")


@verb("stream.receive", ReceiveArgs, cap=STREAM_CAP, fds=("stdin",))
async def stream_receive(ctx: HelperContext, args: ReceiveArgs, call: Call) -> dict[str, Any]:
    """``btrfs receive -C -e`` of the raw stream on the passed fd into a root-only staging dir; the
    one read-only subvolume ``name`` it must produce is then moved to ``dest/name`` (which must
    not exist). On any failure, the timeout or a cancellation, nothing is left behind."""
    rel = f"{args.dest}/{args.name}"
    parse_rel(rel)  # dest and name together must name a pool path
    src = _fd(call, "stdin", "stream.receive")
    root = verbs_pool.pool_root_of(ctx)
    started = time.monotonic()
    with PoolRoot.open(root) as pool:
        staging, staging_fd = _make_staging(pool)
    try:
        argv = ["btrfs", "receive", "-C", "-e", "-E", "1", "-q", f"/proc/self/fd/{staging_fd}"]
        rc, err = await run_on_fds(argv, stdin=src, pass_fds=(staging_fd,))
        if rc != 0:
            raise _failure(f"btrfs receive of {args.name}", argv, rc, err)
        await asyncio.to_thread(_adopt, root, staging_fd, args.dest, args.name)
    finally:
        os.close(staging_fd)
        # Shielded: a cancelled receive must still not leave its staging dir (and what is in it).
        await asyncio.shield(asyncio.to_thread(_discard, root, staging))
    log.info("stream.received", rel=rel, seconds=round(time.monotonic() - started, 2))
    return {"rel": rel}
