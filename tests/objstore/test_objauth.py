"""Sealed manifests (space.objauth): what a node trusts in object storage opens only under the
deployment's manifest key, only as the kind it was sealed as, and only for what it is bound to.

Aspects: a round trip keeps the body; a changed byte of the body, a moved key id, another key, an
unsealed (format 1) document, another kind, another binding are each refused with their stable
reason; re-encoding the document (indentation, key order) changes nothing; keys rotate (the first
seals, any opens); keys load from the environment before the file, and a missing or malformed key
is a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from space import objauth
from space.errors import ObjectTampered, SnapshotCorrupt
from space.objauth import ManifestKeyError, ManifestKeys

KEY = "tenants/t/sandboxes/sb/snapshots/sn/manifest.json"
BODY = {"binding": {"tenant": "t", "sandbox_id": "sb"}, "n": 3, "x": 1.5, "s": "é", "list": [1, None, True]}


def keys(n: int = 1) -> list[bytes]:
    return [objauth.generate_key() for _ in range(n)]


def refused(ring: ManifestKeys, data: bytes, kind: str = "snapshot") -> ObjectTampered:
    with pytest.raises(ObjectTampered) as exc:
        ring.open(data, kind, key=KEY, what="snapshot sn")
    assert exc.value.code == "object_tampered" and exc.value.details["key"] == KEY
    # Callers that handle corrupt snapshots handle this too.
    assert isinstance(exc.value, SnapshotCorrupt)
    return exc.value


def test_a_sealed_body_opens_as_it_was() -> None:
    ring = ManifestKeys(keys())
    doc = ring.seal("snapshot", BODY)
    opened = ring.open(doc, "snapshot", key=KEY, what="snapshot sn")
    assert opened.body == BODY and opened.key_id == ring.current_id
    raw = json.loads(doc)
    assert raw["format"] == 2 and raw["mac"]["alg"] == "hmac-sha256" and raw["mac"]["key_id"] == ring.current_id
    # Laid out differently (what a re-encoding does), it is the same value: it still opens.
    assert ring.open(json.dumps(raw).encode(), "snapshot", key=KEY, what="x").body == BODY


@pytest.mark.parametrize("change", [
    lambda d: d["body"].__setitem__("n", 4),
    lambda d: d["body"]["binding"].__setitem__("sandbox_id", "other"),
    lambda d: d["body"].__setitem__("extra", 1),
    lambda d: d["body"].pop("s"),
    lambda d: d["mac"].__setitem__("value", "0" * 64),
    lambda d: d.__setitem__("kind", "template"),
], ids=["a-value", "the-binding", "a-new-field", "a-removed-field", "the-mac", "the-kind"])
def test_any_change_fails_the_mac(change: object) -> None:
    ring = ManifestKeys(keys())
    doc = json.loads(ring.seal("snapshot", BODY))
    change(doc)  # type: ignore[operator]
    assert refused(ring, json.dumps(doc).encode()).details["reason"] == objauth.BAD_MAC


def test_another_deployments_key_is_unknown_and_a_forged_key_id_fails() -> None:
    mine, theirs = ManifestKeys(keys()), ManifestKeys(keys())
    doc = theirs.seal("snapshot", BODY)
    assert refused(mine, doc).details["reason"] == objauth.UNKNOWN_KEY
    # Claiming to be sealed under my key does not make it so.
    forged = json.loads(doc)
    forged["mac"]["key_id"] = mine.current_id
    assert refused(mine, json.dumps(forged).encode()).details["reason"] == objauth.BAD_MAC


def test_an_unsealed_manifest_is_unauthenticated_and_names_the_migration() -> None:
    ring = ManifestKeys(keys())
    legacy = json.dumps({"format": 1, "created_at": "x", "meta": {}, "artifacts": []}).encode()
    exc = refused(ring, legacy)
    assert exc.details["reason"] == objauth.UNAUTHENTICATED and "space objects migrate" in exc.message


@pytest.mark.parametrize("data", [b"{not json", b"[]", b"\xff\xfe", b'{"format": 2, "mac": {}}',
                                  b"[" * 100_000, b" " * (objauth.MAX_DOCUMENT_BYTES + 1)],
                         ids=["not-json", "not-an-object", "not-utf8", "malformed-seal", "deep", "huge"])
def test_garbage_is_refused(data: bytes) -> None:
    refused(ManifestKeys(keys()), data)


def test_a_template_manifest_does_not_pass_for_a_snapshots() -> None:
    ring = ManifestKeys(keys())
    exc = refused(ring, ring.seal("template", BODY), kind="snapshot")
    assert exc.details["reason"] == objauth.WRONG_KIND


def test_keys_rotate_the_first_seals_any_opens() -> None:
    old, new = keys(2)
    before = ManifestKeys([old]).seal("snapshot", BODY)
    ring = ManifestKeys([new, old])
    assert ring.open(before, "snapshot", key=KEY, what="x").key_id == objauth.key_id(old)
    assert json.loads(ring.seal("snapshot", BODY))["mac"]["key_id"] == objauth.key_id(new)
    # Once the old key is dropped, what it sealed no longer opens.
    assert refused(ManifestKeys([new]), before).details["reason"] == objauth.UNKNOWN_KEY


def test_a_binding_is_checked_exactly() -> None:
    expected = {"tenant": "t", "sandbox_id": "sb"}
    objauth.check_binding(BODY, expected, key=KEY, what="x")
    for wrong in ({"tenant": "t", "sandbox_id": "other"}, {"tenant": "t"},
                  {"tenant": "t", "sandbox_id": "sb", "snapshot_id": "sn"}):
        with pytest.raises(ObjectTampered) as exc:
            objauth.check_binding(BODY, wrong, key=KEY, what="x")
        assert exc.value.details["reason"] == objauth.BOUND_ELSEWHERE
    with pytest.raises(ObjectTampered):
        objauth.check_binding({}, expected, key=KEY, what="x")


def test_keys_load_from_the_environment_first_then_the_file(tmp_path: Path) -> None:
    a, b = keys(2)
    f = tmp_path / objauth.KEY_FILE
    f.write_text(objauth.encode_key(a) + "\n")
    assert ManifestKeys.load(env={}, key_file=f).current_id == objauth.key_id(a)  # type: ignore[union-attr]
    env = {objauth.ENV_VAR: f"{objauth.encode_key(b)}, {objauth.encode_key(a)}"}
    ring = ManifestKeys.load(env=env, key_file=f)
    assert ring is not None and ring.key_ids == (objauth.key_id(b), objauth.key_id(a))
    assert ManifestKeys.load(env={}) is None
    with pytest.raises(ManifestKeyError, match="SPACE_MANIFEST_KEY or pass --manifest-key-file"):
        ManifestKeys.require(env={})
    assert objauth.encode_key(a) not in repr(ManifestKeys([a]))


@pytest.mark.parametrize("text", ["not base64!", objauth.encode_key(b"short"), ""], ids=["base64", "length", "empty"])
def test_a_malformed_key_is_a_clear_error(tmp_path: Path, text: str) -> None:
    f = tmp_path / objauth.KEY_FILE
    f.write_text(text)
    with pytest.raises(ManifestKeyError, match=str(f)):
        ManifestKeys.load(env={}, key_file=f)
    with pytest.raises(ManifestKeyError, match="cannot read"):
        ManifestKeys.load(env={}, key_file=tmp_path / "missing.key")


def test_a_key_file_is_made_once_private(tmp_path: Path) -> None:
    f = tmp_path / objauth.KEY_FILE
    assert objauth.create_key_file(f) and (f.stat().st_mode & 0o777) == 0o600
    first = f.read_text()
    assert not objauth.create_key_file(f) and f.read_text() == first
    assert ManifestKeys.require(env={}, key_file=f).current_id == objauth.key_id(objauth.parse_keys(first, "f")[0])
