"""Templates from container images through the template store (``image`` specs): the image pulled
from a registry on loopback, unpacked, configured and checked by the helper's verbs on a real
btrfs pool, published read-only like any template.

The images are SPACE's own ``base`` template's root as one layer (so they can run the guest
daemon), and the same with a layer of whiteouts that takes away what the daemon needs.

Aspects:
- a template built from an image has the image's files, the guest daemon's mount point and a
  per-sandbox /etc/resolv.conf and /etc/hosts, and is published read-only under its digest
- an image without /usr/bin/python3, one whose python lacks a module the daemon imports, and one
  without the template's user fail the build with a message naming what is missing, and leave no
  template and no build tree behind
- three ensures of one new image at once pull and unpack it once
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from space.errors import RuntimeFailure
from space.node.helper.backend import InProcess
from space.node.helper.verbs import HelperContext
from space.node.storage.pool import Pool
from space.node.templates.store import BASE_SPEC, DEFAULT_CACHE_DIR, TemplateInfo, TemplateStore, spec_digest
from tests.node.poolkit import run_async
from tests.node.test_helper_oci import Entry, push, registry

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]

__all__ = ["registry"]


@pytest.fixture(scope="module")
def base(btrfs_pool: Pool) -> TemplateInfo:
    return run_async(TemplateStore(btrfs_pool, DEFAULT_CACHE_DIR).ensure(BASE_SPEC))


@pytest.fixture(scope="module")
def base_layer(base: TemplateInfo, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``base``'s root as one uncompressed layer (owners, modes and xattrs kept)."""
    tar = tmp_path_factory.mktemp("base-layer") / "base.tar"
    subprocess.run(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", str(base.path),
                    "-cf", str(tar), "."], check=True)
    return tar


@pytest.fixture
def store(btrfs_pool: Pool, registry: str) -> Iterator[TemplateStore]:
    """A template store whose helper may pull from the test registry."""
    kept = btrfs_pool.priv
    btrfs_pool.priv = InProcess(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=DEFAULT_CACHE_DIR,
                                              pool_root=btrfs_pool.root, registries=(f"http://{registry}",)))
    try:
        yield TemplateStore(btrfs_pool, DEFAULT_CACHE_DIR)
    finally:
        btrfs_pool.priv = kept


def _leftovers(pool: Pool, name: str) -> list[str]:
    return [p for p in [*os.listdir(pool.tmp_dir), *os.listdir(pool.root / "templates")] if name in p]


async def test_a_template_from_an_image(store: TemplateStore, btrfs_pool: Pool, registry: str,
                                        base_layer: Path, tmp_path: Path) -> None:
    image = push(tmp_path, registry, "test/debian", [base_layer, [Entry("etc/from-image", data=b"yes\n")]],
                 {"Env": ["PATH=/usr/bin:/bin"], "User": "user"})
    spec = {"name": "from-image", "image": image, "user": "user"}
    lines: list[str] = []

    async def emit(line: str) -> None:
        lines.append(line)

    info = await store.ensure(spec, on_progress=emit)

    assert info.digest == spec_digest(spec) and info.name == "from-image"
    root = info.path
    assert (root / "etc/from-image").read_bytes() == b"yes\n"
    assert (root / "usr/bin/python3").exists() and (root / "opt/space/guest").is_dir()
    assert (root / "etc/resolv.conf").read_bytes() == b""
    assert b"localhost" in (root / "etc/hosts").read_bytes()
    assert not (root / "etc/hostname").exists()
    with pytest.raises(OSError):  # published read-only
        (root / "etc/new").write_text("x")
    assert any(f"base: image {image}" in ln for ln in lines)


@pytest.mark.parametrize(("what", "whiteouts", "user", "message"), [
    ("no python", [Entry("usr/bin/.wh.python3")], "user", "has no /usr/bin/python3"),
    ("no json", [Entry("usr/lib/python3.11/.wh.json")], "user",
     "cannot run SPACE's guest daemon: ModuleNotFoundError: No module named 'json'"),
    ("no termios", [Entry("usr/lib/python3.11/lib-dynload/.wh.termios.cpython-311-x86_64-linux-gnu.so")], "user",
     "cannot run SPACE's guest daemon: ModuleNotFoundError: No module named 'termios'"),
    ("no such user", [], "nobody-here", "has no user 'nobody-here'"),
])
async def test_an_image_that_cannot_run_the_guest_fails_naming_what_it_lacks(
        store: TemplateStore, btrfs_pool: Pool, registry: str, base_layer: Path, tmp_path: Path,
        what: str, whiteouts: list[Entry], user: str, message: str) -> None:
    layers: list[list[Entry] | Path] = [base_layer, whiteouts] if whiteouts else [base_layer]
    image = push(tmp_path, registry, "test/lacking", layers)
    name = f"lacking-{what.replace(' ', '-')}"
    with pytest.raises(RuntimeFailure, match=message.replace("(", r"\(").replace(")", r"\)")):
        await store.ensure({"name": name, "image": image, "user": user})
    assert _leftovers(btrfs_pool, name) == []


class Counting(InProcess):
    """The in-process helper, counting the verbs it was asked for."""

    def __init__(self, ctx: HelperContext) -> None:
        super().__init__(ctx)
        self.calls: list[str] = []

    async def call(self, verb: str, *args: Any, **kw: Any) -> dict[str, Any]:
        self.calls.append(verb)
        return await super().call(verb, *args, **kw)


async def test_concurrent_ensures_of_one_new_image_pull_it_once(
        btrfs_pool: Pool, registry: str, base_layer: Path, tmp_path: Path) -> None:
    image = push(tmp_path, registry, "test/once", [base_layer, [Entry("etc/once", data=b"1")]])
    kept = btrfs_pool.priv
    counting = Counting(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=DEFAULT_CACHE_DIR,
                                      pool_root=btrfs_pool.root, registries=(f"http://{registry}",)))
    btrfs_pool.priv = counting
    try:
        store = TemplateStore(btrfs_pool, DEFAULT_CACHE_DIR)
        spec = {"name": "once", "image": image, "user": "user"}
        first, second, third = await asyncio.gather(*(store.ensure(dict(spec)) for _ in range(3)))
    finally:
        btrfs_pool.priv = kept
    assert first.path == second.path == third.path
    assert counting.calls.count("template.oci") == 1
