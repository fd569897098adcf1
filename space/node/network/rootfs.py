"""Point a sandbox's root at the gateway (resolver) and hand it the egress CA, from the host,
before it boots.

Done on the host because it is ~1 ms against ~135 ms for a shell in the guest (measured on cold
creates). A root comes from a template, and a template may come from a user's sandbox: its
``/etc/resolv.conf`` or any directory on the way may be a symlink aimed at the host's own files.
So every path is walked one component at a time with ``O_NOFOLLOW`` relative to the root's
directory descriptor, and a file is replaced (unlink, then create exclusively) rather than written
through: a symlink is never followed, only removed.

Root only ever *writes* here, files whose every byte it made itself; it never reads a file of the
root. The system trust bundle (``/etc/ssl/certs/ca-certificates.crt``) is the guest's own file, of
any size and content a tenant left in it, so the CA is appended to it by the guest daemon at boot
(``space.guest.guest_ca``, size-capped, inside gVisor), where parsing it risks nothing but the
sandbox itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

#: Where the egress CA goes in a root (Debian's place for local CAs); the guest reads it from there.
CA_DIR = ("usr", "local", "share", "ca-certificates")
CA_NAME = "space-egress-ca.crt"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def _dir(root_fd: int, parts: tuple[str, ...], *, create: bool = False) -> Iterator[int | None]:
    """A descriptor of ``root/parts...`` (None if a component is missing or not a real directory)."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    yield None
                    return
                os.mkdir(part, 0o755, dir_fd=fd)
                nxt = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink or a file: not ours to follow
                    yield None
                    return
                raise
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _replace(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        os.unlink(name, dir_fd=dir_fd)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def configure(root: int | Path, gateway_ip: str, ca_pem: bytes | None) -> None:
    """Idempotent: resolv.conf names the gateway; the CA is installed where the guest daemon adds
    it to the system bundle from (:data:`CA_DIR`/:data:`CA_NAME`). ``root`` is the root's directory
    (a descriptor: the one the caller checked; it stays the caller's)."""
    root_fd = os.dup(root) if isinstance(root, int) else os.open(root, _DIR)
    try:
        with _dir(root_fd, ("etc",)) as etc:
            if etc is not None:
                _replace(etc, "resolv.conf", f"nameserver {gateway_ip}\noptions timeout:2 attempts:2\n".encode())
        if not ca_pem:
            return
        with _dir(root_fd, CA_DIR, create=True) as d:
            if d is not None:
                _replace(d, CA_NAME, ca_pem.strip() + b"\n")
    finally:
        os.close(root_fd)
