"""rootfs_net.configure: the resolver and the egress CA are written into a sandbox's root from the
host without ever following a symlink the root's author planted (a template may come from a
user's sandbox), and without reading any file of the root (the system bundle is the guest's to
extend: tests/guest/test_guest_ca.py)."""

from __future__ import annotations

import os
from pathlib import Path

from space.node.network import rootfs as rootfs_net

CA = b"-----BEGIN CERTIFICATE-----\nMIIBspaceTESTca\n-----END CERTIFICATE-----\n"
BUNDLE = b"-----BEGIN CERTIFICATE-----\nX\n-----END CERTIFICATE-----\n"


def make_root(tmp: Path) -> Path:
    root = tmp / "root"
    (root / "etc" / "ssl" / "certs").mkdir(parents=True)
    (root / "etc" / "resolv.conf").write_text("nameserver 8.8.8.8\n")
    (root / "etc" / "ssl" / "certs" / "ca-certificates.crt").write_bytes(BUNDLE)
    return root


def test_writes_resolver_and_ca_idempotently_and_leaves_the_bundle_to_the_guest(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    for _ in range(2):
        rootfs_net.configure(root, "10.208.0.1", CA)
    assert (root / "etc" / "resolv.conf").read_text().startswith("nameserver 10.208.0.1\n")
    assert (root / "etc" / "ssl" / "certs" / "ca-certificates.crt").read_bytes() == BUNDLE
    assert (root / "usr" / "local" / "share" / "ca-certificates" / rootfs_net.CA_NAME).read_bytes() == CA


def test_takes_the_root_as_a_descriptor(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        rootfs_net.configure(fd, "10.208.0.1", CA)
        os.fstat(fd)  # still the caller's: not closed
    finally:
        os.close(fd)
    assert (root / "etc" / "resolv.conf").read_text().startswith("nameserver 10.208.0.1\n")


def test_never_writes_through_a_planted_symlink(tmp_path: Path) -> None:
    host = tmp_path / "host-secret"
    host.write_text("host file\n")
    root = make_root(tmp_path)
    # resolv.conf aimed at a host file: replaced, the host file untouched.
    (root / "etc" / "resolv.conf").unlink()
    os.symlink(host, root / "etc" / "resolv.conf")
    # The bundle aimed at the host file too: left alone.
    bundle = root / "etc" / "ssl" / "certs" / "ca-certificates.crt"
    bundle.unlink()
    os.symlink(host, bundle)
    # A directory on the way that is a symlink to a host directory: not entered.
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    (root / "usr").mkdir()
    os.symlink(host_dir, root / "usr" / "local")
    rootfs_net.configure(root, "10.208.0.1", CA)
    assert host.read_text() == "host file\n"
    assert list(host_dir.iterdir()) == []
    assert not (root / "etc" / "resolv.conf").is_symlink()
    assert (root / "etc" / "resolv.conf").read_text().startswith("nameserver 10.208.0.1")


def test_etc_itself_a_symlink_is_left_alone(tmp_path: Path) -> None:
    host_etc = tmp_path / "host-etc"
    host_etc.mkdir()
    (host_etc / "resolv.conf").write_text("host\n")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(host_etc, root / "etc")
    rootfs_net.configure(root, "10.208.0.1", CA)
    assert (host_etc / "resolv.conf").read_text() == "host\n"
    assert sorted(p.name for p in host_etc.iterdir()) == ["resolv.conf"]
