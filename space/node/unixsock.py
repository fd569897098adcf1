"""A listening unix socket put in a directory someone else may write to, by root, without ever
chowning or chmodding a name there.

The node's socket directory (``/run/space/<h>/``) is the unprivileged agent's. A root process that
binds a socket there and then sets its group and mode by name follows whatever the agent put under
that name meanwhile: a symlink to ``/etc/shadow`` becomes ``0660`` with the agent's group. So the
socket is bound in a fresh directory only root can write (made in the same directory, so that the
final move is a rename on one filesystem, and then reached only through its descriptor), given its
mode and group there, set listening, and renamed into place: a rename replaces whatever entry holds
the name and follows nothing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NAME = "s"


def bind_listening(final: Path, *, mode: int, gid: int | None, flags: int = socket.SOCK_CLOEXEC,
                   backlog: int = 128) -> socket.socket:
    """A ``SOCK_STREAM`` unix socket listening at ``final`` (mode ``mode``, group ``gid`` when not
    None); an existing entry there is replaced."""
    parent = os.open(final.parent, _DIR)
    stage_name = f".sock-{secrets.token_hex(6)}"
    try:
        os.mkdir(stage_name, 0o700, dir_fd=parent)
        try:
            stage = os.open(stage_name, _DIR, dir_fd=parent)
            try:
                st = os.fstat(stage)
                if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
                    raise PermissionError(f"the staging directory for {final} was replaced")
                return _bind_in(stage, parent, final.name, mode=mode, gid=gid, flags=flags, backlog=backlog)
            finally:
                os.close(stage)
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(stage_name, dir_fd=parent)  # empty once the socket moved out
    finally:
        os.close(parent)


def _bind_in(stage: int, parent: int, name: str, *, mode: int, gid: int | None, flags: int,
             backlog: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | flags)
    try:
        # The magic link reaches the staging directory itself, whatever its name is by now.
        sock.bind(f"/proc/self/fd/{stage}/{_NAME}")
        os.chmod(_NAME, mode, dir_fd=stage)  # our socket, in a directory only we write to
        if gid is not None:
            os.chown(_NAME, -1, gid, dir_fd=stage, follow_symlinks=False)
        sock.listen(backlog)
        os.rename(_NAME, name, src_dir_fd=stage, dst_dir_fd=parent)
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(_NAME, dir_fd=stage)
        raise
    return sock
