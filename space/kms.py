"""Key-encryption keys: a snapshot's data key wrapped and unwrapped under the tenant's key, which a
key management service holds (:mod:`space.objcrypt` encrypts the data).

A tenant's key is a :class:`KeyRef` -- which KMS, which key -- and every data key wrapped under it
is bound to what it protects (the *context*: tenant, sandbox, snapshot): a wrapped key copied into
another snapshot's manifest does not unwrap. Backends behind one interface (:class:`KeyProvider`):

- ``local`` (the default): the deployment's key-encryption key file holds root keys (base64 of 32
  bytes, newest first, like the manifest key); a tenant's key is derived from the newest root and
  its key id (HKDF-SHA256) and wraps with AES-256-GCM, the context as associated data. A root key
  dropped from the file makes what it wrapped unreadable.
- ``aws-kms``: AWS KMS ``GenerateDataKey`` / ``Decrypt`` with the context as the encryption
  context, the key's state checked first (``DescribeKey``), so that a disabled key or one pending
  deletion refuses at once, saying so (tested against moto's KMS server, which does not itself
  refuse a disabled key's ``Decrypt``).

A refusal is :class:`~space.errors.KeyUnavailable` naming the key, never a fallback to another key.
Unwrapped data keys are kept in memory for at most ``ttl`` seconds (:class:`DataKeys`), never written.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import os
import re
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from space import keytext
from space.errors import InvalidRequest, KeyUnavailable, ObjectTampered, Unavailable
from space.objauth import canonical
from space.objcrypt import DATA_KEY_BYTES, new_data_key

LOCAL, AWS_KMS = "local", "aws-kms"
PROVIDERS = (LOCAL, AWS_KMS)
#: What AWS KMS reads of an environment (a node's, or ``space serve``'s, passed to its agent on
#: the secrets pipe): credentials, region, and an endpoint of its own (a KMS-compatible server).
KMS_ENV = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
                     "AWS_DEFAULT_REGION", "SPACE_KMS_ENDPOINT"})
#: The local keyring's root key file, the same on every node of a deployment (space keys generate).
KEK_FILE = "kek.key"
#: A key id: a local name, or an AWS key id, ARN or alias (they are at most 2048 characters).
_KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9:/_.+=@-]{0,2047}")
#: A wrapped data key is a few hundred bytes (AWS KMS's CiphertextBlob is at most 6 KiB).
MAX_WRAPPED_BYTES = 6144


@dataclass(frozen=True)
class KeyRef:
    """A tenant's key-encryption key: which KMS, which key."""

    provider: str
    key_id: str

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise InvalidRequest(f"unknown key provider {self.provider!r} (one of {', '.join(PROVIDERS)})",
                                 field="provider")
        if not _KEY_ID.fullmatch(self.key_id):
            raise InvalidRequest(f"invalid key id {self.key_id[:80]!r}", field="key_id")

    def to_json(self) -> dict[str, str]:
        return {"provider": self.provider, "key_id": self.key_id}

    @classmethod
    def from_json(cls, doc: Any) -> KeyRef:
        if not isinstance(doc, Mapping) or not isinstance(doc.get("provider"), str) \
                or not isinstance(doc.get("key_id"), str):
            raise InvalidRequest("a key is {provider, key_id}")
        return cls(doc["provider"], doc["key_id"])


