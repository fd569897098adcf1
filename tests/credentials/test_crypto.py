"""The master keyring: AES-256-GCM sealing, AAD binding, key files and rotation."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest

from space.credentials.crypto import ENV_VAR, KEY_FILE, Keyring, MasterKeyError, aad, generate_key, key_id

AAD = aad("acme", "tenant", "GITHUB_TOKEN")


def b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


def test_round_trip_with_fresh_nonce_each_time() -> None:
    ring = Keyring([generate_key()])
    one, kid = ring.encrypt(b"ghp_secret", AAD)
    two, _ = ring.encrypt(b"ghp_secret", AAD)
    assert kid == ring.current_id
    assert one != two  # random 96-bit nonce per value
    assert b"ghp_secret" not in one
    assert ring.decrypt(one, AAD, kid) == ring.decrypt(two, AAD, kid) == b"ghp_secret"


@pytest.mark.parametrize("other", [aad("evil", "tenant", "GITHUB_TOKEN"), aad("acme", "project:x", "GITHUB_TOKEN"),
                                   aad("acme", "tenant", "OTHER")])
def test_ciphertext_is_bound_to_tenant_scope_and_name(other: bytes) -> None:
    ring = Keyring([generate_key()])
    blob, kid = ring.encrypt(b"v", AAD)
    with pytest.raises(MasterKeyError, match="failed authentication"):
        ring.decrypt(blob, other, kid)


def test_tampered_ciphertext_is_refused() -> None:
    ring = Keyring([generate_key()])
    blob, kid = ring.encrypt(b"value", AAD)
    flipped = blob[:-1] + bytes([blob[-1] ^ 1])
    with pytest.raises(MasterKeyError):
        ring.decrypt(flipped, AAD, kid)
    with pytest.raises(MasterKeyError, match="unknown format"):
        ring.decrypt(b"\x02" + blob[1:], AAD, kid)


def test_rotation_decrypts_with_old_keys_and_encrypts_with_the_newest() -> None:
    old, new = generate_key(), generate_key()
    blob, kid = Keyring([old]).encrypt(b"value", AAD)
    rotated = Keyring([new, old])
    assert rotated.current_id == key_id(new) != kid
    assert rotated.decrypt(blob, AAD, kid) == b"value"
    resealed, kid2 = rotated.encrypt(b"value", AAD)
    assert kid2 == key_id(new)
    only_new = Keyring([new])
    assert only_new.decrypt(resealed, AAD, kid2) == b"value"
    with pytest.raises(MasterKeyError, match="does not hold"):
        only_new.decrypt(blob, AAD, kid)


def test_key_id_is_a_stable_fingerprint() -> None:
    key = generate_key()
    assert key_id(key) == key_id(key) != key_id(generate_key())
    assert len(key_id(key)) == 16 and b64(key) not in key_id(key)


def test_load_from_env_takes_a_list_newest_first(tmp_path: Path) -> None:
    new, old = generate_key(), generate_key()
    ring = Keyring.load(tmp_path, {ENV_VAR: f"{b64(new)}, {b64(old)}"})
    assert ring.key_ids == (key_id(new), key_id(old))
    assert not (tmp_path / KEY_FILE).exists()  # the environment wins: no file is made


@pytest.mark.parametrize("bad", ["not base64!", base64.b64encode(b"short").decode()])
def test_load_refuses_a_malformed_key(tmp_path: Path, bad: str) -> None:
    with pytest.raises(MasterKeyError, match=ENV_VAR):
        Keyring.load(tmp_path, {ENV_VAR: bad})


def test_key_file_is_made_once_with_mode_0600(tmp_path: Path) -> None:
    first = Keyring.load(tmp_path, {})
    path = tmp_path / KEY_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Keyring.load(tmp_path, {}).current_id == first.current_id
    # Rotation through the file: a new key on the first line, the old one kept after it.
    new = generate_key()
    path.write_text(f"{b64(new)}\n{path.read_text()}")
    assert Keyring.load(tmp_path, {}).key_ids == (key_id(new), first.current_id)


def test_no_key_without_env_or_data_dir() -> None:
    with pytest.raises(MasterKeyError, match="no master key"):
        Keyring.load(None, {})
