"""The fixed scripts of template builds and the checks on their arguments.

A caller of the helper's ``template.*`` verbs picks a script by name and gives its arguments, which
are checked here against the same rules as the template spec (``space.node.templates.spec``) before
anything runs; the texts live here, never with the caller. Each runs as ``/bin/sh -c TEXT NAME
ARGS...`` inside the build sandbox (:mod:`.build_sandbox`), never on the host.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from space.errors import SpaceError
from space.node.templates.spec import _ENV_NAME, _PACKAGE, _PIP, _USER, check_abs_path, check_copy

#: The uid of a debootstrap template's user.
USER_UID: Final = 1000
HOME_RE: Final = re.compile(r"[A-Za-z0-9._/-]+")

#: Environment of debootstrap's second stage and of the base template's scripts. ``container=lxc``
#: tells debootstrap it runs in a container (no device node test: gVisor's /dev is its own); DPKG_FORCE
#: skips dpkg's fsync per file (a build that dies is thrown away whole, and under gVisor each sync is
#: a round trip to the host).
BASE_ENV: Final = {
    "LC_ALL": "C",
    "DEBIAN_FRONTEND": "noninteractive",
    "container": "lxc",
    "DPKG_FORCE": "unsafe-io",
}
#: Environment of every build step and of the build scripts.
BUILD_ENV: Final = {
    "HOME": "/root",
    "LC_ALL": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
    "DPKG_FORCE": "unsafe-io",
}
PIP_ENV: Final = {
    # bookworm's python is "externally managed" (PEP 668): a template owns its system python.
    "PIP_BREAK_SYSTEM_PACKAGES": "1",
    "PIP_ROOT_USER_ACTION": "ignore",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_PROGRESS_BAR": "off",
}

# -- the scripts ----------------------------------------------------------------------------------

# The base template's user and mount points. Arguments, never interpolation: user and home come
# from a spec.
BASE_CONFIGURE: Final = r"""
set -eu
user="$1" home="$2" sudo="$3" uid="$4"
if ! getent passwd "$user" >/dev/null; then
    useradd --create-home --home-dir "$home" --shell /bin/bash --uid "$uid" --user-group "$user"
fi
mkdir -p "$home"
chown "$user:$user" "$home"
# sudo through the guest daemon (space/guest/guest_sudo.py): setuid binaries do not work in a
# sandbox. The template's user may, as group sudo's members may on Debian (without a password).
if [ "$sudo" = sudo ]; then
    getent group sudo >/dev/null || groupadd --system sudo
    usermod --append --groups sudo "$user"
    if [ ! -e /usr/bin/sudo ]; then ln -s /opt/space/guest/sudo /usr/bin/sudo; fi
fi
# Mount point for the guest agent, bound in by the runtime.
mkdir -p /opt/space/guest
# Identity and name resolution are per sandbox (the runtime provides them), not per template;
# debootstrap copied the build host's.
rm -f /etc/hostname /etc/machine-id /var/lib/dbus/machine-id
: > /etc/resolv.conf
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' > /etc/hosts
"""

# A root unpacked from a container image: what base_configure does for SPACE's own roots, short of
# adding a user (the image's own are its users).
IMAGE_CONFIGURE: Final = r"""
set -eu
mkdir -p /opt/space/guest /etc
rm -f /etc/hostname /etc/machine-id /var/lib/dbus/machine-id
: > /etc/resolv.conf
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' > /etc/hosts
"""

# Whether the image can run the guest daemon (bound at /opt/space/guest for this command), and has
# the template's user: the daemon's own imports decide, so a missing module is named as Python names it.
IMAGE_CHECK: Final = r"""
user="$1"
if [ ! -x /usr/bin/python3 ]; then
    echo "the image has no /usr/bin/python3, which SPACE's guest daemon runs on"
    exit 3
fi
exec /usr/bin/python3 -I -S -c '
import os, sys
sys.path.insert(0, "/opt/space/guest")
try:
    for name in sorted(os.listdir("/opt/space/guest")):
        if name.endswith(".py") and name != "boot.py":
            __import__(name[:-3])
    for name in sys.modules["daemon"].LATE_IMPORTS:  # what commands import when they run
        __import__(name)
except Exception as exc:
    print(f"the image'"'"'s /usr/bin/python3 ({sys.version.split()[0]}) cannot run SPACE'"'"'s guest daemon: "
          f"{type(exc).__name__}: {exc}")
    sys.exit(4)
