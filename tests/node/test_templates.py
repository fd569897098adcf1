"""Templates: spec digests, and materialization on real btrfs pools.

Aspects: the digest is canonical and specs are validated; the real ``base`` template (built once
into the machine's cache at /var/cache/space, received from its stream on later runs) has python3,
bash, git, curl, user ``user`` (uid 1000) owning /home/user, and is read-only; a second ensure does
not rebuild; a fresh pool gets it by ``btrfs receive``, not debootstrap; with an injected builder:
concurrent ensures in one process and through two stores (the cross-process file lock) build once;
crash leftovers are cleaned or adopted; a corrupt cache stream falls back to a build; a failed build
leaves nothing behind; force rebuilds; remove is idempotent.
"""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from space.errors import RuntimeFailure, ValidationFailed
from space.node.helper import privileged
from space.node.storage.pool import Pool
from space.node.templates.store import (
    BASE_SPEC,
    DEFAULT_CACHE_DIR,
    Progress,
    TemplateInfo,
    TemplateStore,
    spec_digest,
    validate_spec,
)
from tests.node.poolkit import PoolFactory, run_async

pytestmark = pytest.mark.anyio
runtime = pytest.mark.runtime

DEADLINE = 60.0


class Lines(list[str]):
    """A progress callback that records what it is told."""

    async def __call__(self, line: str) -> None:
        self.append(line)

    def having(self, text: str) -> list[str]:
        return [line for line in self if text in line]


class CountingBuilder:
    """A fast stand-in for debootstrap (the builder seam): counts builds, optionally holds each one
    until ``release`` is set, optionally fails."""

    def __init__(self, *, hold: bool = False, fail: bool = False) -> None:
        self.builds = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        if not hold:
            self.release.set()
        self.fail = fail

    async def __call__(self, spec: dict[str, Any], target: Path, cache_dir: Path, emit: Progress) -> None:
        self.builds += 1
        await emit("[1/4] debootstrap (fake)")
        (target / "etc").mkdir()
        (target / "etc" / "template-name").write_text(spec["name"])
        self.started.set()
        await self.release.wait()
        if self.fail:
            raise RuntimeFailure("fake build failed")


def fake_spec() -> dict[str, Any]:
    spec = copy.deepcopy(BASE_SPEC)
    spec["name"] = f"fake-{uuid.uuid4().hex[:8]}"
    return spec


async def until(condition: Callable[[], bool], event: asyncio.Event) -> None:
    """Wait (with a deadline) until ``condition`` holds; ``event`` is set whenever it may have changed."""
    async with asyncio.timeout(DEADLINE):
        while not condition():
            event.clear()
            await event.wait()


# -- digests and validation (no root needed) -------------------------------------------------------


def test_digest_is_canonical() -> None:
    reordered = dict(reversed(list(BASE_SPEC.items())))
    assert spec_digest(reordered) == spec_digest(BASE_SPEC)
    assert len(spec_digest(BASE_SPEC)) == 64
    changed = copy.deepcopy(BASE_SPEC)
    changed["packages"] = [*changed["packages"], "vim"]
    assert spec_digest(changed) != spec_digest(BASE_SPEC)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("name", "../x"),
        ("suite", "bookworm; rm -rf /"),
        ("mirror", "ftp://example"),
        ("packages", ["python3", "--force-yes"]),
        ("packages", "python3"),
        ("user", "Root User"),
        ("home", "/home/../etc"),
        ("home", "relative"),
    ],
)
def test_invalid_specs_are_refused(key: str, value: Any) -> None:
    spec = copy.deepcopy(BASE_SPEC)
    spec[key] = value
    with pytest.raises(ValidationFailed):
        validate_spec(spec)
    del spec[key]
    with pytest.raises(ValidationFailed):
        validate_spec(spec)


