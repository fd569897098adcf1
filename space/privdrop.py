"""The unprivileged half of ``space serve``: the API and the controller run as a system user.

``space serve`` starts as root because its node agent needs root (btrfs, loop devices, mounts,
namespaces, nftables, runsc). The node agent is started first (through the root supervisor,
:mod:`space.nodesup`); then this process hands what the API writes to the service user and drops to
it for good: ``setgroups([])``, ``setresgid``, ``setresuid``, ``PR_SET_NO_NEW_PRIVS``, and a check
that root cannot be regained. Everything that parses client input then runs without privileges.

What the service user gets (see :func:`own_serve_state`):

- ``<data>/`` stays root's, group the user's, mode 0710: the user may pass through, not list it,
  and never create or rename anything in it, so the root node agent, which keeps its own state
  there, never meets a file the API planted.
- ``<data>/control/`` (0700, the user's): the SQLite database, which needs a directory of its own
  to create its ``-wal``/``-shm`` files in, and the warm-pool seed marker.
- ``<data>/{secret,master,admin}.key``: the user's, 0600 (made by root first, so that the user
  needs no write access to ``<data>/``).
- the local object store directory: root's, with POSIX ACLs giving the user's group rwx on
  every directory and rw on every file, inherited (default ACL) by whatever either side creates
  later, whatever its umask: the node agent writes snapshots there as root and the API deletes
  them, and the other way round for uploaded template streams.
- the node API socket: its directory is group-accessible (0710) to the user's group
  (``space node run --socket-group``); the socket itself is the only thing there the user may open.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import pwd
import stat
import struct
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import structlog
from sqlalchemy.engine import make_url

from space.config import ServeSettings
from space.errors import SpaceError

log = structlog.get_logger("space.privdrop")

DEFAULT_USER = "space"
CREATE_USER = f"useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {DEFAULT_USER}"
#: Files of ``<data>/`` that hold the API's secrets.
KEY_FILES = ("secret.key", "master.key", "admin.key")

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


# ---- handing the API's state to the user -----------------------------------------------------------


def control_dir(settings: ServeSettings) -> Path:
    return settings.data_dir.resolve() / "control"


def migrate_layout(settings: ServeSettings) -> None:
    """Move the database and the warm-pool seed marker of the layout before the split from
    ``<data>/`` into ``<data>/control/``; the database last, so an interrupted move ends next start."""
    data, ctl = settings.data_dir.resolve(), control_dir(settings)
    names = ["warm-pool.seeded"]
    if settings.database_url is None and (data / "space.db").exists():
        if (ctl / "space.db").exists():
            raise PrivilegeError(f"both {data / 'space.db'} and {ctl / 'space.db'} exist: keep one "
                                 "(the second is where the database lives now)")
        names += ["space.db-wal", "space.db-shm", "space.db-journal", "space.db"]
    moving = [n for n in names if (data / n).exists() and not (ctl / n).exists()]
    if not moving:
        return
    ctl.mkdir(mode=0o700, exist_ok=True)
    for name in moving:
        os.rename(data / name, ctl / name)
    log.info("layout.migrated", moved=moving, to=str(ctl))


def own_serve_state(settings: ServeSettings, user: ServiceUser, env: Mapping[str, str] | None = None) -> None:
    """As root, before the drop: give ``user`` what the API and controller write (module doc).
    ``env``: the server's environment as it started (default: this process's)."""
    data = settings.data_dir.resolve()
    os.chown(data, 0, user.gid)
    os.chmod(data, 0o710)

    ctl = control_dir(settings)
    ctl.mkdir(mode=0o700, exist_ok=True)
    _own(ctl, user, 0o700)
    for entry in ctl.iterdir():
        _give(entry, user)
    db = sqlite_path(settings)
    if db is not None and db.parent != ctl:
        if not db.parent.exists():
            db.parent.mkdir(parents=True)
            _own(db.parent, user, 0o700)
        for suffix in ("", "-wal", "-shm", "-journal"):
            _give(db.with_name(db.name + suffix), user)

    if "SPACE_MASTER_KEY" not in (os.environ if env is None else env) and not (data / "master.key").exists():
        from space.credentials import Keyring

        Keyring.load(data, env={})  # makes it, 0600
    # admin.key is written once the database holds an admin key, after the drop; the user cannot
    # create files in <data>/, so it gets an empty one to fill.
    if not (data / "admin.key").exists():
        os.close(os.open(data / "admin.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    for name in KEY_FILES:
        if (data / name).exists():
            _own(data / name, user, 0o600)

    objects = local_objects(settings)
    if objects is not None:
        objects.mkdir(parents=True, exist_ok=True)
        share_tree(objects, user.gid)


def sqlite_path(settings: ServeSettings) -> Path | None:
    url = make_url(settings.resolved_database_url())
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).expanduser().absolute()


def local_objects(settings: ServeSettings) -> Path | None:
    url = settings.resolved_object_store_url()
    if "://" in url and not url.startswith("file://"):
        return None
    return Path(url.removeprefix("file://")).expanduser().absolute()


def _own(path: Path, user: ServiceUser, mode: int) -> None:
    if path.is_symlink():
        raise PrivilegeError(f"{path} is a symbolic link: refusing to hand it to {user.name!r}", path=str(path))
    os.chown(path, user.uid, user.gid)
    os.chmod(path, mode)


def _give(path: Path, user: ServiceUser) -> None:
    """Hand a file in a directory the user can write to the user: only a plain file with one link,
    never what a link planted there points at."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid != user.uid:
        os.chown(path, user.uid, user.gid, follow_symlinks=False)


