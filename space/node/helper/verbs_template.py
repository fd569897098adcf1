"""Template build verbs: begin a build, debootstrap, the fixed scripts, apt/pip/run steps and file
copies, each on a build work tree ``tmp/build-<name>@<digest16>`` of the pool.

**A build is the helper's own.** ``template.begin`` makes the work subvolume (empty, or a writable
snapshot of a read-only template) in ``tmp/``, which only root can write (``space.node.storage.ownership``;
the pool verbs refuse to create anything there), marks it with a random token in a ``trusted.*``
extended attribute (which only root can set or read) and records the token. Every other build
verb first checks that its work tree carries the token this helper recorded for it, so a tree the
agent made or swapped in by any means is refused, and so is a second debootstrap, or a debootstrap
over anything but the empty tree ``begin`` made.

**No template binary runs on the host.** ``template.debootstrap`` runs debootstrap's first stage on
the host (``--foreign``: it downloads the packages from a mirror on the helper's allowlist, checks
them against the archive's signed index and unpacks them with the host's own tools into the fresh
tree) and its second stage -- the packages' maintainer scripts -- in a build sandbox; scripts and
steps run only in build sandboxes (:mod:`.build_sandbox`). ``template.write_file`` copies the
passed fd into the tree itself, resolving the destination as if the tree were ``/``
(``RESOLVE_IN_ROOT``): a symlink in the tree can never lead outside it. Every tool and every walk
gets the tree as the descriptor the check opened, never as a path.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import secrets
import stat
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from space.errors import Conflict, InvalidPath, InvalidRequest, RuntimeFailure
from space.node.helper import btrfs_ioctl as ioc
from space.node.helper import build_sandbox, privileged, verbs_pool
from space.node.helper.build_scripts import (
    BASE_ENV,
    SCRIPTS,
    STEP_KINDS,
    fullmatch,
    is_abs_path,
    is_env_entry,
    step_args_ok,
    step_command,
)
from space.node.helper.confine import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_XDEV, PoolRoot, openat2
from space.node.helper.verbs import Call, HelperContext, check, verb
from space.node.helper.verbs_net import MAX_INDEX
from space.node.templates.spec import _MODE, _PACKAGE, _SUITE

log = structlog.get_logger(__name__)

#: The only trees a build verb acts on (made by ``template.begin``).
WORK_RE: Final = re.compile(r"tmp/build-[A-Za-z0-9][A-Za-z0-9._-]{0,127}@[0-9a-f]{16}")
#: What a build may start from: a template of the pool.
BASE_RE: Final = re.compile(r"templates/[A-Za-z0-9][A-Za-z0-9._-]{0,127}@[0-9a-f]{16}")
MIRROR_RE: Final = re.compile(r"(https?|file)://[^\s,'\"\\]+")
#: The mirror a helper allows when it is given none (the base template's). Mirrors are the
#: operator's (``--mirror``): debootstrap's first stage fetches from them on the host's network, as
#: root, and a ``file://`` one is a host directory it reads.
DEFAULT_MIRROR: Final = "http://deb.debian.org/debian"
DEBOOTSTRAP_CAP: Final = 3600.0
STEP_CAP: Final = 3600.0
SCRIPT_CAP: Final = 600.0
#: The extended attribute that marks a tree as a build this helper began (``trusted.*``: only a
#: process with CAP_SYS_ADMIN in the host's namespace can read or write it).
BUILD_XATTR: Final = "trusted.space.build"
_IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
TAIL_LINES: Final = 40


def is_work(value: str) -> bool:
    return WORK_RE.fullmatch(value) is not None


@dataclass
class _Build:
    token: bytes
    #: ``empty`` (begun from nothing: debootstrap next), ``bootstrapping``, ``ready`` (a root:
    #: scripts, steps and files), ``failed`` (a debootstrap that did not finish: delete it).
    stage: str


#: The builds this helper began, by work tree.
_BUILDS: dict[str, _Build] = {}
#: Work trees a build verb is running on: one at a time per tree.
_busy: set[str] = set()


@contextlib.contextmanager
def _exclusive(work: str) -> Iterator[None]:
    if work in _busy:
        raise Conflict(f"a build verb is already running on {work}", work=work)
    _busy.add(work)
    try:
        yield
    finally:
        _busy.discard(work)


def _open_work(ctx: HelperContext, work: str, *stages: str) -> int:
    """An ``O_RDONLY`` descriptor of the work subvolume, once it is proven to be the build this
    helper began under that name, in one of ``stages``; refused (InvalidPath, or Conflict for a
    build in the wrong stage) otherwise."""
    with PoolRoot.open(verbs_pool.pool_root_of(ctx)) as pool, pool.resolve(work) as r:
        fd = verbs_pool._open_subvolume(r)
    try:
        build = _BUILDS.get(work)
        try:
            mark = os.getxattr(fd, BUILD_XATTR)
        except OSError:
            mark = b""
        if build is None or not secrets.compare_digest(mark, build.token):
            raise InvalidPath(f"{work} is not a build this helper began (template.begin)", path=work)
        if build.stage not in stages:
            raise Conflict(f"{work} is {build.stage}: this verb needs it {' or '.join(stages)}", path=work,
                           stage=build.stage)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- template.begin -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BeginArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    #: The template to start from (a writable snapshot of it); None: an empty tree (debootstrap).
    base: str | None = field(default=None, metadata=check(fullmatch(BASE_RE), "templates/<name>@<digest16>"))


def _begin(ctx: HelperContext, work: str, base: str | None) -> None:
    token = secrets.token_bytes(32)
    with PoolRoot.open(verbs_pool.pool_root_of(ctx)) as pool:
        src = None
        if base is not None:
            with pool.resolve(base) as b:
                src = verbs_pool._open_subvolume(b)
        try:
            if src is not None and not ioc.is_readonly(src):
                raise Conflict(f"a build starts from a published (read-only) template, not {base}", path=base)
            # tmp/ is made by the pool's open; never created here through a path the agent could own.
            with pool.resolve(work) as w:
                if w.lstat() is not None:
                    raise Conflict(f"already exists: {work} (delete it first)", path=work)
                try:
                    if src is None:
                        ioc.subvol_create(w.parent_fd, w.name)
                    else:
                        ioc.snapshot(src, w.parent_fd, w.name, readonly=False)
                except OSError as exc:
                    raise verbs_pool._os_failure(exc, "cannot create the build tree", work) from None
                fd = verbs_pool._open_subvolume(w)
            try:
                os.setxattr(fd, BUILD_XATTR, token)
                if src is None:
                    os.fchmod(fd, 0o755)
                # What the build writes (an image unpacked, its steps) is bounded by the pool's quota,
                # so a layer bomb or a step that fills the disk fails this build, not the node.
                if not verbs_pool.limit_subvolume(pool, fd, ctx.build_max_bytes):
                    log.warning("template.build_unbounded", work=work,
                                reason="quotas are off in the pool: only the disk bounds this build")
            finally:
                os.close(fd)
        finally:
            if src is not None:
                os.close(src)
        _prune(pool)
    _BUILDS[work] = _Build(token, "empty" if base is None else "ready")


def _prune(pool: PoolRoot) -> None:
    """Forget the builds whose trees are gone (deleted by their caller): the record stays as small
    as the number of builds in flight."""
    for work in list(_BUILDS):
        with pool.resolve(work) as r:
            if r.lstat() is None:
                del _BUILDS[work]


@verb("template.begin", BeginArgs, cap=60)
async def template_begin(ctx: HelperContext, args: BeginArgs, call: Call) -> dict[str, Any]:
    """Start a build: the work tree, made here and recorded (see the module docstring)."""
    with _exclusive(args.work):
        await asyncio.to_thread(_begin, ctx, args.work, args.base)
    return {}


# -- template.debootstrap ---------------------------------------------------------------------------

#: debootstrap's first stage, on the host: the fresh tree (fd ``$1``) bound onto a root-only mount
#: point (``$2``) in a mount namespace of its own (it vanishes with the command), so debootstrap's
#: many path walks only ever meet root's directories and the tree the helper made.
FIRST_STAGE = (
    "unshare", "--mount", "--propagation", "private", "bash", "-c",
    'root=$1 at=$2; shift 2; mount --bind "/proc/self/fd/$root" "$at" && exec {root}<&- "$@"',
    "space-debootstrap",
)


@dataclass(frozen=True)
class DebootstrapArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    suite: str = field(metadata=check(fullmatch(_SUITE), "a Debian suite name"))
    mirror: str = field(metadata=check(fullmatch(MIRROR_RE), "an http(s):// or file:// URL"))
    packages: tuple[str, ...] = field(default=(), metadata=check(fullmatch(_PACKAGE), "Debian package names"))


def mirrors_of(ctx: HelperContext) -> tuple[str, ...]:
    return tuple(m.rstrip("/") for m in (ctx.mirrors or (DEFAULT_MIRROR,)))


@verb("template.debootstrap", DebootstrapArgs, cap=DEBOOTSTRAP_CAP, streaming=True)
async def template_debootstrap(ctx: HelperContext, args: DebootstrapArgs, call: Call) -> dict[str, Any]:
    """A minbase Debian into the empty tree ``template.begin`` made: the first stage on the host,
    the second in a build sandbox without network; lines stream, the exit code is returned."""
    if args.mirror.rstrip("/") not in mirrors_of(ctx):
        raise InvalidRequest(f"mirror {args.mirror} is not one this node builds from "
                             f"({', '.join(mirrors_of(ctx))}; the operator sets them)", mirror=args.mirror)
    with _exclusive(args.work):
        fd = await asyncio.to_thread(_open_work, ctx, args.work, "empty")
        try:
            if os.listdir(fd):
                raise Conflict(f"{args.work} is not empty: debootstrap only fills a fresh tree", path=args.work)
            build = _BUILDS[args.work]
            build.stage = "bootstrapping"
            rc = await _first_stage(ctx, fd, args, call)
            if rc == 0:
                rc = await build_sandbox.run(ctx, fd, ["/debootstrap/debootstrap", "--second-stage"], BASE_ENV,
                                             on_line=call.line, timeout=DEBOOTSTRAP_CAP)
            build.stage = "ready" if rc == 0 else "failed"
        except BaseException:
            if args.work in _BUILDS:
                _BUILDS[args.work].stage = "failed"
            raise
        finally:
            os.close(fd)
    return {"returncode": rc}


#: The host's first stage: the locale, and ``container=lxc``, without which debootstrap refuses a
#: target on a nodev mount (it tests that a device node it makes can be opened; the pool is nodev).
#: Not DPKG_FORCE: the first stage runs no dpkg.
FIRST_STAGE_ENV: Final = {k: BASE_ENV[k] for k in ("LC_ALL", "DEBIAN_FRONTEND", "container")}


async def _first_stage(ctx: HelperContext, fd: int, args: DebootstrapArgs, call: Call) -> int:
    deb_cache = ctx.cache_dir / "debootstrap"
    deb_cache.mkdir(parents=True, exist_ok=True)
    stage = ctx.data_dir / "build-bundles" / f"debootstrap-{secrets.token_hex(8)}"
    stage.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(stage.parent, 0o700)
    stage.mkdir(mode=0o700)
    try:
        argv = ["debootstrap", "--foreign", "--variant=minbase", f"--cache-dir={deb_cache}"]
        if args.packages:
            argv.append(f"--include={','.join(args.packages)}")
        argv += [args.suite, str(stage), args.mirror]
        return await privileged.stream_lines(*FIRST_STAGE, str(fd), str(stage), *argv, on_line=call.line,
                                             timeout=DEBOOTSTRAP_CAP, env=FIRST_STAGE_ENV, pass_fds=(fd,))
    finally:
        with contextlib.suppress(OSError):
            stage.rmdir()


# -- template.script / template.step --------------------------------------------------------------


@dataclass(frozen=True)
class ScriptArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    script: str = field(metadata=check(lambda v: v in SCRIPTS, f"one of {', '.join(SCRIPTS)}"))
    args: tuple[str, ...] = ()


@verb("template.script", ScriptArgs, cap=SCRIPT_CAP)
async def template_script(ctx: HelperContext, args: ScriptArgs, call: Call) -> dict[str, Any]:
    """One of the fixed scripts, in a build sandbox without network; a failure raises
    RuntimeFailure with the output's tail."""
    script = SCRIPTS[args.script]
    if not script.args_ok(args.args):
        raise InvalidRequest(f"script {args.script} takes {script.what}", script=args.script)
    tail: deque[str] = deque(maxlen=TAIL_LINES)

    async def keep(line: str) -> None:
        tail.append(line)

    argv = ["/bin/sh", "-c", script.text, script.name, *args.args, *script.extra]
    with _exclusive(args.work):
        fd = await asyncio.to_thread(_open_work, ctx, args.work, "ready")
        try:
            rc = await build_sandbox.run(ctx, fd, argv, script.env(), on_line=keep, timeout=SCRIPT_CAP,
                                         guest=script.guest)
        finally:
            os.close(fd)
    if rc != 0:
        out = "\n".join(tail)
        last = next((t for t in reversed(tail) if t.strip()), "no output")
        raise RuntimeFailure(f"build script {args.script} failed (exit {rc}): {last}", script=args.script,
                             returncode=rc, stderr=out)
    return {}