# -- the real base template ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_template(btrfs_pool: Pool) -> tuple[TemplateInfo, Lines]:
    """``base`` in the module's pool: a real build the first time this machine runs the suite (it
    exports the stream to /var/cache/space), a receive from that stream afterwards."""
    lines = Lines()
    info = run_async(TemplateStore(btrfs_pool, DEFAULT_CACHE_DIR).ensure(BASE_SPEC, on_progress=lines))
    print(f"\nbase template: source={info.source} seconds={info.seconds} size={info.size_bytes}")
    return info, lines


def chroot(root: Path, *argv: str) -> str:
    # The pool is nodev: the template's own /dev nodes do not open on the host, so the host's /dev
    # is bound over it (in a mount namespace of this command's alone).
    script = 'mount --rbind /dev "$1/dev" && exec chroot "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "chroot",
                           str(root), *argv], capture_output=True, text=True, check=True).stdout


@runtime
async def test_base_template_has_the_tools_and_the_user(
    btrfs_pool: Pool, base_template: tuple[TemplateInfo, Lines]
) -> None:
    info, lines = base_template
    root = info.path
    assert info.name == "base" and info.digest == spec_digest(BASE_SPEC)
    assert root == btrfs_pool.template_path("base", info.digest)
    assert info.source in ("build", "receive")
    if info.source == "build":
        assert lines.having("[1/4] debootstrap bookworm") and lines.having("%]")
    for tool in ("usr/bin/python3", "bin/bash", "usr/bin/git", "usr/bin/curl", "bin/ps"):
        assert (root / tool).exists(), tool
    assert chroot(root, "python3", "-c", "print(6 * 7)").strip() == "42"
    assert chroot(root, "git", "--version").startswith("git version")
    passwd = {line.split(":")[0]: line.split(":") for line in (root / "etc/passwd").read_text().splitlines()}
    assert passwd["user"][2:4] == ["1000", "1000"] and passwd["user"][5:] == ["/home/user", "/bin/bash"]
    home = (root / "home/user").stat()
    assert (home.st_uid, home.st_gid) == (1000, 1000)
    assert (root / "opt/space/guest").is_dir()
    assert not (root / "etc/hostname").exists()
    assert list((root / "var/lib/apt/lists").glob("*_Packages")) == []
    assert list((root / "var/cache/apt/archives").glob("*.deb")) == []
    assert await btrfs_pool.is_readonly(root)
    with pytest.raises(OSError):
        (root / "tmp" / "x").write_text("no")
    assert info.size_bytes > 50_000_000
    assert DEFAULT_CACHE_DIR.joinpath("templates", f"base-{info.digest}.btrfs.zst").is_file()


@runtime
async def test_second_ensure_does_not_rebuild(
    btrfs_pool: Pool, base_template: tuple[TemplateInfo, Lines]
) -> None:
    info, _ = base_template
    lines = Lines()
    store = TemplateStore(btrfs_pool, DEFAULT_CACHE_DIR)

    again = await store.ensure(BASE_SPEC, on_progress=lines)

    assert again == info  # same manifest: same digest, same created_at
    assert lines.having("ready (cached, no rebuild)")
    assert not lines.having("[1/4]") and not lines.having("[1/2]")
    assert await store.get("base") == info
    assert info in await store.list()


@runtime
async def test_a_fresh_pool_receives_base_from_the_cache_stream(
    pool_factory: PoolFactory, base_template: tuple[TemplateInfo, Lines]
) -> None:
    info, _ = base_template
    pool = pool_factory("second-node")
    lines = Lines()

    got = await TemplateStore(pool, DEFAULT_CACHE_DIR).ensure(BASE_SPEC, on_progress=lines)

    print(f"\nreceive into a fresh pool: {got.seconds}s")
    assert got.source == "receive"
    assert not lines.having("debootstrap")
    assert lines.having("[1/2] receive")
    assert (got.digest, got.path.name) == (info.digest, info.path.name)
    assert (got.path / "usr/bin/python3").exists()
    assert await pool.is_readonly(got.path)
    # The received copy keeps the sent subvolume's identity, so `send -p <template>` deltas apply.
    show = (await privileged.run("btrfs", "subvolume", "show", str(got.path))).text
    received = [line.split()[-1] for line in show.splitlines() if "Received UUID" in line]
    assert received and received[0] != "-"


