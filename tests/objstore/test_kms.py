"""Key-encryption keys (space.kms): the local keyring, and AWS KMS on moto's server (loopback).

- a data key wraps and unwraps under its tenant's key, bound to its context: another snapshot's
  context, another key id or a flipped byte does not unwrap (ObjectTampered)
- local: a new root key wraps from then on and the old one still unwraps what it wrapped; a root
  dropped from the file makes its keys unavailable (KeyUnavailable naming the key)
- AWS KMS: a disabled key, one pending deletion or an unknown one refuses at once with
  KeyUnavailable naming the key and its state; enabled again, the same data key unwraps
- opened data keys are kept for their time to live only, and forgotten on demand; no provider for
  a key's KMS is KeyUnavailable, never another key
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest

from space.errors import InvalidRequest, KeyUnavailable, ObjectTampered
from space.kms import AWS_KMS, LOCAL, AwsKms, DataKeys, KeyRef, LocalKeyring, WrappedKey

CONTEXT = {"tenant": "acme", "sandbox": "s1", "snapshot": "n1"}
AWS_ENV = {"AWS_ACCESS_KEY_ID": "space-test", "AWS_SECRET_ACCESS_KEY": "space-test-secret",
           "AWS_DEFAULT_REGION": "us-east-1"}


def _root() -> bytes:
    return os.urandom(32)


# -- local ---------------------------------------------------------------------------------------


async def test_a_local_data_key_unwraps_only_under_its_key_and_context() -> None:
    ring = LocalKeyring([_root()])
    data_key, blob = await ring.generate("acme", CONTEXT)
    assert len(data_key) == 32 and data_key not in blob
    assert await ring.unwrap("acme", blob, CONTEXT) == data_key
    for key_id, context in (("globex", CONTEXT), ("acme", {**CONTEXT, "snapshot": "n2"})):
        with pytest.raises(ObjectTampered):
            await ring.unwrap(key_id, blob, context)
    bad = bytearray(blob)
    bad[-1] ^= 1
    with pytest.raises(ObjectTampered):
        await ring.unwrap("acme", bytes(bad), CONTEXT)


async def test_local_root_keys_rotate_and_a_dropped_one_makes_its_keys_unavailable(tmp_path: Path) -> None:
    old, new = _root(), _root()
    _, under_old = await LocalKeyring([old]).generate("acme", CONTEXT)
    rotated = LocalKeyring([new, old])
    data_key, under_new = await rotated.generate("acme", CONTEXT)
    assert await rotated.unwrap("acme", under_old, CONTEXT)
    assert await LocalKeyring([new]).unwrap("acme", under_new, CONTEXT) == data_key
    with pytest.raises(KeyUnavailable, match="no longer holds") as e:
        await LocalKeyring([new]).unwrap("acme", under_old, CONTEXT)
    assert e.value.details == {"key": "acme", "provider": LOCAL}

    path = tmp_path / "kek.key"
    LocalKeyring.create_file(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        LocalKeyring.create_file(path)
    assert len(base64.b64decode(path.read_text())) == 32
    LocalKeyring.from_file(path)


def test_key_refs_and_wrapped_keys_are_checked_as_they_are_read() -> None:
    with pytest.raises(InvalidRequest, match="unknown key provider"):
        KeyRef("vault", "k")
    with pytest.raises(InvalidRequest, match="invalid key id"):
        KeyRef(LOCAL, "../etc")
    ref = KeyRef(AWS_KMS, "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab")
    wrapped = WrappedKey(ref, b"\x01" * 100)
    assert WrappedKey.from_json(wrapped.to_json()) == wrapped
    for doc in ({"provider": LOCAL, "key_id": "k", "wrapped": "not base64!"},
                {"provider": LOCAL, "key_id": "k", "wrapped": "A" * 9000}, {"provider": LOCAL}, []):
        with pytest.raises(InvalidRequest):
            WrappedKey.from_json(doc)


async def test_opened_data_keys_live_for_their_ttl_only_and_no_provider_is_no_key() -> None:
    calls: list[str] = []

    class Counting(LocalKeyring):
        async def unwrap(self, key_id: str, blob: bytes, context: Any) -> bytes:
            calls.append(key_id)
            return await super().unwrap(key_id, blob, context)

    keys = DataKeys({LOCAL: Counting([_root()])}, ttl=60)
    data_key, wrapped = await keys.new(KeyRef(LOCAL, "acme"), CONTEXT)
    assert await keys.open(wrapped, CONTEXT) == data_key
    assert await keys.open(wrapped, CONTEXT) == data_key
    assert calls == ["acme"]
    with pytest.raises(ObjectTampered):  # the cache is per context too
        await keys.open(wrapped, {**CONTEXT, "sandbox": "s2"})
    keys.forget()
    await keys.open(wrapped, CONTEXT)
    assert calls == ["acme", "acme", "acme"]
    uncached = DataKeys({LOCAL: Counting([_root()])}, ttl=0)
    _, w = await uncached.new(KeyRef(LOCAL, "acme"), CONTEXT)
    await uncached.open(w, CONTEXT)
    await uncached.open(w, CONTEXT)
    assert calls[-2:] == ["acme", "acme"]

    with pytest.raises(KeyUnavailable, match="no aws-kms key provider"):
        await DataKeys({LOCAL: LocalKeyring([_root()])}).open(WrappedKey(KeyRef(AWS_KMS, "k"), b"x"), CONTEXT)


# -- AWS KMS on moto (the S3 tests' server, which serves KMS too) ---------------------------------------


@pytest.fixture
def kms(s3_endpoint: str) -> tuple[AwsKms, Any]:
    import botocore.session

    admin = botocore.session.get_session().create_client(
        "kms", region_name="us-east-1", endpoint_url=s3_endpoint,
        aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"], aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"])
    return AwsKms(endpoint_url=s3_endpoint, env=AWS_ENV), admin


async def test_aws_kms_wraps_under_the_tenants_key_bound_to_the_context(kms: tuple[AwsKms, Any]) -> None:
    provider, admin = kms
    arn = admin.create_key(Description="acme")["KeyMetadata"]["Arn"]
    data_key, blob = await provider.generate(arn, CONTEXT)
    assert len(data_key) == 32 and data_key not in blob
    assert await provider.unwrap(arn, blob, CONTEXT) == data_key
    with pytest.raises(ObjectTampered):
        await provider.unwrap(arn, blob, {**CONTEXT, "snapshot": "n2"})


async def test_aws_kms_refuses_a_disabled_deleted_or_unknown_key_and_works_again_once_enabled(
        kms: tuple[AwsKms, Any]) -> None:
    provider, admin = kms
    key_id = admin.create_key(Description="acme")["KeyMetadata"]["KeyId"]
    keys = DataKeys({AWS_KMS: provider}, ttl=0)
    data_key, wrapped = await keys.new(KeyRef(AWS_KMS, key_id), CONTEXT)

    admin.disable_key(KeyId=key_id)
    with pytest.raises(KeyUnavailable, match=f"AWS KMS key {key_id} is Disabled") as e:
        await keys.open(wrapped, CONTEXT)
    assert e.value.details == {"key": key_id, "provider": AWS_KMS, "key_state": "Disabled"}
    with pytest.raises(KeyUnavailable):
        await keys.new(KeyRef(AWS_KMS, key_id), CONTEXT)

    admin.enable_key(KeyId=key_id)
    assert await keys.open(wrapped, CONTEXT) == data_key

    admin.schedule_key_deletion(KeyId=key_id, PendingWindowInDays=7)
    with pytest.raises(KeyUnavailable, match="PendingDeletion"):
        await keys.open(wrapped, CONTEXT)

    unknown = "11111111-2222-3333-4444-555555555555"
    with pytest.raises(KeyUnavailable, match="NotFoundException") as e:
        await keys.open(WrappedKey(KeyRef(AWS_KMS, unknown), wrapped.blob), CONTEXT)
    assert e.value.details["kms_error"] == "NotFoundException"


async def test_a_rotation_rewraps_a_data_key_across_providers_and_a_refusing_key_stops_it(
        kms: tuple[AwsKms, Any]) -> None:
    provider, admin = kms
    key_id = admin.create_key(Description="acme's new key")["KeyMetadata"]["KeyId"]
    keys = DataKeys({LOCAL: LocalKeyring([_root()]), AWS_KMS: provider}, ttl=0)
    data_key, local = await keys.new(KeyRef(LOCAL, "acme"), CONTEXT)

    moved = await keys.rewrap(local, KeyRef(AWS_KMS, key_id), CONTEXT)
    assert moved.ref == KeyRef(AWS_KMS, key_id) and data_key not in moved.blob
    assert await keys.open(moved, CONTEXT) == data_key  # the same data key: nothing re-encrypted
    back = await keys.rewrap(moved, KeyRef(LOCAL, "acme-2"), CONTEXT)
    assert await keys.open(back, CONTEXT) == data_key
    with pytest.raises(ObjectTampered):  # bound to its context there as well
        await keys.open(moved, {**CONTEXT, "snapshot": "n2"})

    admin.disable_key(KeyId=key_id)
    with pytest.raises(KeyUnavailable):  # to a refusing key
        await keys.rewrap(local, KeyRef(AWS_KMS, key_id), CONTEXT)
    with pytest.raises(KeyUnavailable):  # from one
        await keys.rewrap(moved, KeyRef(LOCAL, "acme"), CONTEXT)


async def test_an_aws_kms_provider_without_credentials_asks_the_metadata_service_only_when_a_key_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node and API process makes the provider at start; without explicit credentials,
    botocore's chain asks the instance metadata service. That must wait for a tenant's AWS key:
    a deployment that uses none never sends a request there (nor waits on one)."""
    import socket
    import threading

    asked: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    asked.append(conn.recv(4096))
                except OSError:
                    asked.append(b"")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{listener.getsockname()[1]}/")
    monkeypatch.setenv("AWS_METADATA_SERVICE_TIMEOUT", "1")
    monkeypatch.setenv("AWS_METADATA_SERVICE_NUM_ATTEMPTS", "1")
    try:
        provider = AwsKms(env={}, endpoint_url="http://127.0.0.1:9")
        assert asked == []
        # The first use of a key resolves credentials: that is when the chain may ask.
        with pytest.raises(KeyUnavailable, match="this deployment has no AWS credentials"):
            await provider.generate("arn:aws:kms:us-east-1:000000000000:key/k", CONTEXT)
        assert asked and b"169.254.169.254" not in asked[0], asked
    finally:
        stop.set()
        t.join(timeout=5)
        listener.close()
