"""Encrypted snapshots (space.node.storage.artifacts with a Sealing), on a local directory and on
moto's S3, under the local keyring:

- a round trip gives back every artifact, streamed and from files; the manifest is of kind
  ``snapshot-encrypted``, carries the wrapped key, and records the stored (encrypted) sizes and
  hashes; no plaintext marker is in any stored byte
- a reader that cannot decrypt (an older node: it opens only ``snapshot``) refuses the manifest
- without the key, with a refused key, or with another shred secret, nothing is written: the
  download fails (KeyUnavailable, or ObjectTampered from the first frame) and leaves no file
- a retry uploads under a fresh data key
- the manifest's private part is encrypted, and opened only by a download
- a rotation's re-wrap rewrites the manifest under the new key and nothing else
- past the manifest's MAC, an edited private part or another snapshot's wrapped key opens nothing
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space import objauth
from space.errors import KeyUnavailable, ObjectTampered, SnapshotCorrupt
from space.kms import LOCAL, DataKeys, KeyRef, LocalKeyring
from space.node.storage.artifacts import (
    KIND,
    KIND_ENCRYPTED,
    MANIFEST,
    PRIVATE,
    Artifact,
    Sealing,
    download_snapshot,
    read_manifest,
    rewrap_snapshot,
    snapshot_binding,
    upload_snapshot,
)
from space.objauth import ManifestKeys
from space.objstore import ObjectStore

pytestmark = pytest.mark.anyio

PREFIX = "tenants/t1/sandboxes/sb-1/snapshots/snap-1"
KEYS = ManifestKeys([objauth.generate_key()])
BOUND = snapshot_binding(tenant="t1", sandbox_id="sb-1", snapshot_id="snap-1", prefix=PREFIX)
SEALED = {"keys": KEYS, "binding": BOUND}
MARKER = b"SPACE-SECRET-MARKER-0123456789"


def _data_keys(root: bytes) -> DataKeys:
    return DataKeys({LOCAL: LocalKeyring([root])}, ttl=0)


def _inputs(tmp_path: Path) -> tuple[list[Artifact], dict[str, bytes]]:
    rootfs = (os.urandom(100_000) + MARKER) * 20  # a little over 2 MB: several frames
    (tmp_path / "pages.img").write_bytes(MARKER * 10_000)
    (tmp_path / "empty.img").write_bytes(b"")

    async def send() -> AsyncIterator[bytes]:
        for i in range(0, len(rootfs), 65536):
            yield rootfs[i:i + 65536]

    return ([Artifact("rootfs.btrfs.zst", stream=send), Artifact("checkpoint/pages.img", path=tmp_path / "pages.img"),
             Artifact("checkpoint/empty.img", path=tmp_path / "empty.img")],
            {"rootfs.btrfs.zst": rootfs, "checkpoint/pages.img": MARKER * 10_000, "checkpoint/empty.img": b""})


async def _stored(store: ObjectStore, prefix: str) -> dict[str, bytes]:
    return {key: await store.get_bytes(key) for key in await store.list(prefix)}


async def test_an_encrypted_snapshot_round_trips_and_stores_no_plaintext(store: ObjectStore, tmp_path: Path) -> None:
    root, shred = os.urandom(32), os.urandom(32)
    keys = _data_keys(root)
    artifacts, contents = _inputs(tmp_path)
    sealing = Sealing(keys, KeyRef(LOCAL, "t1"), shred)

    manifest = await upload_snapshot(store, PREFIX, artifacts, {"env": {"TOKEN": MARKER.decode()}}, sealing=sealing,
                                     **SEALED)

    assert manifest.encryption is not None and manifest.encryption["key"]["key_id"] == "t1"
    for rec in manifest.artifacts:
        assert rec.size > len(contents[rec.name])  # the header and a tag per frame
    stored = await _stored(store, PREFIX)
    assert all(MARKER not in data for key, data in stored.items() if not key.endswith(MANIFEST))
    doc = json.loads(stored[f"{PREFIX}/{MANIFEST}"])
    assert doc["kind"] == KIND_ENCRYPTED
    # An older node, which opens only plain snapshots, refuses it rather than restore ciphertext.
    with pytest.raises(ObjectTampered, match="not a 'snapshot' one"):
        KEYS.open(stored[f"{PREFIX}/{MANIFEST}"], KIND, key="m", what="snapshot")

    dest = tmp_path / "restore"
    got = await download_snapshot(store, PREFIX, dest, sealing=Sealing(keys, KeyRef(LOCAL, "t1"), shred), **SEALED)
    assert got == manifest == await read_manifest(store, PREFIX, **SEALED)
    for name, data in contents.items():
        assert (dest / name).read_bytes() == data


async def test_without_its_key_or_shred_secret_nothing_is_restored(store: ObjectStore, tmp_path: Path) -> None:
    root, shred = os.urandom(32), os.urandom(32)
    artifacts, _ = _inputs(tmp_path)
    await upload_snapshot(store, PREFIX, artifacts, {}, sealing=Sealing(_data_keys(root), KeyRef(LOCAL, "t1"), shred),
                          **SEALED)
    dest = tmp_path / "restore"
    with pytest.raises(KeyUnavailable, match="no key for it came with the request"):
        await download_snapshot(store, PREFIX, dest, **SEALED)
    with pytest.raises(KeyUnavailable, match="no longer holds"):  # the root key it was wrapped under is gone
        other_root = Sealing(_data_keys(os.urandom(32)), KeyRef(LOCAL, "t1"), shred)
        await download_snapshot(store, PREFIX, dest, sealing=other_root, **SEALED)
    with pytest.raises(SnapshotCorrupt):  # another shred secret: the first frame does not authenticate
        other_shred = Sealing(_data_keys(root), KeyRef(LOCAL, "t1"), os.urandom(32))
        await download_snapshot(store, PREFIX, dest, sealing=other_shred, **SEALED)
    assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*"))


async def test_a_retry_uploads_under_a_fresh_data_key(store: ObjectStore, tmp_path: Path) -> None:
    keys, shred = _data_keys(os.urandom(32)), os.urandom(32)
    sealing = Sealing(keys, KeyRef(LOCAL, "t1"), shred)
    artifacts, _ = _inputs(tmp_path)
    first = await upload_snapshot(store, PREFIX, artifacts, {}, sealing=sealing, **SEALED)
    artifacts, contents = _inputs(tmp_path)
    second = await upload_snapshot(store, PREFIX, artifacts, {}, sealing=sealing, **SEALED)
    assert first.wrapped_key != second.wrapped_key
    assert first.artifact("rootfs.btrfs.zst").sha256 != second.artifact("rootfs.btrfs.zst").sha256
    dest = tmp_path / "restore"
    await download_snapshot(store, PREFIX, dest, sealing=Sealing(keys, KeyRef(LOCAL, "t1"), shred), **SEALED)
    assert (dest / "rootfs.btrfs.zst").read_bytes() == contents["rootfs.btrfs.zst"]


async def test_the_private_part_is_sealed_in_the_manifest_and_opened_by_the_download(
        store: ObjectStore, tmp_path: Path) -> None:
    keys, shred = _data_keys(os.urandom(32)), os.urandom(32)
    sealing = Sealing(keys, KeyRef(LOCAL, "t1"), shred)
    artifacts, _ = _inputs(tmp_path)
    private = {"env": {"TOKEN": MARKER.decode()}}
    await upload_snapshot(store, PREFIX, artifacts, {"public": 1}, private=private, sealing=sealing, **SEALED)
    stored = (await _stored(store, PREFIX))[f"{PREFIX}/{MANIFEST}"]
    assert MARKER not in stored
    # Read without opening its key (what a node does before it fetches the template): sealed.
    read = await read_manifest(store, PREFIX, **SEALED)
    assert set(read.meta[PRIVATE]) == {"sealed"} and read.meta["public"] == 1
    got = await download_snapshot(store, PREFIX, tmp_path / "restore", sealing=sealing, **SEALED)
    assert got.meta[PRIVATE] == private
    # Another shred secret does not open it (nor anything else of the snapshot).
    with pytest.raises((ObjectTampered, SnapshotCorrupt)):
        await download_snapshot(store, PREFIX, tmp_path / "other", **SEALED,
                                sealing=Sealing(keys, KeyRef(LOCAL, "t1"), os.urandom(32)))
    # Unencrypted, it is kept as it is.
    artifacts, _ = _inputs(tmp_path)
    plain = await upload_snapshot(store, PREFIX, artifacts, {}, private=private, **SEALED)
    assert plain.meta[PRIVATE] == private


async def test_a_rewrap_moves_the_data_key_under_the_new_key_and_leaves_the_artifacts(
        store: ObjectStore, tmp_path: Path) -> None:
    root, shred = os.urandom(32), os.urandom(32)
    keys = _data_keys(root)
    artifacts, contents = _inputs(tmp_path)
    before = await upload_snapshot(store, PREFIX, artifacts, {}, sealing=Sealing(keys, KeyRef(LOCAL, "t1"), shred),
                                   **SEALED)
    stored = await _stored(store, PREFIX)
    new = KeyRef(LOCAL, "t1-2027")

    # A key this deployment cannot use: refused, and the manifest stays as it was.
    refusing = DataKeys({}, ttl=0)
    with pytest.raises(KeyUnavailable):
        await rewrap_snapshot(store, PREFIX, data_keys=refusing, to=new, **SEALED)
    assert await _stored(store, PREFIX) == stored

    assert await rewrap_snapshot(store, PREFIX, data_keys=keys, to=new, **SEALED) == KeyRef(LOCAL, "t1")
    after = await read_manifest(store, PREFIX, **SEALED)
    assert after.wrapped_key is not None and after.wrapped_key.ref == new
    assert after.wrapped_key != before.wrapped_key and after.artifacts == before.artifacts
    rewritten = await _stored(store, PREFIX)
    assert {k: v for k, v in rewritten.items() if not k.endswith(MANIFEST)} == \
        {k: v for k, v in stored.items() if not k.endswith(MANIFEST)}
    # Again: nothing to do.
    assert await rewrap_snapshot(store, PREFIX, data_keys=keys, to=new, **SEALED) is None
    dest = tmp_path / "restore"
    await download_snapshot(store, PREFIX, dest, sealing=Sealing(keys, new, shred), **SEALED)
    for name, data in contents.items():
        assert (dest / name).read_bytes() == data


async def test_a_resigned_manifest_with_an_edited_private_part_or_another_snapshots_key_opens_nothing(
        store: ObjectStore, tmp_path: Path) -> None:
    """Past the manifest's MAC (an attacker holding the manifest key, or a bug that skipped the
    check), the encryption still binds: a private part edited byte for byte, or the wrapped key of
    another snapshot of the same tenant under the same key, opens nothing and writes no file."""
    keys, shred = _data_keys(os.urandom(32)), os.urandom(32)
    sealing = Sealing(keys, KeyRef(LOCAL, "t1"), shred)
    artifacts, _ = _inputs(tmp_path)
    await upload_snapshot(store, PREFIX, artifacts, {}, private={"env": {"A": "1"}}, sealing=sealing, **SEALED)
    other = "tenants/t1/sandboxes/sb-1/snapshots/snap-2"
    other_bound = snapshot_binding(tenant="t1", sandbox_id="sb-1", snapshot_id="snap-2", prefix=other)
    artifacts, _ = _inputs(tmp_path)
    await upload_snapshot(store, other, artifacts, {}, sealing=sealing, keys=KEYS, binding=other_bound)
    original = json.loads(await store.get_bytes(f"{PREFIX}/{MANIFEST}"))["body"]
    other_key = json.loads(await store.get_bytes(f"{other}/{MANIFEST}"))["body"]["encryption"]["key"]

    def flip_private(body: dict[str, object]) -> None:
        meta = body["meta"]
        assert isinstance(meta, dict)
        raw = bytearray(base64.b64decode(meta[PRIVATE]["sealed"]))
        raw[len(raw) // 2] ^= 1
        meta[PRIVATE] = {"sealed": base64.b64encode(bytes(raw)).decode()}

    def swap_key(body: dict[str, object]) -> None:
        enc = body["encryption"]
        assert isinstance(enc, dict)
        enc["key"] = other_key

    for edit in (flip_private, swap_key):
        body = json.loads(json.dumps(original))
        edit(body)
        await store.put_bytes(f"{PREFIX}/{MANIFEST}", KEYS.seal(KIND_ENCRYPTED, body))
        dest = tmp_path / f"restore-{edit.__name__}"
        with pytest.raises((ObjectTampered, SnapshotCorrupt)):
            await download_snapshot(store, PREFIX, dest, sealing=sealing, **SEALED)
        assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*")), edit.__name__
