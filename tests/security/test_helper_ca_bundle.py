"""Finding 6, the root helper's half: root never parses a file the guest could have written.

Before every cold boot the helper writes the resolver and the egress CA into the sandbox's root. A
root a tenant had (a restart, a fork of a disk snapshot, a template saved from a sandbox) holds
whatever the tenant left in ``/etc/ssl/certs/ca-certificates.crt``: here a sparse file of 4 GiB, and
a FIFO. Root must not read it at all (the guest daemon appends the CA itself, size-capped, inside
gVisor: ``space.guest.guest_ca``). The helper's step runs in a child with a 1 GiB address-space
limit, as a hostile bundle would meet it; it must finish, write its own two files and leave the
bundle as the tenant left it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from space.node.network import rootfs as rootfs_net

CA = b"-----BEGIN CERTIFICATE-----\nMIIBspaceTESTca\n-----END CERTIFICATE-----\n"
REPO = Path(__file__).resolve().parents[2]

#: The helper's write, as the helper does it, in a child whose memory is capped.
CONFIGURE = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from pathlib import Path
from space.node.network import rootfs as rootfs_net
rootfs_net.configure(Path(sys.argv[1]), "10.208.0.1", sys.argv[2].encode())
print("configured")
"""


def make_root(tmp: Path) -> Path:
    root = tmp / "root"
    (root / "etc" / "ssl" / "certs").mkdir(parents=True)
    (root / "etc" / "resolv.conf").write_text("nameserver 8.8.8.8\n")
    return root


def configure_capped(root: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    return subprocess.run([sys.executable, "-c", CONFIGURE, str(root), CA.decode()], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd="/")


def test_a_huge_bundle_planted_by_the_guest_is_never_read_by_root(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    bundle = root / "etc" / "ssl" / "certs" / "ca-certificates.crt"
    with open(bundle, "wb") as f:
        f.truncate(4 << 30)  # sparse: costs no disk, 4 GiB to whoever reads it
    before = bundle.stat()

    try:
        done = configure_capped(root, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the helper's configure was still reading the guest's 4 GiB bundle after 120 s")

    assert done.returncode == 0 and "configured" in done.stdout, (
        f"the helper's configure died on the guest's bundle (exit {done.returncode}):\n{done.stderr[-2000:]}")
    after = bundle.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns), "root changed the bundle"
    assert (root / "etc" / "resolv.conf").read_text().startswith("nameserver 10.208.0.1\n")
    assert (root / Path(*rootfs_net.CA_DIR) / rootfs_net.CA_NAME).read_bytes() == CA


def test_a_fifo_planted_as_the_bundle_does_not_hang_root(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    bundle = root / "etc" / "ssl" / "certs" / "ca-certificates.crt"
    os.mkfifo(bundle)

    try:
        done = configure_capped(root, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the helper's configure blocked reading a FIFO the guest planted as its bundle")

    assert done.returncode == 0, done.stderr[-2000:]
    assert (root / Path(*rootfs_net.CA_DIR) / rootfs_net.CA_NAME).read_bytes() == CA
