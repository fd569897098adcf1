"""The helper's template build verbs (``template.*``) through the in-process backend, on a work tree
snapshotted from the real ``base`` template (received from the machine's cache stream, built once
if it is not there).

Aspects: a run step runs in the work tree with the helper's build environment plus the caller's,
streams its lines and returns its exit code, and leaves no mount behind; a file passed by fd lands
with its mode; the configure and clean scripts run by name; a second verb on a busy work tree is
refused, and a cancelled step is killed; refused before anything runs: a script name outside the
allowlist, a step kind outside apt|pip|run, a work tree outside ``tmp/build-<name>@<digest16>``,
arguments that fail the template spec's rules (packages, env names, paths, modes, suite, mirror),
and a work tree that is missing or not a subvolume.
"""

from __future__ import annotations

import asyncio
import os
import stat
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from space.errors import Conflict, InvalidPath, InvalidRequest, NotFound
from space.node.helper.backend import InProcess
from space.node.helper.verbs import HelperContext
from space.node.storage.mountinfo import mounts
from space.node.storage.pool import Pool
from space.node.templates.store import BASE_SPEC, DEFAULT_CACHE_DIR, TemplateInfo, TemplateStore
from tests.node.poolkit import run_async

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]

GOOD_WORK = "tmp/build-x@0123456789abcdef"


@pytest.fixture(scope="module")
def base(btrfs_pool: Pool) -> TemplateInfo:
    return run_async(TemplateStore(btrfs_pool, DEFAULT_CACHE_DIR).ensure(BASE_SPEC))


@pytest.fixture
def priv(btrfs_pool: Pool) -> InProcess:
    return InProcess(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=DEFAULT_CACHE_DIR,
                                   pool_root=btrfs_pool.root))


@pytest.fixture
async def work(btrfs_pool: Pool, base: TemplateInfo) -> AsyncIterator[tuple[str, Path]]:
    """A build begun from base (a writable snapshot of it) at ``tmp/build-t<rand>@<digest16>``:
    (REL, path)."""
    name = f"build-t{uuid.uuid4().hex[:8]}@{uuid.uuid4().hex[:16]}"
    path = btrfs_pool.tmp_dir / name
    await btrfs_pool.begin_build(path, base.path)
    yield f"tmp/{name}", path
    await btrfs_pool.delete_subvolume(path)


def mounts_beneath(path: Path) -> list[str]:
    prefix = str(path) + "/"
    return [m.target for m in mounts() if m.target == str(path) or m.target.startswith(prefix)]


class Lines(list[str]):
    async def __call__(self, line: str) -> None:
        self.append(line)


async def test_a_run_step_streams_its_lines_and_changes_the_tree(
    priv: InProcess, work: tuple[str, Path]
) -> None:
    rel, path = work
    lines = Lines()
    cmd = "echo step-out; echo \"$FOO $HOME $PATH\"; echo built > /etc/space-test; test -d /proc/self"

    res = await priv.call("template.step", {"work": rel, "kind": "run", "args": [cmd], "env": ["FOO=bar baz"]},
                          on_line=lines)

    assert res == {"returncode": 0}
    assert "step-out" in lines
    assert "bar baz /root /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in lines
    assert (path / "etc" / "space-test").read_text() == "built\n"
    assert mounts_beneath(path) == []  # proc, dev and resolv.conf went with the step's namespace


async def test_a_failing_step_returns_its_exit_code(priv: InProcess, work: tuple[str, Path]) -> None:
    rel, _ = work
    lines = Lines()

    res = await priv.call("template.step", {"work": rel, "kind": "run", "args": ["echo before; exit 3"]},
                          on_line=lines)

    assert res == {"returncode": 3}
    assert lines == ["before"]


async def test_a_file_passed_by_fd_lands_with_its_mode(
    priv: InProcess, work: tuple[str, Path], tmp_path: Path
) -> None:
    rel, path = work
    blob = tmp_path / "blob"
    blob.write_bytes(b"#!/bin/sh\necho hi\n")
    fd = os.open(blob, os.O_RDONLY | os.O_CLOEXEC)
    try:
        await priv.call("template.write_file", {"work": rel, "dest": "/opt/new/dir/run.sh", "mode": "0750"},
                        fds={"stdin": fd})
    finally:
        os.close(fd)

    written = path / "opt" / "new" / "dir" / "run.sh"
    assert written.read_bytes() == b"#!/bin/sh\necho hi\n"
    assert stat.S_IMODE(written.stat().st_mode) == 0o750


async def test_the_configure_and_clean_scripts_run_by_name(priv: InProcess, work: tuple[str, Path]) -> None:
    rel, path = work

    await priv.call("template.script", {"work": rel, "script": "configure", "args": ["tester", "/srv/app"]})
    await priv.call("template.script", {"work": rel, "script": "clean"})

    assert any(line.startswith("tester:") for line in (path / "etc" / "passwd").read_text().splitlines())
    assert (path / "srv" / "app").is_dir()


