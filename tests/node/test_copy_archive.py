"""The script that places a copy's archive in a template (space/node/helper/copy_archive.py), run
here with the host's python3 on a directory (in a build it runs in the build sandbox over the
tree): E2B's COPY semantics -- a directory's contents merged into the destination, a file to its
path or into a directory, a glob's literal prefix, relative destinations under the workdir or the
user's home, owner and mode -- and the archives it refuses before it unpacks anything (members
outside it or under a link, devices, a name twice, a hard link to nothing earlier), leaving the
tree as it was."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "space/node/helper/copy_archive.py"

Member = tuple[str, str, bytes | str]  # (kind, name, content or link target)


def make_archive(path: Path, members: list[Member], *, gz: bool = True) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for kind, name, content in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o644
            if kind == "file":
                assert isinstance(content, bytes)
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE,
                         "fifo": tarfile.FIFOTYPE, "chr": tarfile.CHRTYPE}[kind]
            if kind == "dir":
                info.mode = 0o755
            if kind in ("sym", "hard"):
                assert isinstance(content, str)
                info.linkname = content
            tar.addfile(info)
    path.write_bytes(gzip.compress(buf.getvalue()) if gz else buf.getvalue())
    return path


Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run(tmp_path: Path) -> Run:
    def go(members: list[Member], src: str, dest: str, owner: str = "", mode: str = "", workdir: str = "",
           user: str = "", gz: bool = True) -> subprocess.CompletedProcess[str]:
        archive = make_archive(tmp_path / ".space-copy-0123456789abcdef.tar", members, gz=gz)
        return subprocess.run([sys.executable, "-I", "-S", str(SCRIPT), str(archive), src, dest, owner, mode,
                               workdir, user], capture_output=True, text=True, timeout=60)
    return go


FOLDER: list[Member] = [("dir", "folder", b""), ("file", "folder/test.txt", b"This is a test file."),
                        ("sym", "folder/symlink.txt", "test.txt"), ("sym", "folder/dangling.txt", "12345test.txt"),
                        ("dir", "folder/sub", b""), ("file", "folder/sub/deep.txt", b"deep")]


def test_a_directory_merges_into_the_destination(run: Run, tmp_path: Path) -> None:
    dest = tmp_path / "app" / "folder"
    dest.mkdir(parents=True)
    (dest / "kept.txt").write_text("kept")
    (dest / "test.txt").write_text("old")
    r = run(FOLDER, "folder/*", str(dest), mode="0750")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (dest / "test.txt").read_text() == "This is a test file."
    assert (dest / "kept.txt").read_text() == "kept"  # merged, not replaced
    assert os.readlink(dest / "symlink.txt") == "test.txt" and (dest / "symlink.txt").read_text().startswith("This")
    assert os.readlink(dest / "dangling.txt") == "12345test.txt"
    assert (dest / "sub/deep.txt").read_text() == "deep"
    assert (dest / "test.txt").stat().st_mode & 0o7777 == 0o750
    assert (dest / "sub").stat().st_mode & 0o7777 == 0o750
    assert not (tmp_path / ".space-copy-0123456789abcdef.tar").exists()  # archive and staging gone
    assert not (tmp_path / ".space-copy-0123456789abcdef").exists()
    assert f"to {dest}" in r.stdout


def test_a_file_goes_to_its_path_or_into_a_directory(run: Run, tmp_path: Path) -> None:
    r = run(FOLDER, "folder/test.txt", str(tmp_path / "etc/app.conf"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "etc/app.conf").read_text() == "This is a test file."
    r = run(FOLDER, "folder/test.txt", str(tmp_path / "into") + "/")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "into/test.txt").read_text() == "This is a test file."
    r = run(FOLDER, "folder/symlink.txt", str(tmp_path / "into"))  # an existing directory: into it
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.readlink(tmp_path / "into/symlink.txt") == "test.txt"


def test_relative_destinations_owner_and_a_plain_tar(run: Run, tmp_path: Path) -> None:
    r = run(FOLDER, "folder", "copied", workdir=str(tmp_path / "work"), owner="nobody:nogroup", gz=False)
    assert r.returncode == 0, r.stdout + r.stderr
    st = (tmp_path / "work/copied/test.txt").stat()
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    assert os.lstat(tmp_path / "work/copied/symlink.txt").st_uid == 65534
    # No workdir: the user's home (root's here).
    r = run([("file", "x.txt", b"x")], "", "space-copy-test-home-file", user="root")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert Path("/root/space-copy-test-home-file/x.txt").read_text() == "x"
    finally:
        subprocess.run(["rm", "-rf", "/root/space-copy-test-home-file"], check=True)


@pytest.mark.parametrize(("members", "message"), [
    ([("file", "../escape.txt", b"x")], "is outside it"),
    ([("file", "/abs.txt", b"x")], "is outside it"),
    ([("sym", "folder", "/etc"), ("file", "folder/passwd", b"x")], "is under a symbolic link"),
    ([("fifo", "folder/pipe", b"")], "is not a file, directory or link"),
    ([("chr", "folder/null", b"")], "is not a file, directory or link"),
    ([("sym", "folder/a", "/etc/passwd"), ("file", "folder/a", b"x")], "twice"),
    ([("hard", "folder/h", "/etc/shadow")], "is not to an earlier member"),
    ([("hard", "folder/h", "folder/later"), ("file", "folder/later", b"x")], "is not to an earlier member"),
])
def test_hostile_archives_are_refused_before_unpacking(run: Run, tmp_path: Path, members: list[Member],
                                                        message: str) -> None:
    r = run(members, "folder", str(tmp_path / "dest"))
    assert r.returncode == 3 and message in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "dest").exists() and not (tmp_path / "escape.txt").exists()
    assert not (tmp_path / ".space-copy-0123456789abcdef").exists()
    assert not (tmp_path / ".space-copy-0123456789abcdef.tar").exists()


def test_what_is_not_there_or_nobody(run: Run, tmp_path: Path) -> None:
    r = run(FOLDER, "other/*", str(tmp_path / "d"))
    assert r.returncode == 3 and "'other/*' is not among the uploaded files" in r.stdout
    r = run(FOLDER, "folder", str(tmp_path / "d"), owner="no-such-user-here")
    assert r.returncode == 3 and "no user 'no-such-user-here'" in r.stdout


@pytest.mark.parametrize("args", [
    ("/tmp/x.tar", "a", "/d", "", "", "", ""),  # not the staged archive's name
    ("/.space-copy-0123456789abcdef.tar", "../etc", "/d", "", "", "", ""),  # a source outside it
    ("/.space-copy-0123456789abcdef.tar", "a", "../../d", "", "", "", ""),  # a destination climbing out
    ("/.space-copy-0123456789abcdef.tar", "a", "/d", "root;id", "", "", ""),  # an owner that is no name
    ("/.space-copy-0123456789abcdef.tar", "a", "/d", "", "7777x", "", ""),  # a mode that is no mode
    ("/.space-copy-0123456789abcdef.tar", "a", "/d", "", "", "relative", ""),  # a workdir not absolute
    ("/.space-copy-0123456789abcdef.tar", "a", "/d", "", "", ""),  # one argument short
])
def test_the_helper_refuses_arguments_outside_the_spec(args: tuple[str, ...]) -> None:
    """The root helper checks a copy's arguments as the spec does before a build sandbox starts."""
    from space.node.helper.build_scripts import copy_args_ok

    assert not copy_args_ok(args)


def test_the_helper_takes_a_spec_copy() -> None:
    from space.node.helper.build_scripts import copy_args_ok

    assert copy_args_ok(("/.space-copy-0123456789abcdef.tar", "folder/*", "folder", "user:user", "0755", "/app",
                         "user"))
