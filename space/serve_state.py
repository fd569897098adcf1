"""The all-in-one server's state on disk, and what its API's service user is given of it.

``space serve`` starts as root; once its node agent is up it hands what the API writes to the
service user (here), then drops to it for good (:mod:`space.privdrop`).

What the service user gets (see :func:`own_serve_state`):

- ``<data>/`` stays root's, group the user's, mode 0710: the user may pass through, not list it,
  and never create or rename anything in it, so the root node agent, which keeps its own state
  there, never meets a file the API planted.
- ``<data>/control/`` (0700, the user's): the SQLite database, which needs a directory of its own
  to create its ``-wal``/``-shm`` files in, and the warm-pool seed marker.
- ``<data>/{secret,master,admin}.key``, ``<data>/cluster-ca.{pem,key}``: the user's, 0600 (made
  by root first, so that the user needs no write access to ``<data>/``).
- the local object store directory: root's, with POSIX ACLs giving the user's group rwx on
  every directory and rw on every file, inherited (default ACL) by whatever either side creates
  later, whatever its umask: the node agent writes snapshots there as root and the API deletes
  them, and the other way round for uploaded template streams.
- the node API socket: its directory is group-accessible (0710) to the user's group
  (``space node run --socket-group``); the socket itself is the only thing there the user may open.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path

import structlog
from sqlalchemy.engine import make_url

from space.config import ServeSettings
from space.privdrop import PrivilegeError, ServiceUser, require_access, require_code_access

log = structlog.get_logger("space.serve_state")

#: Files of ``<data>/`` that hold the API's secrets.
KEY_FILES = ("secret.key", "master.key", "admin.key", "cluster-ca.pem", "cluster-ca.key")


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


def check_access(user: ServiceUser, settings: ServeSettings) -> None:
    """After the drop: the user reaches its state and the Python installation it imports from
    (modules load lazily, long after the drop). Raise :class:`PrivilegeError` naming the fix."""
    require_code_access(user)
    db = sqlite_path(settings)
    state = [p for p in (control_dir(settings), db.parent if db else None, local_objects(settings)) if p]
    require_access(user, state, os.R_OK | os.W_OK | os.X_OK, "its state")