# -- single flight, leftovers and failures (injected builder, private cache) -------------------


@runtime
async def test_concurrent_ensures_share_one_build(btrfs_pool: Pool, tmp_path: Path) -> None:
    builder = CountingBuilder(hold=True)
    store = TemplateStore(btrfs_pool, tmp_path / "cache", builder=builder)
    spec = fake_spec()
    listeners = [Lines() for _ in range(5)]
    changed = asyncio.Event()

    def listener(i: int) -> Progress:
        async def on_line(line: str) -> None:
            await listeners[i](line)
            changed.set()
        return on_line

    tasks = [asyncio.create_task(store.ensure(spec, on_progress=listener(i))) for i in range(5)]
    try:
        await until(lambda: sum(bool(ls.having("waiting for the materialization")) for ls in listeners) == 4,
                    changed)
        builder.release.set()
        infos = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    assert builder.builds == 1
    assert len({(i.digest, i.created_at) for i in infos}) == 1
    for ls in listeners:  # waiters see the running build's progress too
        assert ls.having("[4/4] publish")


@runtime
async def test_two_stores_share_one_build_through_the_file_lock(btrfs_pool: Pool, tmp_path: Path) -> None:
    # Two stores have separate in-process flights, like two processes: only the flock joins them.
    builder = CountingBuilder(hold=True)
    first = TemplateStore(btrfs_pool, tmp_path / "cache", builder=builder)
    second = TemplateStore(btrfs_pool, tmp_path / "cache", builder=builder)
    spec = fake_spec()
    lines = Lines()
    changed = asyncio.Event()

    async def on_line(line: str) -> None:
        await lines(line)
        changed.set()

    one = asyncio.create_task(first.ensure(spec))
    try:
        async with asyncio.timeout(DEADLINE):
            await builder.started.wait()
        two = asyncio.create_task(second.ensure(spec, on_progress=on_line))
        await until(lambda: bool(lines.having("waiting for another process")), changed)
        builder.release.set()
        a, b = await asyncio.gather(one, two)
    finally:
        one.cancel()
    assert builder.builds == 1
    assert a == b
    assert lines.having("ready (cached, no rebuild)")


@runtime
async def test_leftovers_of_an_interrupted_build_are_deleted(btrfs_pool: Pool, tmp_path: Path) -> None:
    builder = CountingBuilder()
    store = TemplateStore(btrfs_pool, tmp_path / "cache", builder=builder)
    spec = fake_spec()
    final = btrfs_pool.template_path(spec["name"], spec_digest(spec))
    work = btrfs_pool.tmp_dir / f"build-{final.name}"
    await btrfs_pool.create_subvolume(work)
    (work / "half-written").write_text("x")
    await btrfs_pool.create_subvolume(final)  # a partial (still writable) receive

    info = await store.ensure(spec)

    assert (builder.builds, info.source) == (1, "build")
    assert not work.exists()
    assert not (final / "half-written").exists()
    assert (final / "etc" / "template-name").read_text() == spec["name"]
    await store.remove(spec["name"], info.digest)


@runtime
async def test_a_complete_template_without_manifest_is_adopted(btrfs_pool: Pool, tmp_path: Path) -> None:
    builder = CountingBuilder()
    store = TemplateStore(btrfs_pool, tmp_path / "cache", builder=builder)
    spec = fake_spec()
    final = btrfs_pool.template_path(spec["name"], spec_digest(spec))
    # What a crash between the read-only publish and the manifest leaves.
    await btrfs_pool.create_subvolume(final)
    await btrfs_pool.set_readonly(final)

    info = await store.ensure(spec)

    assert (builder.builds, info.source) == (0, "recovered")
    assert await store.get(spec["name"]) == info
    await store.remove(spec["name"], info.digest)