async def test_a_busy_work_tree_refuses_a_second_verb_and_a_cancelled_step_is_killed(
    priv: InProcess, work: tuple[str, Path]
) -> None:
    rel, path = work
    started = asyncio.Event()

    def on_line(line: str) -> None:
        started.set()

    step = asyncio.create_task(priv.call("template.step", {"work": rel, "kind": "run",
                                                           "args": ["echo $$; exec sleep 300"]}, on_line=on_line))
    try:
        async with asyncio.timeout(60):
            await started.wait()
        with pytest.raises(Conflict):
            await priv.call("template.script", {"work": rel, "script": "clean"})
    finally:
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
    assert mounts_beneath(path) == []
    # The step's shell was pid 1 of its own PID namespace: the whole namespace is gone with it.
    await priv.call("template.script", {"work": rel, "script": "clean"})  # no longer busy


@pytest.mark.parametrize("script", ["rm_rf", "configure ", "Configure", "", "../clean", "base_configure;id"])
async def test_a_script_outside_the_allowlist_is_refused(priv: InProcess, script: str) -> None:
    with pytest.raises(InvalidRequest, match="script"):
        await priv.call("template.script", {"work": GOOD_WORK, "script": script})


@pytest.mark.parametrize("kind", ["sh", "APT", "apt ", "debootstrap", "", "run;id"])
async def test_a_step_kind_outside_apt_pip_run_is_refused(priv: InProcess, kind: str) -> None:
    with pytest.raises(InvalidRequest, match="kind"):
        await priv.call("template.step", {"work": GOOD_WORK, "kind": kind, "args": ["x"]})


@pytest.mark.parametrize("bad", ["tmp/build-x", "tmp/build-x@0123456789ABCDEF", "sandboxes/a/rootfs",
                                 "templates/base@0123456789abcdef", "tmp/build-../x@0123456789abcdef",
                                 "/tmp/build-x@0123456789abcdef", "tmp/build-x@0123456789abcdef/etc", "tmp/x"])
async def test_a_work_tree_outside_tmp_build_is_refused(priv: InProcess, bad: str) -> None:
    with pytest.raises(InvalidRequest, match="work"):
        await priv.call("template.step", {"work": bad, "kind": "run", "args": ["true"]})
    with pytest.raises(InvalidRequest, match="work"):
        await priv.call("template.script", {"work": bad, "script": "clean"})
    with pytest.raises(InvalidRequest, match="work"):
        await priv.call("template.debootstrap", {"work": bad, "suite": "bookworm",
                                                 "mirror": "http://deb.debian.org/debian"})
    with pytest.raises(InvalidRequest, match="work"):
        await priv.call("template.write_file", {"work": bad, "dest": "/x", "mode": "0644"}, fds={"stdin": 0})


@pytest.mark.parametrize(("verb", "args"), [
    ("template.step", {"kind": "run", "args": ["true", "extra"]}),
    ("template.step", {"kind": "run", "args": []}),
    ("template.step", {"kind": "run", "args": ["  "]}),
    ("template.step", {"kind": "apt", "args": ["-oAPT::Get::x=1"]}),
    ("template.step", {"kind": "apt", "args": []}),
    ("template.step", {"kind": "pip", "args": ["--index-url=http://x"]}),
    ("template.step", {"kind": "run", "args": ["true"], "env": ["1BAD=x"]}),
    ("template.step", {"kind": "run", "args": ["true"], "env": ["NOEQUALS"]}),
    ("template.step", {"kind": "run", "args": ["true"], "env": {"A": "b"}}),
    ("template.script", {"script": "configure", "args": ["user"]}),
    ("template.script", {"script": "configure", "args": ["Bad User", ""]}),
    ("template.script", {"script": "configure", "args": ["", "relative/dir"]}),
    ("template.script", {"script": "base_configure", "args": ["user", "/home/../etc"]}),
    ("template.script", {"script": "clean", "args": ["x"]}),
    ("template.write_file", {"dest": "../etc/passwd", "mode": "0644"}),
    ("template.write_file", {"dest": "/", "mode": "0644"}),
    ("template.write_file", {"dest": "/x", "mode": "4755"}),
    ("template.debootstrap", {"suite": "bookworm;id", "mirror": "http://deb.debian.org/debian"}),
    ("template.debootstrap", {"suite": "bookworm", "mirror": "ftp://deb.debian.org/debian"}),
    ("template.debootstrap", {"suite": "bookworm", "mirror": "http://a b"}),
    ("template.debootstrap", {"suite": "bookworm", "mirror": "http://deb.debian.org/debian",
                              "packages": ["--foreign"]}),
])
async def test_arguments_failing_the_spec_rules_are_refused(priv: InProcess, verb: str, args: dict[str, Any]) -> None:
    fds = {"stdin": 0} if verb == "template.write_file" else None
    with pytest.raises(InvalidRequest):
        await priv.call(verb, {"work": GOOD_WORK, **args}, fds=fds)


async def test_a_missing_or_plain_work_tree_is_refused(btrfs_pool: Pool, priv: InProcess) -> None:
    with pytest.raises(NotFound):
        await priv.call("template.step", {"work": "tmp/build-nothing@0123456789abcdef", "kind": "run",
                                          "args": ["true"]})
    plain = btrfs_pool.tmp_dir / "build-plain@0123456789abcdef"
    plain.mkdir()
    try:
        with pytest.raises(InvalidPath):
            await priv.call("template.script", {"work": f"tmp/{plain.name}", "script": "clean"})
    finally:
        plain.rmdir()