@dataclass(frozen=True)
class StepArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    kind: str = field(metadata=check(lambda v: v in STEP_KINDS, " or ".join(STEP_KINDS)))
    args: tuple[str, ...] = ()
    #: ``NAME=value`` entries added to the step's environment.
    env: tuple[str, ...] = field(default=(), metadata=check(is_env_entry, "NAME=value entries"))
    #: The node's sandbox network the step runs on (its only way out: the egress gateway, where the
    #: agent registered it with the build policy); None: no network.
    net: int | None = field(default=None, metadata=check(lambda v: 1 <= v <= MAX_INDEX, f"1..{MAX_INDEX}"))


@verb("template.step", StepArgs, cap=STEP_CAP, streaming=True)
async def template_step(ctx: HelperContext, args: StepArgs, call: Call) -> dict[str, Any]:
    """An apt install, a pip install or one shell command in a build sandbox over the work tree;
    lines stream, the exit code is returned."""
    if not step_args_ok(args.kind, args.args):
        what = {"apt": "Debian package names", "pip": "pip requirements", "run": "exactly one command"}
        raise InvalidRequest(f"a {args.kind} step takes {what[args.kind]}", kind=args.kind)
    argv, env = step_command(args.kind, args.args, args.env)
    with _exclusive(args.work):
        fd = await asyncio.to_thread(_open_work, ctx, args.work, "ready")
        try:
            rc = await build_sandbox.run(ctx, fd, argv, env, on_line=call.line, timeout=STEP_CAP, net=args.net)
        finally:
            os.close(fd)
    return {"returncode": rc}