@runtime
async def test_a_corrupt_cache_stream_falls_back_to_a_build(btrfs_pool: Pool, tmp_path: Path) -> None:
    builder = CountingBuilder()
    store = TemplateStore(btrfs_pool, tmp_path / "cache", builder=builder)
    spec = fake_spec()
    stream = store.stream_path(spec["name"], spec_digest(spec))
    stream.parent.mkdir(parents=True)
    stream.write_bytes(b"not a zstd stream")
    lines = Lines()

    info = await store.ensure(spec, on_progress=lines)

    assert (builder.builds, info.source) == (1, "build")
    assert lines.having("cached stream unusable")
    await privileged.run("zstd", "-t", "-q", str(stream))  # a valid stream replaced the garbage
    await store.remove(spec["name"], info.digest)


@runtime
async def test_a_failed_build_leaves_nothing_behind(btrfs_pool: Pool, tmp_path: Path) -> None:
    spec = fake_spec()
    final = btrfs_pool.template_path(spec["name"], spec_digest(spec))
    failing = TemplateStore(btrfs_pool, tmp_path / "cache", builder=CountingBuilder(fail=True))

    with pytest.raises(RuntimeFailure):
        await failing.ensure(spec)

    assert not final.exists()
    assert not (btrfs_pool.tmp_dir / f"build-{final.name}").exists()
    assert await failing.get(spec["name"]) is None
    info = await TemplateStore(btrfs_pool, tmp_path / "cache", builder=CountingBuilder()).ensure(spec)
    assert info.source == "build"
    await failing.remove(spec["name"], info.digest)


@runtime
async def test_force_rebuilds_and_remove_is_idempotent(btrfs_pool: Pool, tmp_path: Path) -> None:
    builder = CountingBuilder()
    store = TemplateStore(btrfs_pool, tmp_path / "cache", builder=builder)
    spec = fake_spec()
    first = await store.ensure(spec)

    rebuilt = await store.ensure(spec, force=True)

    assert builder.builds == 2
    assert rebuilt.created_at > first.created_at
    assert await store.get(spec["name"]) == rebuilt
    await store.remove(spec["name"], rebuilt.digest)
    await store.remove(spec["name"], rebuilt.digest)
    assert await store.get(spec["name"]) is None
    assert not rebuilt.path.exists()
    assert not rebuilt.path.with_name(rebuilt.path.name + ".json").exists()


@runtime
async def test_a_cancelled_build_kills_its_processes_and_cleans_up(btrfs_pool: Pool, tmp_path: Path) -> None:
    spec = fake_spec()
    final = btrfs_pool.template_path(spec["name"], spec_digest(spec))
    work = btrfs_pool.tmp_dir / f"build-{final.name}"
    started = asyncio.Event()
    pids: list[int] = []

    async def hanging_builder(spec: dict[str, Any], target: Path, cache_dir: Path, emit: Progress) -> None:
        (target / "proc").mkdir()
        await privileged.run("mount", "-t", "tmpfs", "tmpfs", str(target / "proc"))  # as debootstrap does

        def on_line(line: str) -> None:
            pids.append(int(line))
            started.set()

        await privileged.stream_lines("sh", "-c", "echo $$; exec sleep 300", on_line=on_line)

    store = TemplateStore(btrfs_pool, tmp_path / "cache", builder=hanging_builder)
    task = asyncio.create_task(store.ensure(spec))
    async with asyncio.timeout(DEADLINE):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    with pytest.raises(ProcessLookupError):  # killed and reaped with the build
        os.kill(pids[0], 0)
    assert not work.exists() and not final.exists()
    assert await store.get(spec["name"]) is None
