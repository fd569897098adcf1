"""The snapshot shipping format on a local directory and on S3 (moto).

Aspects: an upload/download round trip keeps every byte and the meta; the manifest is written last,
sealed, and is the commit point (a crash before it leaves nothing restorable, and a retry works); a
stale manifest is removed before a new upload; a corrupted, truncated or deleted artifact is
SnapshotCorrupt naming the snapshot and the artifact, and nothing is left in the destination; a
manifest opens only under the deployment's key and for exactly its binding (ObjectTampered
otherwise, nothing downloaded); a subset of artifacts can be fetched; deleting a snapshot removes
everything.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space import objauth
from space.errors import InvalidRequest, NotFound, ObjectTampered, SnapshotCorrupt
from space.node.storage.artifacts import (
    MANIFEST,
    Artifact,
    delete_snapshot,
    download_snapshot,
    read_manifest,
    snapshot_binding,
    upload_snapshot,
)
from space.objauth import ManifestKeys
from space.objstore import ObjectStore
from tests.objstore.conftest import Backend

pytestmark = pytest.mark.anyio

PREFIX = "snapshots/sb-1/snap-1"
KEYS = ManifestKeys([objauth.generate_key()])
BOUND = snapshot_binding(tenant="t1", sandbox_id="sb-1", snapshot_id="snap-1", prefix=PREFIX)
SEALED = {"keys": KEYS, "binding": BOUND}


def make_inputs(tmp_path: Path) -> tuple[list[Artifact], dict[str, bytes]]:
    rng = random.Random(3)
    rootfs = rng.randbytes(2 * 1024 * 1024 + 17)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    files = {"checkpoint/checkpoint.img": rng.randbytes(4096), "checkpoint/pages.img": rng.randbytes(300_000)}
    for name, data in files.items():
        (ckpt / Path(name).name).write_bytes(data)

    async def send() -> AsyncIterator[bytes]:
        for i in range(0, len(rootfs), 64 * 1024):
            yield rootfs[i:i + 64 * 1024]

    artifacts = [Artifact(name="rootfs.btrfs.zst", stream=send)]
    artifacts += [Artifact(name=name, path=ckpt / Path(name).name) for name in files]
    return artifacts, {"rootfs.btrfs.zst": rootfs, **files}


async def test_round_trip(store: ObjectStore, tmp_path: Path) -> None:
    artifacts, contents = make_inputs(tmp_path)
    progress: list[str] = []

    async def on_progress(msg: str) -> None:
        progress.append(msg)

    meta = {"sandbox": "sb-1", "template_spec": {"image": "python:3.11"}}
    manifest = await upload_snapshot(store, PREFIX, artifacts, meta, on_progress=on_progress, **SEALED)
    assert [a.name for a in manifest.artifacts] == list(contents)
    for rec in manifest.artifacts:
        assert rec.size == len(contents[rec.name])
        assert rec.sha256 == hashlib.sha256(contents[rec.name]).hexdigest()
    assert progress[0] == "uploading rootfs.btrfs.zst (1/3)"
    assert any(m.startswith("uploaded checkpoint/pages.img: 300000 bytes") for m in progress)

    raw = json.loads(await store.get_bytes(f"{PREFIX}/{MANIFEST}"))
    assert raw["format"] == 2 and raw["kind"] == "snapshot" and raw["mac"]["key_id"] == KEYS.current_id
    assert raw["body"]["meta"] == meta and "created_at" in raw["body"] and raw["body"]["binding"] == BOUND

    again = await read_manifest(store, PREFIX, **SEALED)
    assert again == manifest

    dest = tmp_path / "restore"
    got = await download_snapshot(store, PREFIX, dest, **SEALED)
    assert got == manifest
    for name, data in contents.items():
        assert (dest / name).read_bytes() == data
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == sorted(contents)

    only = tmp_path / "only"
    await download_snapshot(store, PREFIX, only, names=["checkpoint/pages.img"], **SEALED)
    assert [str(p.relative_to(only)) for p in only.rglob("*") if p.is_file()] == ["checkpoint/pages.img"]
    with pytest.raises(NotFound, match="no artifact 'nope'"):
        await download_snapshot(store, PREFIX, tmp_path / "x", names=["nope"], **SEALED)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
async def test_damaged_artifact_is_corrupt(backend: Backend, tmp_path: Path, damage: str) -> None:
    store = backend.store
    artifacts, contents = make_inputs(tmp_path)
    await upload_snapshot(store, PREFIX, artifacts, {}, **SEALED)
    victim = "checkpoint/pages.img"
    key = f"{PREFIX}/{victim}"
    data = contents[victim]
    if damage == "flip":
        await backend.tamper(key, data[:1000] + bytes([data[1000] ^ 0xFF]) + data[1001:])
    elif damage == "truncate":
        await backend.tamper(key, data[:-1])
    else:
        await store.delete(key)

    dest = tmp_path / "restore"
    with pytest.raises(SnapshotCorrupt) as exc:
        await download_snapshot(store, PREFIX, dest, **SEALED)
    assert PREFIX in exc.value.message and victim in exc.value.message
    assert exc.value.details == {"snapshot": PREFIX, "artifact": victim}
    if damage == "delete":
        assert "missing" in exc.value.message
    # The artifacts downloaded before the damaged one were removed again.
    assert [p for p in dest.rglob("*") if p.is_file()] == []


async def test_crash_before_manifest_then_retry(store: ObjectStore, tmp_path: Path) -> None:
    artifacts, contents = make_inputs(tmp_path)

    class Crash(Exception):
        pass

    async def crash_midway() -> AsyncIterator[bytes]:
        yield b"partial data"
        raise Crash("the node died")

    # The first artifacts make it, the last one dies: like a node crashing mid-upload.
    with pytest.raises(Crash):
        await upload_snapshot(store, PREFIX, [*artifacts, Artifact(name="late", stream=crash_midway)], {}, **SEALED)
    assert await store.exists(f"{PREFIX}/rootfs.btrfs.zst")
    assert not await store.exists(f"{PREFIX}/{MANIFEST}")
    with pytest.raises(SnapshotCorrupt, match="has no manifest: its upload never finished"):
        await read_manifest(store, PREFIX, **SEALED)
    with pytest.raises(SnapshotCorrupt, match="no manifest"):
        await download_snapshot(store, PREFIX, tmp_path / "restore", **SEALED)

    # The retry succeeds and leaves exactly the new snapshot under the prefix.
    artifacts, contents = make_inputs(tmp_path)
    manifest = await upload_snapshot(store, PREFIX, artifacts, {"try": 2}, **SEALED)
    assert manifest.meta == {"try": 2}
    assert await store.list(PREFIX) == sorted([f"{PREFIX}/{n}" for n in contents] + [f"{PREFIX}/{MANIFEST}"])
    await download_snapshot(store, PREFIX, tmp_path / "restore", **SEALED)
    assert (tmp_path / "restore" / "rootfs.btrfs.zst").read_bytes() == contents["rootfs.btrfs.zst"]


async def test_reupload_removes_the_old_manifest_first(store: ObjectStore, tmp_path: Path) -> None:
    artifacts, _ = make_inputs(tmp_path)
    await upload_snapshot(store, PREFIX, artifacts, {"v": 1}, **SEALED)

    async def fails() -> AsyncIterator[bytes]:
        raise OSError("stream failed before any byte")
        yield b""  # pragma: no cover - makes this an async generator

    with pytest.raises(OSError, match="stream failed"):
        await upload_snapshot(store, PREFIX, [Artifact(name="rootfs.btrfs.zst", stream=fails)], {"v": 2},
                              **SEALED)
    # The v1 manifest must not survive to describe data that is no longer there.
    with pytest.raises(SnapshotCorrupt, match="no manifest"):
        await read_manifest(store, PREFIX, **SEALED)


async def test_unreadable_manifest(store: ObjectStore) -> None:
    """Sealed by this deployment but malformed (a bug, never an attacker: it cannot seal)."""
    key = f"{PREFIX}/{MANIFEST}"
    bad_bodies = [
        {"binding": BOUND, "created_at": "x", "meta": {}},
        {"binding": BOUND, "created_at": "x", "meta": {}, "artifacts": [{"name": "a"}]},
        {"binding": BOUND, "created_at": "x", "meta": {},
         "artifacts": [{"name": "../a", "size": 1, "sha256": "0" * 64}]},
        {"binding": BOUND, "created_at": "x", "meta": [], "artifacts": []},
    ]
    for body in bad_bodies:
        await store.put_bytes(key, KEYS.seal("snapshot", body))
        with pytest.raises(SnapshotCorrupt, match=f"snapshot {PREFIX} has an unreadable manifest"):
            await read_manifest(store, PREFIX, **SEALED)


async def test_a_manifest_not_sealed_by_this_deployment_is_tampered(store: ObjectStore) -> None:
    key = f"{PREFIX}/{MANIFEST}"
    unsealed = [
        b"{not json",
        b"[]",
        json.dumps({"format": 99, "created_at": "x", "meta": {}, "artifacts": []}).encode(),
        # What this code wrote before manifests were sealed: refused until `space objects migrate`.
        json.dumps({"format": 1, "created_at": "x", "meta": {}, "artifacts": []}).encode(),
        ManifestKeys([objauth.generate_key()]).seal("snapshot", {"binding": BOUND, "created_at": "x", "meta": {},
                                                                 "artifacts": []}),
    ]
    for data in unsealed:
        await store.put_bytes(key, data)
        with pytest.raises(ObjectTampered) as exc:
            await read_manifest(store, PREFIX, **SEALED)
        assert exc.value.details["key"] == key and exc.value.code == "object_tampered", data[:40]


async def test_a_changed_artifact_record_fails_the_seal(store: ObjectStore, tmp_path: Path) -> None:
    """The attacker who swaps an artifact and fixes its checksum in the manifest: refused before a
    byte is downloaded."""
    artifacts, _ = make_inputs(tmp_path)
    await upload_snapshot(store, PREFIX, artifacts, {}, **SEALED)
    key = f"{PREFIX}/{MANIFEST}"
    doc = json.loads(await store.get_bytes(key))
    other = b"someone else's memory"
    await store.put_bytes(f"{PREFIX}/checkpoint/pages.img", other)
    for a in doc["body"]["artifacts"]:
        if a["name"] == "checkpoint/pages.img":
            a["sha256"], a["size"] = hashlib.sha256(other).hexdigest(), len(other)
    await store.put_bytes(key, json.dumps(doc).encode())
    dest = tmp_path / "restore"
    with pytest.raises(ObjectTampered) as exc:
        await download_snapshot(store, PREFIX, dest, **SEALED)
    assert exc.value.details["reason"] == objauth.BAD_MAC
    assert not dest.exists()


@pytest.mark.parametrize("field", ["tenant", "sandbox_id", "snapshot_id", "prefix"])
async def test_a_valid_manifest_opens_only_for_what_it_was_written_for(store: ObjectStore, tmp_path: Path,
                                                                      field: str) -> None:
    artifacts, _ = make_inputs(tmp_path)
    await upload_snapshot(store, PREFIX, artifacts, {}, **SEALED)
    elsewhere = {**BOUND, field: "another"}
    with pytest.raises(ObjectTampered) as exc:
        await download_snapshot(store, PREFIX, tmp_path / "restore", keys=KEYS, binding=elsewhere)
    assert exc.value.details["reason"] == objauth.BOUND_ELSEWHERE and exc.value.details["fields"] == [field]
    assert not (tmp_path / "restore").exists()
    # Copied to another prefix (another sandbox's place), it is refused there too.
    moved = "snapshots/sb-2/snap-1"
    await store.put_bytes(f"{moved}/{MANIFEST}", await store.get_bytes(f"{PREFIX}/{MANIFEST}"))
    with pytest.raises(ObjectTampered):
        await read_manifest(store, moved, keys=KEYS,
                            binding=snapshot_binding(tenant="t1", sandbox_id="sb-2", snapshot_id="snap-1",
                                                     prefix=moved))


async def test_delete_snapshot(store: ObjectStore, tmp_path: Path) -> None:
    artifacts, _ = make_inputs(tmp_path)
    await upload_snapshot(store, PREFIX, artifacts, {}, **SEALED)
    await store.put_bytes("snapshots/sb-1/snap-10/keep", b"a neighbour with a longer name")
    await delete_snapshot(store, PREFIX)
    assert await store.list(PREFIX) == []
    assert await store.list("snapshots") == ["snapshots/sb-1/snap-10/keep"]
    await delete_snapshot(store, PREFIX)  # idempotent


async def test_invalid_artifact_lists(store: ObjectStore, tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x")
    with pytest.raises(InvalidRequest, match="exactly one"):
        Artifact(name="a")
    with pytest.raises(InvalidRequest, match="exactly one"):
        Artifact(name="a", path=f, stream=lambda: _empty())
    for names in (["a", "a"], [MANIFEST], ["../a"], ["a", "a/b"]):
        with pytest.raises(InvalidRequest):
            await upload_snapshot(store, PREFIX, [Artifact(name=n, path=f) for n in names], {}, **SEALED)
    with pytest.raises(InvalidRequest):
        await upload_snapshot(store, "", [Artifact(name="a", path=f)], {}, **SEALED)


async def _empty() -> AsyncIterator[bytes]:
    nothing: tuple[bytes, ...] = ()
    for chunk in nothing:
        yield chunk