# -- template.write_file --------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    dest: str = field(metadata=check(is_abs_path, "a normalized absolute path"))
    mode: str = field(metadata=check(fullmatch(_MODE), "four octal digits"))


def _write(tree: int, dest: str, mode: int, src: int) -> None:
    """``src``'s content to ``dest`` of the tree, as root, mode ``mode``; missing directories are
    made (0755). Paths resolve as if the tree were ``/``: its symlinks stay inside it."""
    parts = dest.strip("/").split("/")
    parent = os.dup(tree)
    try:
        for part in parts[:-1]:
            try:
                nxt = openat2(parent, part, _DIR, _IN_ROOT)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=parent)
                nxt = openat2(parent, part, _DIR, _IN_ROOT)
            os.close(parent)
            parent = nxt
        name = parts[-1]
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise Conflict(f"{dest} is a directory in the template", dest=dest)
            os.unlink(name, dir_fd=parent)  # a symlink is replaced, never written through
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=parent)
        try:
            while chunk := os.read(src, 1 << 20):
                os.write(out, chunk)  # a regular file on btrfs: no short writes
            os.fchmod(out, mode)
        finally:
            os.close(out)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP, errno.EXDEV, errno.ENOENT):
            # ENOENT: a symlink on the way that leads nowhere (inside the tree).
            raise InvalidPath(f"cannot write {dest}: a component is not a directory in the template",
                              dest=dest) from None
        raise RuntimeFailure(f"cannot write {dest} into the template: {os.strerror(exc.errno or 0)}",
                             dest=dest) from None
    finally:
        os.close(parent)


