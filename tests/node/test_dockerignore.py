"""A build context's .dockerignore as Docker reads it (space/node/templates/dockerignore.py): globs
per path component, ``**`` across directories, a directory's pattern covering what is under it,
``!`` exceptions with the last match deciding, comments, and leading ``/`` or ``./``; and a
Dockerfile's COPY leaving out what it excludes, or refusing a source it excludes."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from space.node.templates.dockerfile import DockerfileError, parse
from space.node.templates.dockerignore import DockerIgnore

IGNORE = """
# build output and secrets
/build
*.pyc
**/__pycache__
./.env
docs/**/*.md
!docs/keep/README.md
secret?.txt
[ab]-tmp
"""


@pytest.mark.parametrize(("path", "excluded"), [
    ("build", True), ("build/out/app.bin", True), ("src/build", False),
    ("app.pyc", True), ("src/app.pyc", False),  # "*" does not cross "/"
    ("src/pkg/__pycache__/m.cpython-311.pyc", True), ("__pycache__/x", True),
    (".env", True), ("src/.env", False),
    ("docs/a.md", True), ("docs/deep/er/b.md", True), ("docs/keep/README.md", False), ("docs/a.txt", False),
    ("secret1.txt", True), ("secret12.txt", False),
    ("a-tmp", True), ("c-tmp", False),
    ("src/main.py", False),
])
def test_patterns(path: str, excluded: bool) -> None:
    assert DockerIgnore.parse(IGNORE).excluded(path) is excluded


def test_a_later_rule_decides() -> None:
    ignore = DockerIgnore.parse("logs\n!logs/keep.log\nlogs/keep.log\n")
    assert ignore.excluded("logs/keep.log")
    assert not DockerIgnore.parse("*\n!src\n").excluded("src/main.py")
    assert DockerIgnore.parse("*\n!src\n").excluded("README.md")


def test_copy_leaves_out_what_it_excludes(tmp_path: Path) -> None:
    (tmp_path / "app" / "__pycache__").mkdir(parents=True)
    (tmp_path / "app" / "main.py").write_text("print('hi')\n")
    (tmp_path / "app" / "__pycache__" / "main.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "app" / ".env").write_text("TOKEN=secret\n")
    (tmp_path / ".dockerignore").write_text("**/__pycache__\napp/.env\n")
    parsed = parse("FROM base\nCOPY app /srv/app\n", tmp_path, name="t")
    with tarfile.open(parsed.blobs[parsed.spec["run"][0]["archive"]]) as tar:
        assert sorted(tar.getnames()) == ["app", "app/main.py"]
    with pytest.raises(DockerfileError, match=r"line 2: .*nothing to copy \(.dockerignore excludes it\)"):
        parse("FROM base\nCOPY app/.env /srv/.env\n", tmp_path, name="t")
