"""Dropping root for good: a process of SPACE becomes its service user and proves it cannot come back.

``space serve`` starts as root because its node agent needs root (btrfs, loop devices, mounts,
namespaces, nftables, runsc). The node agent is started first (through the root supervisor,
:mod:`space.nodesup`); then the API process drops to its user for good: ``setgroups([])``,
``setresgid``, ``setresuid``, ``PR_SET_NO_NEW_PRIVS``, and a check that root cannot be regained.
The node agent and the egress gateway drop the same way to theirs. Everything that parses client
input or sandbox traffic then runs without privileges.

What the API's user is given before its drop is :mod:`space.serve_state`'s business: this module
knows no settings and no database, so node-side processes use it without the control plane.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pwd
import stat
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import structlog

from space.errors import SpaceError

log = structlog.get_logger("space.privdrop")

DEFAULT_USER = "space"
CREATE_USER = f"useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {DEFAULT_USER}"

PR_SET_NO_NEW_PRIVS = 38


class PrivilegeError(SpaceError):
    """``space serve`` cannot run its API as the service user (it refuses to start)."""

    code = "privileges"
    status = 500


@dataclasses.dataclass(frozen=True)
class ServiceUser:
    name: str
    uid: int
    gid: int
    home: str


def resolve_user(name: str) -> ServiceUser | None:
    """The user the API runs as; None for root (the API then keeps root, as before the split)."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        fix = CREATE_USER if name == DEFAULT_USER else f"create the user {name!r}"
        raise PrivilegeError(
            f"the user {name!r} that space serve runs its API as does not exist: {fix} "
            "(scripts/setup-system.sh does it; `make setup` runs that), or pass --user root",
            user=name) from None
    if pw.pw_uid == 0:
        log.warning("serve.api_runs_as_root", user=name,
                    hint="the API parses client input with root privileges; use --user space")
        return None
    return ServiceUser(name=name, uid=pw.pw_uid, gid=pw.pw_gid, home=pw.pw_dir)


# ---- the drop ----------------------------------------------------------------------------------


def drop_privileges(user: ServiceUser, *, groups: Sequence[int] = ()) -> None:
    """Become ``user`` for good (real, effective and saved ids; supplementary groups ``groups``
    only), or raise :class:`PrivilegeError` (the caller must not serve then)."""
    if os.geteuid() != 0:
        raise PrivilegeError(
            f"cannot switch to the user {user.name!r}: space serve must start as root (its node "
            f"agent needs root), not as uid {os.geteuid()}", user=user.name)
    os.setgroups(list(groups))
    os.setresgid(user.gid, user.gid, user.gid)
    os.setresuid(user.uid, user.uid, user.uid)
    # The API starts no program, least of all a setuid one: no exec may grant privileges again.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise PrivilegeError(f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}")
    _verify_dropped(user, groups)
    os.environ.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
    log.info("privileges_dropped", user=user.name, uid=user.uid, gid=user.gid, groups=list(groups))


def _verify_dropped(user: ServiceUser, groups: Sequence[int] = ()) -> None:
    ids = (os.getresuid(), os.getresgid(), os.getgroups())
    want = ((user.uid,) * 3, (user.gid,) * 3)
    if ids[:2] != want or set(ids[2]) - {user.gid, *groups} or 0 in ids[2]:
        raise PrivilegeError(f"switching to {user.name!r} left uids/gids/groups {ids}", user=user.name)
    for name, regain in (("setuid", os.setuid), ("setgid", os.setgid)):
        try:
            regain(0)
        except PermissionError:
            continue
        raise PrivilegeError(f"{name}(0) succeeded after switching to {user.name!r}: refusing to serve "
                             "with a way back to root", user=user.name)
    caps = _status_fields("CapPrm", "CapEff", "CapAmb")
    if any(int(v, 16) for v in caps.values()):
        raise PrivilegeError(f"capabilities left after switching to {user.name!r}: {caps}", user=user.name)


def _status_fields(*names: str) -> dict[str, str]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in names:
            out[key] = value.strip()
    return out


def require_code_access(user: ServiceUser) -> None:
    """After the drop: the user reaches the Python installation it imports from (modules load
    lazily, long after the drop). Raise :class:`PrivilegeError` naming the fix."""
    paths = sysconfig.get_paths()
    code = [Path(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    code.append(Path(__file__).resolve().parent)
    require_access(user, code, os.R_OK | os.X_OK, "the Python installation SPACE runs from")


def require_access(user: ServiceUser, paths: Iterable[Path], mode: int, what: str) -> None:
    """After the drop: ``mode`` access to every path, or a :class:`PrivilegeError` naming the first
    directory in the way."""
    _require(user, paths, mode, what)


def _require(user: ServiceUser, paths: Iterable[Path], mode: int, what: str) -> None:
    for p in paths:
        if os.access(p, mode):
            continue
        # The first directory on the way it cannot pass (its parent it can, so stat works).
        blocker = next((a for a in reversed(p.parents) if not os.access(a, os.X_OK)), p)
        st = blocker.stat()
        shown = f"mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}, gid {st.st_gid}"
        raise PrivilegeError(
            f"the user {user.name!r} cannot reach {p} ({what}): {blocker} ({shown}) is in the way. "
            f"Let it through (for a directory on the way: chmod o+x {blocker}), put SPACE somewhere "
            "it can read, or pass --user root", path=str(p), blocker=str(blocker))
