"""Shared keys: every replica is given the same ones, and one that is not refuses to start."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from space.cluster import keys
from space.cluster.keys import SharedKeyError, SharedKeys


def test_a_generated_set_loads_from_a_directory(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    written = keys.generate(d)
    assert {p.name for p in written} == {s.file for s in keys.ALL}
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in written)
    one, two = SharedKeys.load({}, d), SharedKeys.load({}, d)
    # Two replicas given the same directory hold the same keys.
    assert one.signing == two.signing and one.cluster_ca.fingerprint == two.cluster_ca.fingerprint
    assert one.keyring.key_ids == two.keyring.key_ids


def test_generate_never_replaces_a_key(tmp_path: Path) -> None:
    keys.generate(tmp_path)
    before = (tmp_path / "secret.key").read_bytes()
    with pytest.raises(SharedKeyError, match="refusing to replace"):
        keys.generate(tmp_path)
    assert (tmp_path / "secret.key").read_bytes() == before


def test_missing_keys_are_named_all_at_once(tmp_path: Path) -> None:
    with pytest.raises(SharedKeyError) as e:
        SharedKeys.load({}, None)
    for spec in keys.ALL:
        assert spec.env in e.value.message
    keys.generate(tmp_path)
    (tmp_path / "master.key").unlink()
    with pytest.raises(SharedKeyError) as e:
        SharedKeys.load({}, tmp_path)
    assert "SPACE_MASTER_KEY" in e.value.message and "SPACE_SECRET_KEY" not in e.value.message


def test_environment_wins_over_files_and_file_variables_are_read(tmp_path: Path) -> None:
    keys.generate(tmp_path / "a")
    keys.generate(tmp_path / "b")
    b = tmp_path / "b"
    env = {"SPACE_SECRET_KEY": "s" * 40, "SPACE_MASTER_KEY_FILE": str(b / "master.key"),
           "SPACE_CLUSTER_CA_CERT_FILE": str(b / "cluster-ca.pem"),
           "SPACE_CLUSTER_CA_KEY_FILE": str(b / "cluster-ca.key")}
    loaded = SharedKeys.load(env, tmp_path / "a")
    assert loaded.signing == b"s" * 40
    assert loaded.cluster_ca.fingerprint == SharedKeys.load({}, b).cluster_ca.fingerprint
    assert loaded.keyring.key_ids == SharedKeys.load({}, b).keyring.key_ids


def test_a_named_file_that_is_missing_is_an_error_not_an_absence(tmp_path: Path) -> None:
    keys.generate(tmp_path)
    with pytest.raises(SharedKeyError, match="does not exist"):
        SharedKeys.load({"SPACE_SECRET_KEY_FILE": str(tmp_path / "typo.key")}, tmp_path)


def test_unusable_keys_say_why(tmp_path: Path) -> None:
    keys.generate(tmp_path)
    with pytest.raises(SharedKeyError, match="at least 32"):
        SharedKeys.load({"SPACE_SECRET_KEY": "short"}, tmp_path)
    with pytest.raises(SharedKeyError, match="credential master key"):
        SharedKeys.load({"SPACE_MASTER_KEY": "not base64 !!"}, tmp_path)
    other = tmp_path / "other"
    keys.generate(other)
    with pytest.raises(SharedKeyError, match="cluster CA"):
        SharedKeys.load({"SPACE_CLUSTER_CA_KEY_FILE": str(other / "cluster-ca.key")}, tmp_path)
    (tmp_path / "secret.key").write_bytes(b"x" * (keys.MAX_KEY_BYTES + 1))
    with pytest.raises(SharedKeyError, match="more than"):
        SharedKeys.load({}, tmp_path)
