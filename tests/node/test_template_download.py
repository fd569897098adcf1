"""Materialization from object storage: single-flight, content-addressed and verified before root
receives a byte.

A node that lacks a template downloads its stream once, however many callers want it at the same
moment, in one process (the asyncio flight) and across processes (the file lock; two stores stand
for two processes). The stream's object name carries the sha256 of its bytes and a manifest sealed
with the deployment's key names it; a stream that does not match (rewritten, truncated, extended),
a manifest that is not sealed (rewritten, or from before sealing) is refused with
``object_tampered``: nothing received, nothing kept in the cache, and no build to paper over it.

Real btrfs pools, a real object store directory; the builder seam makes the template quickly.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from space import objauth
from space.errors import ObjectTampered, SnapshotCorrupt, Unavailable
from space.node.storage.pool import Pool
from space.node.templates import objects as template_objects
from space.node.templates.objects import StreamRef
from space.node.templates.store import BASE_SPEC, Progress, TemplateStore, spec_digest
from space.objauth import ManifestKeys
from space.objstore import ObjectStore
from tests.node.poolkit import PoolFactory

pytestmark = [pytest.mark.anyio, pytest.mark.runtime]

KEYS = ManifestKeys([objauth.generate_key()])


async def _tiny_builder(spec: dict[str, Any], target: Path, cache_dir: Path, emit: Progress) -> None:
    (target / "etc").mkdir()
    (target / "etc" / "template-name").write_text(spec["name"])
    # Enough bytes that the download takes a moment, so the callers really overlap.
    (target / "blob").write_bytes(uuid.uuid4().bytes * (1 << 16))


class Builds:
    """A builder that counts: a refused stream must not be replaced by a build."""

    def __init__(self) -> None:
        self.n = 0

    async def __call__(self, spec: dict[str, Any], target: Path, cache_dir: Path, emit: Progress) -> None:
        self.n += 1
        await _tiny_builder(spec, target, cache_dir, emit)


async def _published(pool: Pool, cache: Path, objects: ObjectStore) -> tuple[dict[str, Any], StreamRef]:
    spec = copy.deepcopy(BASE_SPEC)
    spec["name"] = f"dl-{uuid.uuid4().hex[:8]}"
    origin = TemplateStore(pool, cache, builder=_tiny_builder, objects=objects, keys=KEYS)
    info = await origin.ensure(spec)
    published = await origin.publish(objects, info.name, info.digest)
    return spec, published.stream


async def test_concurrent_materializations_download_once(
    btrfs_pool: Pool, pool_factory: PoolFactory, tmp_path: Path
) -> None:
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    spec, _ = await _published(btrfs_pool, tmp_path / "origin-cache", objects)

    node = pool_factory("fresh-node")
    cache = tmp_path / "node-cache"  # empty: the stream must come from object storage
    # Two stores on one node: separate in-process flights, so only the cross-process lock joins them.
    first = TemplateStore(node, cache, objects=objects, keys=KEYS)
    second = TemplateStore(node, cache, objects=objects, keys=KEYS)
    calls = [first.ensure(spec) for _ in range(3)] + [second.ensure(spec) for _ in range(3)]
    infos = await asyncio.gather(*calls)

    assert first.downloads + second.downloads == 1
    assert len({(i.digest, i.path) for i in infos}) == 1
    assert await node.is_readonly(infos[0].path)
    assert (infos[0].path / "etc" / "template-name").read_text() == spec["name"]
    # Later callers find it on disk: no further download.
    await TemplateStore(node, cache, objects=objects, keys=KEYS).ensure(spec)
    assert first.downloads + second.downloads == 1


async def test_the_stream_is_named_by_the_hash_of_its_bytes_and_a_sealed_manifest(
    btrfs_pool: Pool, tmp_path: Path
) -> None:
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    spec, stream = await _published(btrfs_pool, tmp_path / "cache", objects)
    name, digest = spec["name"], spec_digest(spec)
    data = await objects.get_bytes(template_objects.stream_key(name, digest, stream.sha256))
    assert hashlib.sha256(data).hexdigest() == stream.sha256 and len(data) == stream.size
    doc = json.loads(await objects.get_bytes(template_objects.manifest_key(name, digest)))
    assert doc["kind"] == "template" and doc["mac"]["key_id"] == KEYS.current_id
    assert doc["body"]["stream"] == stream.public() and doc["body"]["spec"] == spec
    assert doc["body"]["binding"] == template_objects.binding(name, digest)
    assert await objects.list("templates") == sorted([template_objects.stream_key(name, digest, stream.sha256),
                                                     template_objects.manifest_key(name, digest)])


def _flip(data: bytes) -> bytes:
    return data[:100] + bytes([data[100] ^ 1]) + data[101:]


@pytest.mark.parametrize("damage", ["flipped", "truncated", "extended"])
async def test_a_stream_that_does_not_match_its_hash_is_refused_unreceived(
    btrfs_pool: Pool, pool_factory: PoolFactory, tmp_path: Path, damage: str
) -> None:
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    spec, stream = await _published(btrfs_pool, tmp_path / "origin-cache", objects)
    key = template_objects.stream_key(spec["name"], spec_digest(spec), stream.sha256)
    data = await objects.get_bytes(key)
    bad = {"flipped": _flip(data), "truncated": data[: len(data) // 2], "extended": data + b"\0" * 512}[damage]
    (tmp_path / "objects" / key).write_bytes(bad)

    node = pool_factory("fresh-node")
    builds = Builds()
    store = TemplateStore(node, tmp_path / "node-cache", builder=builds, objects=objects, keys=KEYS)
    for want in (None, stream):  # named by the template's manifest, or by a snapshot's
        with pytest.raises(ObjectTampered) as exc:
            await store.ensure(spec, stream=want)
        assert exc.value.details == {"key": key, "reason": objauth.CONTENT_MISMATCH}
    assert builds.n == 0
    assert await store.list() == []
    assert not list((node.root / "templates").iterdir())
    assert [p.name for p in (tmp_path / "node-cache" / "templates").iterdir()] == []


@pytest.mark.parametrize("edit", ["spec", "stream", "unsealed"])
async def test_a_rewritten_template_manifest_is_refused(
    btrfs_pool: Pool, pool_factory: PoolFactory, tmp_path: Path, edit: str
) -> None:
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    spec, stream = await _published(btrfs_pool, tmp_path / "origin-cache", objects)
    key = template_objects.manifest_key(spec["name"], spec_digest(spec))
    doc = json.loads(await objects.get_bytes(key))
    if edit == "spec":
        doc["body"]["spec"]["packages"] = [*doc["body"]["spec"]["packages"], "backdoor"]
    elif edit == "stream":
        doc["body"]["stream"]["sha256"] = "0" * 64
    else:
        doc = {"name": spec["name"], "digest": spec_digest(spec), "stream": stream.public()}
    await objects.put_bytes(key, json.dumps(doc).encode())

    node = pool_factory("fresh-node")
    builds = Builds()
    store = TemplateStore(node, tmp_path / "node-cache", builder=builds, objects=objects, keys=KEYS)
    with pytest.raises(ObjectTampered) as exc:
        await store.ensure(spec)
    assert exc.value.details["key"] == key
    assert exc.value.details["reason"] == (objauth.UNAUTHENTICATED if edit == "unsealed" else objauth.BAD_MAC)
    assert builds.n == 0 and store.downloads == 0 and await store.list() == []


async def test_a_stream_from_before_sealing_is_never_received(
    btrfs_pool: Pool, pool_factory: PoolFactory, tmp_path: Path
) -> None:
    """Only the old spec-named stream, no manifest: a buildable template is built instead (the
    stream is ignored, with a hint); one saved from a sandbox (no build possible) is refused."""
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    spec, stream = await _published(btrfs_pool, tmp_path / "origin-cache", objects)
    name, digest = spec["name"], spec_digest(spec)
    legacy = template_objects.legacy_stream_key(name, digest)
    (tmp_path / "objects" / legacy).write_bytes(await objects.get_bytes(
        template_objects.stream_key(name, digest, stream.sha256)))
    await objects.delete(template_objects.manifest_key(name, digest))

    node = pool_factory("fresh-node")
    builds = Builds()
    store = TemplateStore(node, tmp_path / "node-cache", builder=builds, objects=objects, keys=KEYS)
    lines: list[str] = []

    async def progress(line: str) -> None:
        lines.append(line)

    info = await store.ensure(spec, on_progress=progress)
    assert (builds.n, info.source, store.downloads) == (1, "build", 0)
    assert any("space objects migrate" in line for line in lines), lines
    await store.remove(name, info.digest)

    saved = {"name": f"sv-{uuid.uuid4().hex[:6]}", "from_snapshot": "snap-1", "sandbox": "sb-1",
             "parent_template_digest": "0" * 64}
    sd = spec_digest(saved)
    os.replace(tmp_path / "objects" / legacy, tmp_path / "objects" / template_objects.legacy_stream_key(
        saved["name"], sd))
    with pytest.raises(ObjectTampered) as exc:
        await store.ensure(saved)
    assert exc.value.details["reason"] == objauth.UNAUTHENTICATED
    assert exc.value.details["key"] == template_objects.legacy_stream_key(saved["name"], sd)


async def test_a_stream_a_snapshot_names_but_storage_lacks_is_not_replaced_by_a_build(
    btrfs_pool: Pool, pool_factory: PoolFactory, tmp_path: Path
) -> None:
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    spec, stream = await _published(btrfs_pool, tmp_path / "origin-cache", objects)
    node = pool_factory("fresh-node")
    builds = Builds()
    store = TemplateStore(node, tmp_path / "node-cache", builder=builds, objects=objects, keys=KEYS)
    other = StreamRef(sha256="1" * 64, size=stream.size)
    with pytest.raises(SnapshotCorrupt, match="is missing from object storage"):
        await store.ensure(spec, stream=other)
    assert builds.n == 0 and await store.list() == []
    # The one it names is received, verified.
    info = await store.ensure(spec, stream=stream)
    assert store.downloads == 1 and info.source == "receive"
    assert store.verified_path(spec["name"], info.digest, stream.sha256).exists()


async def test_what_object_storage_holds_wins_over_a_stream_of_the_nodes_own(
    btrfs_pool: Pool, pool_factory: PoolFactory, tmp_path: Path
) -> None:
    """The host's cache holds a stream of the same template from another pool (another lineage):
    a node materializing it while object storage holds the deployment's stream receives that one.
    Its sandboxes' disks ship as deltas against the template, found by the template's identity on
    the receiving node; with the cache's stream a drain off this node failed with 'cannot find
    parent subvolume' on every other node."""
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    spec, published = await _published(btrfs_pool, tmp_path / "origin-cache", objects)
    origin_blob = (btrfs_pool.template_path(spec["name"], spec_digest(spec)) / "blob").read_bytes()

    host_cache = tmp_path / "host-cache"
    elsewhere = TemplateStore(pool_factory("another-pool"), host_cache, builder=_tiny_builder)
    await elsewhere.ensure(spec)  # the same spec, built apart: other bytes, another identity
    assert elsewhere.stream_path(spec["name"], spec_digest(spec)).exists()

    node = pool_factory("node-with-host-cache")
    builds = Builds()
    store = TemplateStore(node, host_cache, builder=builds, objects=objects, keys=KEYS)
    info = await store.ensure(spec)
    assert (builds.n, store.downloads, info.source) == (0, 1, "receive")
    assert (info.path / "blob").read_bytes() == origin_blob
    assert store.verified_path(spec["name"], info.digest, published.sha256).exists()


async def test_with_object_storage_unreachable_the_nodes_own_stream_still_serves(
    btrfs_pool: Pool, pool_factory: PoolFactory, tmp_path: Path
) -> None:
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    spec, _ = await _published(btrfs_pool, tmp_path / "origin-cache", objects)
    host_cache = tmp_path / "host-cache"
    await TemplateStore(pool_factory("another-pool"), host_cache, builder=_tiny_builder).ensure(spec)

    class Down(ObjectStore):
        async def get_bytes(self, key: str) -> bytes:
            raise Unavailable("object storage unreachable")

    down = Down.from_url(str(tmp_path / "objects"))
    store = TemplateStore(pool_factory("node-offline"), host_cache, builder=Builds(), objects=down, keys=KEYS)
    info = await store.ensure(spec)
    assert info.source == "receive" and store.downloads == 0
