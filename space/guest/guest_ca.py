"""The egress CA into the sandbox's system trust bundle, by the guest itself at boot.

The host writes the deployment's egress CA to ``/usr/local/share/ca-certificates/space-egress-ca.crt``
before a cold boot (``space.node.network.rootfs``) and never reads the bundle: it is this root's file,
and after a tenant had the root it may hold anything, of any size. Here, inside gVisor, reading it
risks nothing but this sandbox; still, both files are read only up to a cap (a bundle bigger than
any real one is left alone, untrusting the CA rather than reading gigabytes), never through a FIFO,
and the CA is appended only when the bundle does not hold it yet.

Standard library only, and cheap (a read of ~200 KB): it runs before the daemon announces itself,
so the first command already trusts the gateway.
"""

from __future__ import annotations

import os
import stat

CA_FILE = "/usr/local/share/ca-certificates/space-egress-ca.crt"
BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
#: A PEM certificate is a few KB; the host writes at most 64 KiB.
MAX_CA = 64 * 1024
#: Debian's bundle is ~220 KB; one of 16 MiB is not a trust store anyone uses.
MAX_BUNDLE = 16 << 20
_BEGIN = b"-----BEGIN CERTIFICATE-----"


def _read(path: str, limit: int) -> bytes | None:
    """The content of the regular file ``path`` if it is at most ``limit`` bytes, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a planted FIFO never blocks
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return data if len(data) <= limit else None  # it grew while read
    finally:
        os.close(fd)


def install(root: str = "/") -> str:
    """Append the egress CA to the bundle unless it is there; what happened, for the boot log:
    ``none`` (no CA given), ``present``, ``added``, ``created`` or ``skipped`` (a bundle that is
    not a regular file of a sane size, or a CA file that is not one PEM certificate)."""
    ca = _read(os.path.join(root, CA_FILE.lstrip("/")), MAX_CA)
    if ca is None:
        return "none"
    pem = ca.strip() + b"\n"
    if not pem.startswith(_BEGIN):
        return "skipped"
    bundle_path = os.path.join(root, BUNDLE.lstrip("/"))
    if not os.path.lexists(bundle_path):
        if not os.path.isdir(os.path.dirname(bundle_path)):
            return "skipped"
        with open(bundle_path, "xb") as f:
            f.write(pem)
        return "created"
    bundle = _read(bundle_path, MAX_BUNDLE)
    if bundle is None:
        return "skipped"
    if pem in bundle:
        return "present"
    fd = os.open(bundle_path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.write(fd, (b"" if bundle.endswith(b"\n") or not bundle else b"\n") + pem)
    finally:
        os.close(fd)
    return "added"
