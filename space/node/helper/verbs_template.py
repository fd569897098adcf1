"""Template build verbs: debootstrap, the fixed configure/clean scripts, apt/pip/run steps and file
copies, each on a build work tree ``tmp/build-<name>@<digest16>`` of the pool.

The scripts live here, not with the caller: a caller picks one by name and gives its arguments,
which are checked against the same rules as the template spec (``space.node.template_spec``)
before anything runs. What runs is still the template's own ``/bin/sh``, apt and pip, as root in a
chroot (finding F6 of ``docs/notes/privilege-split.md``: not closed here; the taint refusal and
the mirror allowlist are not implemented yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Final

import structlog

from space.errors import Conflict, InvalidPath, InvalidRequest, RuntimeFailure, SpaceError
from space.node import privileged
from space.node.helper import verbs_pool
from space.node.helper.confine import PoolRoot
from space.node.helper.verbs import Call, HelperContext, check, verb
from space.node.helper.verbs_stream import run_on_fds
from space.node.template_spec import _ENV_NAME, _MODE, _PACKAGE, _PIP, _SUITE, _USER, check_abs_path

log = structlog.get_logger(__name__)

#: The only trees a build verb acts on (made by ``subvol.create`` or ``subvol.snapshot``).
WORK_RE: Final = re.compile(r"tmp/build-[A-Za-z0-9][A-Za-z0-9._-]{0,127}@[0-9a-f]{16}")
MIRROR_RE: Final = re.compile(r"(https?|file)://[^\s,'\"\\]+")
HOME_RE: Final = re.compile(r"[A-Za-z0-9._/-]+")
#: The uid of a debootstrap template's user.
USER_UID: Final = 1000
DEBOOTSTRAP_CAP: Final = 3600.0
STEP_CAP: Final = 3600.0
SCRIPT_CAP: Final = 600.0

#: Environment of debootstrap and of the base template's scripts.
CHROOT_ENV: Final = {
    "LC_ALL": "C",
    "DEBIAN_FRONTEND": "noninteractive",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
}
#: Environment of every build step (nothing of the helper's own environment leaks in).
BUILD_ENV: Final = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LC_ALL": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}
PIP_ENV: Final = {
    # bookworm's python is "externally managed" (PEP 668): a template owns its system python.
    "PIP_BREAK_SYSTEM_PACKAGES": "1",
    "PIP_ROOT_USER_ACTION": "ignore",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_PROGRESS_BAR": "off",
}
#: The build host's trust store. Build steps use the host's network, so they trust what it trusts
#: (a TLS-intercepting egress proxy's CA, say): a copy is offered at /run/space-build/ (a tmpfs of
#: the step) through SSL_CERT_FILE, PIP_CERT, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE and GIT_SSL_CAINFO,
#: leaving the template's own trust store as its packages made it.
HOST_CA: Final = "/etc/ssl/certs/ca-certificates.crt"

# -- the scripts ----------------------------------------------------------------------------------

# The base template's user and mount points; runs inside the new root (chroot). Arguments, never
# interpolation: user and home come from a spec.
BASE_CONFIGURE: Final = r"""
set -eu
user="$1" home="$2" uid="$3"
if ! getent passwd "$user" >/dev/null; then
    useradd --create-home --home-dir "$home" --shell /bin/bash --uid "$uid" --user-group "$user"