if sys.argv[1]:
    import pwd
    try:
        pwd.getpwnam(sys.argv[1])
    except KeyError:
        print(f"the image has no user {sys.argv[1]!r} (its /etc/passwd): set the template'"'"'s user to one it has")
        sys.exit(5)
' "$user"
"""

# A copy of an uploaded archive's files (a spec's ``run`` copy): the template's own python3 runs
# copy_archive.py, whose text is the last argument (never interpolated into the script).
COPY_ARCHIVE: Final = r"""
if [ ! -x /usr/bin/python3 ]; then
    echo "the template has no /usr/bin/python3, which copies files into it"
    exit 3
fi
exec /usr/bin/python3 -I -S -c 'import sys; exec(sys.argv.pop())' "$@"
"""
COPY_ARCHIVE_CODE: Final = (Path(__file__).parent / "copy_archive.py").read_text()
#: Where the builder writes a copy's archive in the tree (the script removes it).
STAGED_ARCHIVE: Final = re.compile(r"/\.space-copy-[0-9a-f]{16}\.tar")

BASE_CLEAN: Final = r"""
set -eu
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old /var/lib/dpkg/*-old
rm -rf /var/log/*.log /var/log/apt/* /tmp/* /var/tmp/*
"""

# No service may start during a build (there is no init; the build sandbox's end would kill it).
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


def fullmatch(pattern: re.Pattern[str]) -> Callable[[str], bool]:
    return lambda v: pattern.fullmatch(v) is not None


def copy_args_ok(args: tuple[str, ...]) -> bool:
    """ARCHIVE SRC DEST OWNER MODE WORKDIR USER, as a spec's copy has them."""
    if len(args) != 7 or not STAGED_ARCHIVE.fullmatch(args[0]):
        return False
    try:
        check_copy(dict(zip(("src", "dest", "owner", "mode", "workdir", "user"), args[1:], strict=True),
                        archive="0" * 64), "copy")
    except SpaceError:
        return False
    return True


def _args_of(count: int, *checks: Callable[[str], bool]) -> Callable[[tuple[str, ...]], bool]:
    return lambda args: len(args) == count and all(c(a) for c, a in zip(checks, args, strict=True))


@dataclass(frozen=True)
class Script:
    text: str
    args_ok: Callable[[tuple[str, ...]], bool]
    what: str
    #: $0, as the build logs name it.
    name: str
    #: Base scripts run with BASE_ENV, build scripts with BUILD_ENV.
    base: bool
    extra: tuple[str, ...] = ()
    #: Runs with the guest daemon bound read-only at /opt/space/guest.
    guest: bool = False

    def env(self) -> dict[str, str]:
        return dict(BASE_ENV if self.base else BUILD_ENV)


SCRIPTS: Final[dict[str, Script]] = {
    "base_configure": Script(BASE_CONFIGURE, _args_of(3, fullmatch(_USER), is_home, lambda v: v in ("", "sudo")),
                             "user, home, 'sudo' or ''", "configure", base=True, extra=(str(USER_UID),)),
    "base_clean": Script(BASE_CLEAN, _args_of(0), "no arguments", "clean", base=True),
    "configure": Script(CONFIGURE, _args_of(2, lambda v: not v or _USER.fullmatch(v) is not None,
                                            lambda v: not v or is_abs_path(v)),
                        "user or '', workdir or ''", "configure", base=False),
    "clean": Script(CLEAN, _args_of(0), "no arguments", "clean", base=False),
    "image_configure": Script(IMAGE_CONFIGURE, _args_of(0), "no arguments", "configure", base=True),
    "copy_archive": Script(COPY_ARCHIVE, copy_args_ok, "archive, src, dest, owner, mode, workdir, user", "copy",
                           base=False, extra=(COPY_ARCHIVE_CODE,)),
    "image_check": Script(IMAGE_CHECK, _args_of(1, lambda v: not v or _USER.fullmatch(v) is not None),
                          "user or ''", "check", base=True, guest=True),
}
STEP_KINDS: Final = ("apt", "pip", "run")


def step_args_ok(kind: str, args: tuple[str, ...]) -> bool:
    if kind == "apt":
        return bool(args) and all(_PACKAGE.fullmatch(a) for a in args)
    if kind == "pip":
        return bool(args) and all(_PIP.fullmatch(a) for a in args)
    return len(args) == 1 and bool(args[0].strip())  # run: one shell command


def step_command(kind: str, args: tuple[str, ...], env_entries: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a build step (``env_entries``: the spec's ``NAME=value``)."""
    env = dict(BUILD_ENV)
    if kind == "pip":
        env.update(PIP_ENV)
    env.update({name: value for name, _, value in (entry.partition("=") for entry in env_entries)})
    if kind == "run":
        return ["/bin/sh", "-c", "set -e\n" + args[0], "space-step"], env
    return ["/bin/sh", "-c", APT if kind == "apt" else PIP, "space-step", *args], env