@dataclass(frozen=True)
class WrappedKey:
    """A data key as the KMS wrapped it, and under which key: what a manifest carries."""

    ref: KeyRef
    blob: bytes

    def to_json(self) -> dict[str, str]:
        return {**self.ref.to_json(), "wrapped": base64.b64encode(self.blob).decode()}

    @classmethod
    def from_json(cls, doc: Any) -> WrappedKey:
        ref = KeyRef.from_json(doc)
        wrapped = doc.get("wrapped")
        if not isinstance(wrapped, str) or len(wrapped) > MAX_WRAPPED_BYTES * 4 // 3 + 4:
            raise InvalidRequest("a wrapped key is base64 of at most 6 KiB")
        try:
            blob = base64.b64decode(wrapped, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest("a wrapped key is base64") from None
        return cls(ref, blob)


class KeyProvider(Protocol):
    """One KMS. ``context`` binds the data key to what it protects (every call passes the same)."""

    async def generate(self, key_id: str, context: Mapping[str, str]) -> tuple[bytes, bytes]:
        """A new data key: ``(plaintext, wrapped)``."""
        ...

    async def unwrap(self, key_id: str, blob: bytes, context: Mapping[str, str]) -> bytes:
        """The data key ``blob`` wraps; KeyUnavailable if the key refuses, ObjectTampered if the
        blob is not one the key wrapped for this context."""
        ...

    async def wrap(self, key_id: str, data_key: bytes, context: Mapping[str, str]) -> bytes:
        """``data_key`` (one another key wrapped) wrapped under ``key_id``: a rotation's re-wrap."""
        ...


# -- local ---------------------------------------------------------------------------------------


_LOCAL_VERSION = 1
_LOCAL_HEADER = struct.Struct("!B8s12s")
_LOCAL_INFO = b"space-kek:v1\0"


class LocalKeyring:
    """Keys derived from the deployment's root keys (``kek.key``; the first wraps, any unwraps)."""

    def __init__(self, roots: list[bytes]) -> None:
        if not roots:
            raise ValueError("a local keyring needs a root key")
        self._roots = {hashlib.sha256(r).digest()[:8]: r for r in roots}
        self._newest = hashlib.sha256(roots[0]).digest()[:8]

    @classmethod
    def from_file(cls, path: Path) -> LocalKeyring:
        return cls(keytext.parse(path.read_text(), str(path), what="a key-encryption root key", error=ValueError))

    @staticmethod
    def create_file(path: Path) -> None:
        """A new root key file (0600), unless there is one."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(base64.b64encode(os.urandom(keytext.KEY_BYTES)).decode() + "\n")

    def _kek(self, root_id: bytes, key_id: str) -> AESGCM:
        root = self._roots.get(root_id)
        if root is None:
            raise KeyUnavailable(f"the local key {key_id!r} was wrapped under a root key this deployment no "
                                 f"longer holds ({root_id.hex()})", key=key_id, provider=LOCAL)
        kek = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_LOCAL_INFO + key_id.encode()).derive(root)
        return AESGCM(kek)

    @staticmethod
    def _aad(key_id: str, context: Mapping[str, str]) -> bytes:
        return canonical({"key_id": key_id, "context": dict(context)})

    async def generate(self, key_id: str, context: Mapping[str, str]) -> tuple[bytes, bytes]:
        data_key = new_data_key()
        return data_key, await self.wrap(key_id, data_key, context)

    async def wrap(self, key_id: str, data_key: bytes, context: Mapping[str, str]) -> bytes:
        nonce = os.urandom(12)
        sealed = self._kek(self._newest, key_id).encrypt(nonce, data_key, self._aad(key_id, context))
        return _LOCAL_HEADER.pack(_LOCAL_VERSION, self._newest, nonce) + sealed

    async def unwrap(self, key_id: str, blob: bytes, context: Mapping[str, str]) -> bytes:
        if len(blob) < _LOCAL_HEADER.size or blob[0] != _LOCAL_VERSION:
            raise ObjectTampered("the wrapped data key is not one the local keyring made", reason="wrapped_key")
        _, root_id, nonce = _LOCAL_HEADER.unpack_from(blob)
        try:
            data_key = self._kek(root_id, key_id).decrypt(nonce, blob[_LOCAL_HEADER.size:], self._aad(key_id, context))
        except InvalidTag:
            raise ObjectTampered("the wrapped data key does not open under its key for this snapshot",
                                 reason="wrapped_key") from None
        return data_key


# -- AWS KMS -------------------------------------------------------------------------------------


#: AWS KMS errors that mean the key refuses (as opposed to the service being unreachable).
_REFUSALS = {"DisabledException", "KMSInvalidStateException", "NotFoundException", "AccessDeniedException",
             "KeyUnavailableException", "IncorrectKeyException", "InvalidKeyUsageException"}


class AwsKms:
    """AWS KMS through botocore (``endpoint_url``: a KMS-compatible endpoint such as moto's)."""

    def __init__(self, *, region: str | None = None, endpoint_url: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        try:
            import botocore.session
        except ImportError:  # pragma: no cover - the kms-aws extra is in every venv make setup builds
            raise Unavailable("AWS KMS needs botocore: pip install 'space-sandbox[kms-aws]'") from None
        env = os.environ if env is None else env
        self._session = botocore.session.get_session()
        if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
            # Given explicitly; otherwise botocore's own chain (an instance role, IRSA's web identity).
            self._session.set_credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                                          env.get("AWS_SESSION_TOKEN") or None)
        self._region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        self._endpoint = endpoint_url or env.get("SPACE_KMS_ENDPOINT") or None
        # Made on the first call, in its worker thread: making a client resolves credentials, and
        # without explicit ones botocore's chain asks the instance metadata service (seconds of
        # timeouts where there is none). A deployment no tenant of which uses AWS KMS never asks.
        self._client: Any = None
        self._making = threading.Lock()

    def _client_now(self) -> Any:
        with self._making:
            if self._client is None:
                self._client = self._session.create_client("kms", region_name=self._region,
                                                           endpoint_url=self._endpoint)
            return self._client

    def _call(self, op: str, key_id: str, **kw: Any) -> dict[str, Any]:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            result: dict[str, Any] = getattr(self._client_now(), op)(**kw)
            return result
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            message = exc.response.get("Error", {}).get("Message", "")
            if code in _REFUSALS:
                raise KeyUnavailable(f"AWS KMS refuses key {key_id}: {code}: {message}"[:500], key=key_id,
                                     provider=AWS_KMS, kms_error=code) from None
            if code == "InvalidCiphertextException":
                raise ObjectTampered("the wrapped data key does not open under its key for this snapshot",
                                     reason="wrapped_key") from None
            raise Unavailable(f"AWS KMS {op} failed: {code}: {message}"[:500], provider=AWS_KMS) from None
        except NoCredentialsError:
            # Not a passing outage: this deployment was given no way to call AWS KMS.
            raise KeyUnavailable(f"AWS KMS key {key_id} cannot be used: this deployment has no AWS credentials "
                                 "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile, or an instance or "
                                 "workload role)"[:500], key=key_id, provider=AWS_KMS) from None
        except BotoCoreError as exc:
            raise Unavailable(f"AWS KMS {op} failed: {exc}"[:500], provider=AWS_KMS) from None

    def _usable(self, key_id: str) -> None:
        meta = self._call("describe_key", key_id, KeyId=key_id).get("KeyMetadata", {})
        state = meta.get("KeyState") or ("Enabled" if meta.get("Enabled") else "Disabled")
        if state != "Enabled":
            raise KeyUnavailable(f"AWS KMS key {key_id} is {state}", key=key_id, provider=AWS_KMS, key_state=state)

    async def generate(self, key_id: str, context: Mapping[str, str]) -> tuple[bytes, bytes]:
        def call() -> tuple[bytes, bytes]:
            self._usable(key_id)
            r = self._call("generate_data_key", key_id, KeyId=key_id, KeySpec="AES_256",
                           EncryptionContext=dict(context))
            return bytes(r["Plaintext"]), bytes(r["CiphertextBlob"])
        return await asyncio.to_thread(call)

    async def unwrap(self, key_id: str, blob: bytes, context: Mapping[str, str]) -> bytes:
        def call() -> bytes:
            self._usable(key_id)
            r = self._call("decrypt", key_id, KeyId=key_id, CiphertextBlob=blob, EncryptionContext=dict(context))
            return bytes(r["Plaintext"])
        return await asyncio.to_thread(call)

    async def wrap(self, key_id: str, data_key: bytes, context: Mapping[str, str]) -> bytes:
        def call() -> bytes:
            self._usable(key_id)
            r = self._call("encrypt", key_id, KeyId=key_id, Plaintext=data_key, EncryptionContext=dict(context))
            return bytes(r["CiphertextBlob"])
        return await asyncio.to_thread(call)


# -- the node's and control plane's view ---------------------------------------------------------


class DataKeys:
    """Data keys made and opened through the providers; opened ones kept in memory for ``ttl``
    seconds (a restore opens its snapshot's key once per artifact)."""

    def __init__(self, providers: Mapping[str, KeyProvider], *, ttl: float = 60.0) -> None:
        self._providers = dict(providers)
        self.ttl = ttl
        self._cache: dict[tuple[str, str, bytes, bytes], tuple[float, bytes]] = {}

    def _provider(self, ref: KeyRef) -> KeyProvider:
        provider = self._providers.get(ref.provider)
        if provider is None:
            raise KeyUnavailable(f"this deployment has no {ref.provider} key provider configured (key {ref.key_id})",
                                 key=ref.key_id, provider=ref.provider)
        return provider

    async def new(self, ref: KeyRef, context: Mapping[str, str]) -> tuple[bytes, WrappedKey]:
        data_key, blob = await self._provider(ref).generate(ref.key_id, context)
        if len(data_key) != DATA_KEY_BYTES or not 0 < len(blob) <= MAX_WRAPPED_BYTES:
            raise Unavailable(f"{ref.provider} returned a data key of {len(data_key)} bytes")
        return data_key, WrappedKey(ref, blob)

    async def rewrap(self, wrapped: WrappedKey, ref: KeyRef, context: Mapping[str, str]) -> WrappedKey:
        """The same data key, wrapped under ``ref`` instead (a rotation: nothing is re-encrypted)."""
        data_key = await self.open(wrapped, context)
        blob = await self._provider(ref).wrap(ref.key_id, data_key, context)
        if not 0 < len(blob) <= MAX_WRAPPED_BYTES:
            raise Unavailable(f"{ref.provider} returned a wrapped key of {len(blob)} bytes")
        return WrappedKey(ref, blob)

    async def open(self, wrapped: WrappedKey, context: Mapping[str, str]) -> bytes:
        key = (wrapped.ref.provider, wrapped.ref.key_id, wrapped.blob, canonical(dict(context)))
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        data_key = await self._provider(wrapped.ref).unwrap(wrapped.ref.key_id, wrapped.blob, context)
        if len(data_key) != DATA_KEY_BYTES:
            raise ObjectTampered("the unwrapped data key is not 32 bytes", reason="wrapped_key")
        self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        if self.ttl > 0:
            self._cache[key] = (now + self.ttl, data_key)
        return data_key

    def forget(self) -> None:
        """Drop every data key held (a key revoked: the next open asks the KMS)."""
        self._cache.clear()