fi
mkdir -p "$home"
chown "$user:$user" "$home"
# Mount point for the guest agent, bound in by the runtime.
mkdir -p /opt/space/guest
# Identity and name resolution are per sandbox (the runtime provides them), not per template;
# debootstrap copied the build host's.
rm -f /etc/hostname /etc/machine-id /var/lib/dbus/machine-id
: > /etc/resolv.conf
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' > /etc/hosts
"""

BASE_CLEAN: Final = r"""
set -eu
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old /var/lib/dpkg/*-old
rm -rf /var/log/*.log /var/log/apt/* /tmp/* /var/tmp/*
"""

# Runs on the host inside the step's new namespaces: mount what the step needs, then chroot. The
# paths checked are inside the template; a symlink there must not redirect a mount onto the host.
ENTER: Final = r"""
set -eu
t="$1"; shift
for d in proc dev etc; do
    if [ -L "$t/$d" ] || [ ! -d "$t/$d" ]; then
        echo "space-build: /$d is not a directory in the template" >&2
        exit 97
    fi
done
mount -t proc proc "$t/proc"
mount --rbind /dev "$t/dev"
if [ -L "$t/etc/resolv.conf" ]; then rm -f "$t/etc/resolv.conf"; fi
[ -e "$t/etc/resolv.conf" ] || : > "$t/etc/resolv.conf"
mount --bind /etc/resolv.conf "$t/etc/resolv.conf"
if [ -f "$HOST_CA" ] && [ -d "$t/run" ] && [ ! -L "$t/run" ]; then
    mount -t tmpfs -o mode=0755,size=64m space-build "$t/run"
    mkdir -p "$t/run/lock" "$t/run/space-build"
    cp "$HOST_CA" "$t/run/space-build/ca-certificates.crt"
    ca=/run/space-build/ca-certificates.crt
    exec chroot "$t" /usr/bin/env -i SSL_CERT_FILE=$ca PIP_CERT=$ca REQUESTS_CA_BUNDLE=$ca CURL_CA_BUNDLE=$ca \
        GIT_SSL_CAINFO=$ca "$@"
fi
exec chroot "$t" /usr/bin/env -i "$@"
"""

# No service may start during a build (there is no init; and the PID namespace would kill it).
APT: Final = r"""
set -eu
if [ ! -e /usr/sbin/policy-rc.d ]; then
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 0755 /usr/sbin/policy-rc.d
fi
apt-get -q update
apt-get -q install -y --no-install-recommends -o Dpkg::Progress-Fancy=0 "$@"
"""

PIP: Final = r"""
set -eu
if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "installing python3-pip"
    # The apt step's lists are still there (the clean step comes last).
    ls /var/lib/apt/lists/*_Packages >/dev/null 2>&1 || apt-get -q update
    apt-get -q install -y --no-install-recommends -o Dpkg::Progress-Fancy=0 python3-pip
fi
python3 -m pip install "$@"
"""

WRITE: Final = r"""
set -eu
dest="$1" mode="$2"
mkdir -p -- "$(dirname -- "$dest")"
cat > "$dest"
chmod "$mode" "$dest"
"""

CONFIGURE: Final = r"""
set -eu
user="$1" workdir="$2"
if [ -n "$user" ] && ! getent passwd "$user" >/dev/null; then
    useradd --create-home --shell /bin/bash --user-group "$user"
fi
if [ -n "$workdir" ] && [ ! -d "$workdir" ]; then
    mkdir -p "$workdir"
    if [ -n "$user" ]; then chown "$user:" "$workdir"; fi
fi
"""

CLEAN: Final = r"""
set -eu
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old /var/lib/dpkg/*-old
rm -rf /var/log/apt/* /tmp/* /var/tmp/* /root/.cache
"""

# -- argument checks ------------------------------------------------------------------------------


def is_work(value: str) -> bool:
    return WORK_RE.fullmatch(value) is not None


def is_home(value: str) -> bool:
    return (value.startswith("/") and str(PurePosixPath(value)) == value
            and ".." not in PurePosixPath(value).parts and HOME_RE.fullmatch(value) is not None)


def is_abs_path(value: str) -> bool:
    try:
        check_abs_path(value, "path")
    except SpaceError:
        return False
    return True


def is_env_entry(value: str) -> bool:
    name, eq, _ = value.partition("=")
    return bool(eq) and _ENV_NAME.fullmatch(name) is not None


def _fullmatch(pattern: re.Pattern[str]) -> Callable[[str], bool]:
    return lambda v: pattern.fullmatch(v) is not None


def _args_of(count: int, *checks: Callable[[str], bool]) -> Callable[[tuple[str, ...]], bool]:
    return lambda args: len(args) == count and all(c(a) for c, a in zip(checks, args, strict=True))


@dataclass(frozen=True)
class _Script:
    text: str
    args_ok: Callable[[tuple[str, ...]], bool]
    what: str
    #: Base scripts run with CHROOT_ENV added to the helper's environment (as debootstrap does);
    #: build scripts with exactly BUILD_ENV (``env -i``).
    clean_env: bool
    extra: tuple[str, ...] = ()


SCRIPTS: Final[dict[str, _Script]] = {
    "base_configure": _Script(BASE_CONFIGURE, _args_of(2, _fullmatch(_USER), is_home), "user, home",
                              clean_env=False, extra=(str(USER_UID),)),
    "base_clean": _Script(BASE_CLEAN, _args_of(0), "no arguments", clean_env=False),
    "configure": _Script(CONFIGURE, _args_of(2, lambda v: not v or _USER.fullmatch(v) is not None,
                                             lambda v: not v or is_abs_path(v)),
                         "user or '', workdir or ''", clean_env=True),
    "clean": _Script(CLEAN, _args_of(0), "no arguments", clean_env=True),
}
#: $0 of each script, as the build logs name it.
_SCRIPT_NAMES: Final = {"base_configure": "configure", "base_clean": "clean", "configure": "configure",
                        "clean": "clean"}
STEP_KINDS: Final = ("apt", "pip", "run")


@dataclass(frozen=True)
class DebootstrapArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    suite: str = field(metadata=check(_fullmatch(_SUITE), "a Debian suite name"))
    mirror: str = field(metadata=check(_fullmatch(MIRROR_RE), "an http(s):// or file:// URL"))
    packages: tuple[str, ...] = field(default=(), metadata=check(_fullmatch(_PACKAGE), "Debian package names"))


@dataclass(frozen=True)
class ScriptArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    script: str = field(metadata=check(lambda v: v in SCRIPTS, f"one of {', '.join(SCRIPTS)}"))
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    kind: str = field(metadata=check(lambda v: v in STEP_KINDS, " or ".join(STEP_KINDS)))
    args: tuple[str, ...] = ()
    #: ``NAME=value`` entries added to the step's environment.
    env: tuple[str, ...] = field(default=(), metadata=check(is_env_entry, "NAME=value entries"))


@dataclass(frozen=True)
class WriteArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    dest: str = field(metadata=check(is_abs_path, "a normalized absolute path"))
    mode: str = field(metadata=check(_fullmatch(_MODE), "four octal digits"))


def _step_args_ok(kind: str, args: tuple[str, ...]) -> bool:
    if kind == "apt":
        return bool(args) and all(_PACKAGE.fullmatch(a) for a in args)
    if kind == "pip":
        return bool(args) and all(_PIP.fullmatch(a) for a in args)
    return len(args) == 1 and bool(args[0].strip())  # run: one shell command


# -- the work tree --------------------------------------------------------------------------------

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


def _work_path(ctx: HelperContext, work: str) -> str:
    """The host path of the work subvolume, resolved confined and checked to be that subvolume.

    The tools take a path, and ``tmp/`` is root-only, so the path cannot be swapped under them.
    """
    with PoolRoot.open(verbs_pool.pool_root_of(ctx)) as pool, pool.resolve(work) as r:
        fd = verbs_pool._open_subvolume(r)
        try:
            path = r.host_path()
            held = os.fstat(fd)
            seen = os.stat(path, follow_symlinks=False)
            if (held.st_dev, held.st_ino) != (seen.st_dev, seen.st_ino):
                raise InvalidPath(f"{work} moved while it was resolved", path=work)
        finally:
            os.close(fd)
    return path


def _clear_mounts(ctx: HelperContext, target: str) -> None:
    with PoolRoot.open(verbs_pool.pool_root_of(ctx)) as pool:
        verbs_pool._unmount_beneath(pool, target)


async def _after_failure(ctx: HelperContext, target: str) -> None:
    """A killed or failed debootstrap leaves its target's /proc mounted: clear it (shielded)."""
    try:
        await asyncio.shield(asyncio.to_thread(_clear_mounts, ctx, target))
    except SpaceError as exc:
        log.warning("template.unmount_failed", target=target, error=exc.message)


# -- verbs ----------------------------------------------------------------------------------------


@verb("template.debootstrap", DebootstrapArgs, cap=DEBOOTSTRAP_CAP, streaming=True)
async def template_debootstrap(ctx: HelperContext, args: DebootstrapArgs, call: Call) -> dict[str, Any]:
    """A minbase Debian into the (empty) work subvolume; lines stream, the exit code is returned."""
    with _exclusive(args.work):
        target = await asyncio.to_thread(_work_path, ctx, args.work)
        deb_cache = ctx.cache_dir / "debootstrap"
        deb_cache.mkdir(parents=True, exist_ok=True)
        argv = ["debootstrap", "--variant=minbase", f"--cache-dir={deb_cache}"]
        if args.packages:
            argv.append(f"--include={','.join(args.packages)}")
        argv += [args.suite, target, args.mirror]
        try:
            rc = await privileged.stream_lines(*argv, on_line=call.line, timeout=DEBOOTSTRAP_CAP, env=CHROOT_ENV)
        except BaseException:
            await _after_failure(ctx, target)
            raise
        if rc != 0:
            await _after_failure(ctx, target)
        return {"returncode": rc}


@verb("template.script", ScriptArgs, cap=SCRIPT_CAP)
async def template_script(ctx: HelperContext, args: ScriptArgs, call: Call) -> dict[str, Any]:
    """One of :data:`SCRIPTS` with ``/bin/sh -c`` in a chroot of the work tree (no network, no
    /proc: these only edit files); a failure raises RuntimeFailure with the stderr tail."""
    script = SCRIPTS[args.script]
    if not script.args_ok(args.args):
        raise InvalidRequest(f"script {args.script} takes {script.what}", script=args.script)
    with _exclusive(args.work):
        target = await asyncio.to_thread(_work_path, ctx, args.work)
        name = _SCRIPT_NAMES[args.script]
        if script.clean_env:
            argv = ["chroot", target, "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in BUILD_ENV.items()),
                    "/bin/sh", "-c", script.text, name, *args.args, *script.extra]
            await privileged.run(*argv, timeout=SCRIPT_CAP)
        else:
            argv = ["chroot", target, "/bin/sh", "-c", script.text, name, *args.args, *script.extra]
            await privileged.run(*argv, timeout=SCRIPT_CAP, env=CHROOT_ENV)
    return {}


@verb("template.step", StepArgs, cap=STEP_CAP, streaming=True)
async def template_step(ctx: HelperContext, args: StepArgs, call: Call) -> dict[str, Any]:
    """An apt install, a pip install or one shell command inside the work tree, in private mount and
    PID namespaces (``/proc``, ``/dev``, the host's resolv.conf and CA; all gone with the step's
    last process); lines stream, the exit code is returned."""
    if not _step_args_ok(args.kind, args.args):
        what = {"apt": "Debian package names", "pip": "pip requirements", "run": "exactly one command"}
        raise InvalidRequest(f"a {args.kind} step takes {what[args.kind]}", kind=args.kind)
    env = dict(BUILD_ENV)
    if args.kind == "pip":
        env.update(PIP_ENV)
    env.update({name: value for name, _, value in (entry.partition("=") for entry in args.env)})
    script_args: tuple[str, ...] = args.args
    if args.kind == "run":
        script, script_args = "set -e\n" + args.args[0], ()
    else:
        script = APT if args.kind == "apt" else PIP
    with _exclusive(args.work):
        target = await asyncio.to_thread(_work_path, ctx, args.work)
        argv = [
            "unshare", "--mount", "--pid", "--fork", "--propagation", "private", "--",
            "/bin/sh", "-c", ENTER, "space-build", target,
            *(f"{k}={v}" for k, v in env.items()),
            "/bin/sh", "-c", script, "space-step", *script_args,
        ]
        rc = await privileged.stream_lines(*argv, on_line=call.line, timeout=STEP_CAP, env={"HOST_CA": HOST_CA})
    return {"returncode": rc}


@verb("template.write_file", WriteArgs, cap=SCRIPT_CAP, fds=("stdin",))
async def template_write_file(ctx: HelperContext, args: WriteArgs, call: Call) -> dict[str, Any]:
    """Write the passed fd's content to ``dest`` in the work tree with ``mode`` (directories made)."""
    src = call.fds.get("stdin")
    if src is None:
        raise InvalidRequest("template.write_file needs the file passed as 'stdin'")
    with _exclusive(args.work):
        target = await asyncio.to_thread(_work_path, ctx, args.work)
        argv = ["chroot", target, "/bin/sh", "-c", WRITE, "write", args.dest, args.mode]
        rc, err = await run_on_fds(argv, stdin=src)
    if rc != 0:
        last = err.splitlines()[-1] if err else "no output"
        raise RuntimeFailure(f"command failed (exit {rc}): {' '.join(argv)}: {last}", argv=argv,
                             returncode=rc, stderr=err)
    return {}