# ---- POSIX ACLs (the kernel's xattr format, <linux/posix_acl_xattr.h>) ---------------------------

_ACL_ACCESS = "system.posix_acl_access"
_ACL_DEFAULT = "system.posix_acl_default"
_USER_OBJ, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
_RWX, _RW = 7, 6


def _acl(user_obj: int, group_obj: int, gid: int, group_perm: int, other: int) -> bytes:
    # Entries sorted by tag, as the kernel requires; a named entry needs a mask.
    entries = ((_USER_OBJ, user_obj, _NO_ID), (_GROUP_OBJ, group_obj, _NO_ID), (_GROUP, group_perm, gid),
               (_MASK, group_perm | group_obj, _NO_ID), (_OTHER, other, _NO_ID))
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def acl_groups(path: Path, *, default: bool = False) -> dict[int, int]:
    """The named groups of ``path``'s access (or default) ACL: {gid: permission bits}."""
    try:
        raw = os.getxattr(path, _ACL_DEFAULT if default else _ACL_ACCESS, follow_symlinks=False)
    except OSError:
        return {}
    out = {}
    for off in range(4, len(raw) - 7, 8):
        tag, perm, ident = struct.unpack_from("<HHI", raw, off)
        if tag == _GROUP:
            out[ident] = perm
    return out


def share_tree(root: Path, gid: int) -> None:
    """Group ``gid`` may read and write everything under ``root``, also what is created there later
    by anyone (a default ACL is inherited and overrides the creator's umask). Others get nothing.
    A tree whose root already carries the default ACL is not walked again; the root is done last
    so that an interrupted walk is redone."""
    if acl_groups(root, default=True).get(gid) == _RWX:
        return
    try:
        for top, dirs, files in os.walk(root):
            here = Path(top)
            for name in files + dirs:
                p = here / name
                st = p.lstat()
                if stat.S_ISDIR(st.st_mode):
                    continue  # os.walk comes to it as a ``top``
                if stat.S_ISREG(st.st_mode):
                    m = st.st_mode
                    bits = _RW | (1 if m & stat.S_IXUSR else 0)
                    os.setxattr(p, _ACL_ACCESS, _acl((m >> 6) & 7, (m >> 3) & 7, gid, bits, m & 7),
                                follow_symlinks=False)
            if here != root:
                _share_dir(here, gid, other=here.lstat().st_mode & 7)
        _share_dir(root, gid, other=0)
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:
            raise PrivilegeError(
                f"the object store directory {root} is on a filesystem without POSIX ACLs, which "
                "let the node agent (root) and the API user share it: mount it with ACLs, use an "
                "s3:// object store, or pass --user root", path=str(root)) from e
        raise
    log.info("objects.shared", path=str(root), gid=gid)


def _share_dir(path: Path, gid: int, *, other: int) -> None:
    m = path.lstat().st_mode
    os.setxattr(path, _ACL_ACCESS, _acl((m >> 6) & 7, (m >> 3) & 7, gid, _RWX, other), follow_symlinks=False)
    os.setxattr(path, _ACL_DEFAULT, _acl(_RWX, 5, gid, _RWX, 0), follow_symlinks=False)


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


def check_access(user: ServiceUser, settings: ServeSettings) -> None:
    """After the drop: the user reaches its state and the Python installation it imports from
    (modules load lazily, long after the drop). Raise :class:`PrivilegeError` naming the fix."""
    require_code_access(user)
    db = sqlite_path(settings)
    state = [p for p in (control_dir(settings), db.parent if db else None, local_objects(settings)) if p]
    _require(user, state, os.R_OK | os.W_OK | os.X_OK, "its state")


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
