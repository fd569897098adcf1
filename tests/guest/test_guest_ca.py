"""guest_ca.install: the guest daemon adds the egress CA the host left in its root to the system
bundle at boot, once; a bundle that is huge, a FIFO or missing its directory is left alone (the
guest never blocks nor reads without a bound, even on its own files)."""

from __future__ import annotations

import os
from pathlib import Path

from space.guest import guest_ca

CA = b"-----BEGIN CERTIFICATE-----\nMIIBspaceTESTca\n-----END CERTIFICATE-----\n"
BUNDLE = b"-----BEGIN CERTIFICATE-----\nX\n-----END CERTIFICATE-----"  # no final newline


def make_root(tmp: Path, bundle: bytes | None = BUNDLE, ca: bytes | None = CA) -> Path:
    root = tmp / "root"
    (root / "etc" / "ssl" / "certs").mkdir(parents=True)
    (root / "usr" / "local" / "share" / "ca-certificates").mkdir(parents=True)
    if bundle is not None:
        (root / guest_ca.BUNDLE.lstrip("/")).write_bytes(bundle)
    if ca is not None:
        (root / guest_ca.CA_FILE.lstrip("/")).write_bytes(CA)
    return root


def bundle_of(root: Path) -> bytes:
    return (root / guest_ca.BUNDLE.lstrip("/")).read_bytes()


def test_appends_once(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    assert guest_ca.install(str(root)) == "added"
    assert guest_ca.install(str(root)) == "present"
    assert bundle_of(root) == BUNDLE + b"\n" + CA


def test_no_ca_given_changes_nothing(tmp_path: Path) -> None:
    root = make_root(tmp_path, ca=None)
    assert guest_ca.install(str(root)) == "none"
    assert bundle_of(root) == BUNDLE


def test_a_missing_bundle_is_created_with_the_ca(tmp_path: Path) -> None:
    root = make_root(tmp_path, bundle=None)
    assert guest_ca.install(str(root)) == "created"
    assert bundle_of(root) == CA


def test_a_bundle_over_the_cap_or_not_a_file_is_left_alone(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    path = root / guest_ca.BUNDLE.lstrip("/")
    with open(path, "wb") as f:
        f.truncate(guest_ca.MAX_BUNDLE + 1)
    assert guest_ca.install(str(root)) == "skipped"
    assert path.stat().st_size == guest_ca.MAX_BUNDLE + 1
    path.unlink()
    os.mkfifo(path)
    assert guest_ca.install(str(root)) == "skipped"  # returns at once: a FIFO is never read


def test_a_ca_file_that_is_not_a_certificate_is_not_trusted(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / guest_ca.CA_FILE.lstrip("/")).write_bytes(b"not a certificate\n")
    assert guest_ca.install(str(root)) == "skipped"
    assert bundle_of(root) == BUNDLE
