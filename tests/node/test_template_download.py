"""Materialization from object storage is single-flight: a node that lacks a template downloads
its stream once, however many callers want it at the same moment, in one process (the asyncio
flight) and across processes (the file lock; two stores stand for two processes).

Real btrfs pools, a real object store directory; the builder seam makes the template quickly.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from pathlib import Path
from typing import Any

import pytest

from space.node.pool import Pool
from space.node.templates import BASE_SPEC, Progress, TemplateStore, template_key
from space.objstore import ObjectStore
from tests.node.poolkit import PoolFactory

pytestmark = [pytest.mark.anyio, pytest.mark.runtime]


async def _tiny_builder(spec: dict[str, Any], target: Path, cache_dir: Path, emit: Progress) -> None:
    (target / "etc").mkdir()
    (target / "etc" / "template-name").write_text(spec["name"])
    # Enough bytes that the download takes a moment, so the callers really overlap.
    (target / "blob").write_bytes(uuid.uuid4().bytes * (1 << 16))


async def _published(pool: Pool, cache: Path, objects: ObjectStore) -> dict[str, Any]:
    spec = copy.deepcopy(BASE_SPEC)
    spec["name"] = f"dl-{uuid.uuid4().hex[:8]}"
    origin = TemplateStore(pool, cache, builder=_tiny_builder, objects=objects)
    info = await origin.ensure(spec)
    await origin.publish(objects, info.name, info.digest)
    assert await objects.exists(template_key(info.name, info.digest))
    return spec


async def test_concurrent_materializations_download_once(
    btrfs_pool: Pool, pool_factory: PoolFactory, tmp_path: Path
) -> None:
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    spec = await _published(btrfs_pool, tmp_path / "origin-cache", objects)

    node = pool_factory("fresh-node")
    cache = tmp_path / "node-cache"  # empty: the stream must come from object storage
    # Two stores on one node: separate in-process flights, so only the cross-process lock joins them.
    first = TemplateStore(node, cache, objects=objects)
    second = TemplateStore(node, cache, objects=objects)
    calls = [first.ensure(spec) for _ in range(3)] + [second.ensure(spec) for _ in range(3)]
    infos = await asyncio.gather(*calls)

    assert first.downloads + second.downloads == 1
    assert len({(i.digest, i.path) for i in infos}) == 1
    assert await node.is_readonly(infos[0].path)
    assert (infos[0].path / "etc" / "template-name").read_text() == spec["name"]
    # Later callers find it on disk: no further download.
    await TemplateStore(node, cache, objects=objects).ensure(spec)
    assert first.downloads + second.downloads == 1