@verb("template.write_file", WriteArgs, cap=SCRIPT_CAP, fds=("stdin",))
async def template_write_file(ctx: HelperContext, args: WriteArgs, call: Call) -> dict[str, Any]:
    """Write the passed fd's content to ``dest`` in the work tree with ``mode`` (directories made)."""
    src = call.fds.get("stdin")
    if src is None:
        raise InvalidRequest("template.write_file needs the file passed as 'stdin'")
    if not stat.S_ISREG(os.fstat(src).st_mode):
        # A pipe could hold the copying thread forever (a timeout cancels the wait, not the read).
        raise InvalidRequest("template.write_file copies a regular file, not a pipe or a device")
    with _exclusive(args.work):
        fd = await asyncio.to_thread(_open_work, ctx, args.work, "ready")
        try:
            await asyncio.to_thread(_write, fd, args.dest, int(args.mode, 8), src)
        finally:
            os.close(fd)
    return {}


# -- template.finish ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FinishArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    #: Where the template is published (a read-only snapshot of the finished tree).
    dest: str = field(metadata=check(fullmatch(BASE_RE), "templates/<name>@<digest16>"))


def _finish(ctx: HelperContext, work: str, dest: str) -> None:
    # "empty": a builder of the store's other than debootstrap filled it (tests' stand-ins do).
    fd = _open_work(ctx, work, "ready", "empty")
    try:
        os.removexattr(fd, BUILD_XATTR)  # the mark is this helper's, not the template's
        _BUILDS.pop(work, None)
        with PoolRoot.open(verbs_pool.pool_root_of(ctx)) as pool, pool.resolve(dest) as d:
            if d.lstat() is not None:
                raise Conflict(f"already exists: {dest}", path=dest)
            try:
                ioc.snapshot(fd, d.parent_fd, d.name, readonly=True)
            except OSError as exc:
                raise verbs_pool._os_failure(exc, "cannot publish to", dest) from None
    finally:
        os.close(fd)


@verb("template.finish", FinishArgs, cap=60)
async def template_finish(ctx: HelperContext, args: FinishArgs, call: Call) -> dict[str, Any]:
    """Publish a finished build: a read-only snapshot of its tree at ``dest`` (the atomic publish:
    the template only ever appears complete). The work tree is no longer a build; the caller
    deletes it."""
    with _exclusive(args.work):
        await asyncio.to_thread(_finish, ctx, args.work, args.dest)
    return {}
