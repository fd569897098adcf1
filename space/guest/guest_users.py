"""Who a command or a file belongs to, and the argv that starts a command as its user."""

from __future__ import annotations

import os

if __package__:
    from . import guest_caps
    from .guest_base import GuestError
else:  # top-level inside the sandbox: daemon.py put this directory on sys.path
    import guest_caps  # type: ignore[no-redef, import-not-found]
    from guest_base import GuestError  # type: ignore[no-redef, import-not-found]

TYPE_CHECKING = False  # type checkers read it as true; importing typing costs boot time (see daemon.py)
if TYPE_CHECKING:
    from typing import Any

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class User:
    def __init__(self, uid: int, gid: int, groups: list[int], name: str, home: str) -> None:
        self.uid, self.gid, self.groups, self.name, self.home = uid, gid, groups, name, home


def resolve_user(user: Any) -> User:
    import pwd

    pw: Any = None
    if (isinstance(user, int) and not isinstance(user, bool)) or (isinstance(user, str) and user.isdigit()):
        uid = int(user)
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return User(uid, uid, [uid], str(uid), "/")
    elif isinstance(user, str) and user:
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            raise GuestError("invalid_request", f"unknown user {user!r}") from None
    else:
        raise GuestError("invalid_request", "user must be a name or a uid")
    try:
        groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    except OSError:
        groups = [pw.pw_gid]
    return User(pw.pw_uid, pw.pw_gid, groups, pw.pw_name, pw.pw_dir or "/")


_SELF: list[User] = []


def self_user() -> User:
    if not _SELF:
        try:
            _SELF.append(resolve_user(os.getuid()))
        except GuestError:
            _SELF.append(User(os.getuid(), os.getgid(), [], str(os.getuid()), "/"))
    return _SELF[0]


_owners: dict[int, str] = {}
_groups: dict[int, str] = {}


def owner_name(uid: int) -> str:
    return _name(_owners, uid, "pwd", "getpwuid", "pw_name")


def group_name(gid: int) -> str:
    return _name(_groups, gid, "grp", "getgrgid", "gr_name")


def _name(cache: dict[int, str], ident: int, module: str, lookup: str, field: str) -> str:
    """The name of a uid or gid (its number when the database has none), remembered."""
    name = cache.get(ident)
    if name is None:
        try:
            db = __import__(module)
            name = str(getattr(getattr(db, lookup)(ident), field))
        except (KeyError, ImportError):
            name = str(ident)
        cache[ident] = name
    return name


_TOOLS: dict[str, str | None] = {}


def _tool(name: str) -> str | None:
    if name not in _TOOLS:
        found = None
        for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
            if os.access(f"{d}/{name}", os.X_OK):
                found = f"{d}/{name}"
                break
        _TOOLS[name] = found
    return _TOOLS[name]


def spawn_argv(argv: list[str], user: User | None, kw: dict[str, Any], pty: bool) -> list[str]:
    """Keep subprocess on its vfork path: switching users or taking a controlling terminal in
    Popen itself forces a full fork of this daemon, ~35 ms under gVisor (vfork: ~2 ms). The static
    ``space-spawn`` beside this file (built by the node) does those steps after the exec for ~10 ms;
    util-linux's setpriv/setsid for ~24 ms; without either, Popen's own slow way is used.

    Whatever the path, the command never holds the daemon's CAP_SYS_RESOURCE (``guest_caps``):
    this thread sheds it, or a wrapper that drops it comes first, or the command is refused."""
    switch = user is not None and (user.uid, user.gid) != (os.getuid(), os.getgid())
    shed = guest_caps.shed()
    if not switch and not pty and shed:
        return argv
    # A wrapper would turn a missing program into exit 127; keep it a clean not_found.
    _require_executable(argv[0], kw["env"].get("PATH", DEFAULT_PATH), kw["cwd"])
    helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "space-spawn")
    if os.access(helper, os.X_OK):  # it drops CAP_SYS_RESOURCE itself
        pre = [helper]
        if switch and user is not None:
            pre += ["-u", str(user.uid), "-g", str(user.gid), "-G", ",".join(str(g) for g in user.groups)]
        if pty:
            pre.append("-t")  # Popen's start_new_session made the session; take the pty as its tty
        return [*pre, "--", *argv]
    setpriv = _tool("setpriv")
    if switch and user is not None:
        # Leaving uid 0 clears every capability: nothing to drop.
        if setpriv is None:
            kw.update(user=user.uid, group=user.gid, extra_groups=user.groups)
        else:
            groups = ",".join(str(g) for g in user.groups)
            argv = [setpriv, f"--reuid={user.uid}", f"--regid={user.gid}",
                    f"--groups={groups}" if groups else "--clear-groups", "--", *argv]
    elif not shed:
        if setpriv is None:
            raise GuestError("runtime_error", "cannot start a command without the daemon's CAP_SYS_RESOURCE: "
                             "this template has neither ctypes, space-spawn nor setpriv")
        argv = [setpriv, "--bounding-set=-sys_resource", "--", *argv]
    if pty:
        setsid = _tool("setsid")
        if setsid is not None and "user" not in kw:
            # setsid(1) makes the session and takes the pty (its stdin) as controlling terminal.
            kw["start_new_session"] = False
            argv = [setsid, "--ctty", "--", *argv]
    return argv


def _require_executable(prog: str, path: str, cwd: str) -> None:
    if "/" in prog:
        full = prog if prog.startswith("/") else os.path.join(cwd, prog)
        if os.access(full, os.X_OK) and not os.path.isdir(full):
            return
    else:
        for d in path.split(":"):
            full = os.path.join(d or ".", prog)
            if os.access(full, os.X_OK) and not os.path.isdir(full):
                return
    raise GuestError("not_found", f"executable not found: {prog}")


def set_ctty() -> None:  # runs in the child between fork and exec (pty commands only)
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
