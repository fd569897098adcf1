"""The guest files every sandbox mounts (space.node.sandboxes.guest_files): prepared ahead of time,
never written into the install tree by a running node.

- ``prepare`` compiles the modules, builds ``space-spawn`` and stamps the sources' digest
- a prepared package is mounted as it is
- an unprepared (or since edited) package is left untouched: the node prepares a copy in its data
  directory, and reuses it until the sources change again
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from space.node.sandboxes import guest_files


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the guest package standing in for the installed one."""
    d = tmp_path / "site" / "guest"
    d.mkdir(parents=True)
    for f in guest_files._sources(guest_files.package_dir()):
        shutil.copy2(f, d / f.name)
    monkeypatch.setattr(guest_files, "package_dir", lambda: d)
    return d


def _tree(d: Path) -> dict[str, float]:
    return {str(p.relative_to(d)): p.stat().st_mtime for p in d.rglob("*")}


def test_prepare_compiles_builds_and_stamps(package: Path) -> None:
    guest_files.prepare(package)
    assert guest_files.prepared_from(package) == guest_files.sources_digest(package)
    assert (package / "space-spawn").stat().st_mode & 0o111
    assert any((package / "__pycache__").glob("daemon.*.pyc"))


def test_a_prepared_package_is_mounted_as_it_is(package: Path, tmp_path: Path) -> None:
    guest_files.prepare(package)
    data = tmp_path / "data"
    data.mkdir()
    assert guest_files.guest_dir(data) == package
    assert not (data / "guest").exists()


def test_an_unprepared_package_is_not_written_a_copy_is_prepared(package: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    before = _tree(package)
    got = guest_files.guest_dir(data)
    assert got == data / "guest"
    assert _tree(package) == before, "the install tree was written"
    assert guest_files.prepared_from(got) == guest_files.sources_digest(package)
    assert (got / "space-spawn").exists() and (got / "daemon.py").read_bytes() == (package / "daemon.py").read_bytes()
    # Every sandbox runs it as PID 1: nobody but its owner (root, who made it) may change it.
    for p in [got, *got.rglob("*")]:
        assert p.stat().st_uid == os.getuid() and not p.stat().st_mode & 0o022, p
    stamp = (got / guest_files.STAMP).stat().st_mtime
    assert guest_files.guest_dir(data) == got and (got / guest_files.STAMP).stat().st_mtime == stamp  # reused

    # An edited source: a fresh copy, still nothing written into the package.
    (package / "daemon.py").write_text((package / "daemon.py").read_text() + "\n# edited\n")
    before = _tree(package)
    again = guest_files.guest_dir(data)
    assert again == got and (again / "daemon.py").read_text().endswith("# edited\n")
    assert guest_files.prepared_from(again) == guest_files.sources_digest(package)
    assert _tree(package) == before
    assert not list(data.glob(".guest*")), "a work directory was left behind"
