"""Secrets as mounted files, for pods whose Secrets are volumes (deploy/kubernetes):

- ``--database-url-file`` stands for ``--database-url``: exactly one of the two; the file is bounded,
  one line, UTF-8; ``space db migrate`` takes either and brings the schema to the newest migration
- ``$SPACE_BOOTSTRAP_ADMIN_KEY_FILE`` gives the first admin key; a missing file (an optional
  Secret) is no key; the variable itself wins
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from space.cli.server import _database_url
from space.controlplane import MAX_SECRET_FILE, StartupError, bootstrap_key


def test_the_database_url_from_a_file(tmp_path: Path) -> None:
    f = tmp_path / "url"
    f.write_text("postgresql+asyncpg://space:pw@db:5432/space\n")
    assert _database_url(None, f) == "postgresql+asyncpg://space:pw@db:5432/space"
    assert _database_url("sqlite+aiosqlite:///x.db", None) == "sqlite+aiosqlite:///x.db"


@pytest.mark.parametrize("content", [b"", b"a\nb", b"\xff\xfe", b"x" * (MAX_SECRET_FILE + 1)])
def test_a_database_url_file_that_is_not_one_url_is_refused(tmp_path: Path, content: bytes) -> None:
    f = tmp_path / "url"
    f.write_bytes(content)
    with pytest.raises(typer.BadParameter):
        _database_url(None, f)


def test_exactly_one_of_the_url_and_its_file(tmp_path: Path) -> None:
    with pytest.raises(typer.BadParameter, match="exactly one"):
        _database_url(None, None)
    with pytest.raises(typer.BadParameter, match="exactly one"):
        _database_url("sqlite+aiosqlite:///x.db", tmp_path / "url")
    with pytest.raises(typer.BadParameter, match="does not exist"):
        _database_url(None, tmp_path / "missing")


def test_db_migrate_brings_a_new_database_to_the_newest_schema(tmp_path: Path) -> None:
    """As a process (the command configures logging for the process: in-process it would keep
    writing to a test runner's closed stream)."""
    from space.store.db import head_revision

    f = tmp_path / "url"
    f.write_text(f"sqlite+aiosqlite:///{tmp_path}/space.db")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPACE_")}
    for _ in range(2):  # and again: nothing left to do
        r = subprocess.run([sys.executable, "-m", "space.cli.main", "db", "migrate", "--database-url-file", str(f)],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        assert f"schema at {head_revision()}" in r.stdout
    missing = subprocess.run([sys.executable, "-m", "space.cli.main", "db", "migrate"],
                             capture_output=True, text=True, timeout=120, env=env)
    assert missing.returncode == 2 and "exactly one" in missing.stderr


def test_the_bootstrap_admin_key_from_a_file(tmp_path: Path) -> None:
    key = "sk_" + "k" * 40
    f = tmp_path / "admin-key"
    f.write_text(key + "\n")
    assert bootstrap_key({"SPACE_BOOTSTRAP_ADMIN_KEY_FILE": str(f)}) == key
    assert bootstrap_key({"SPACE_BOOTSTRAP_ADMIN_KEY_FILE": str(tmp_path / "absent")}) == ""
    assert bootstrap_key({"SPACE_BOOTSTRAP_ADMIN_KEY": "sk_" + "v" * 40,
                          "SPACE_BOOTSTRAP_ADMIN_KEY_FILE": str(f)}) == "sk_" + "v" * 40
    assert bootstrap_key({}) == ""
    f.write_bytes(b"x" * (MAX_SECRET_FILE + 1))
    with pytest.raises(StartupError):
        bootstrap_key({"SPACE_BOOTSTRAP_ADMIN_KEY_FILE": str(f)})
