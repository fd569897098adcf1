"""The deployment's master key and the AES-256-GCM envelope of secret values.

Keys come from ``$SPACE_MASTER_KEY`` or ``<data dir>/master.key`` (created 0600 on first use):
base64 of 32 random bytes. Several keys may be given (separated by commas or whitespace, newest
first): values are encrypted under the first and decrypted under whichever ``key_id`` they name, so
a key can be rotated by putting a new one in front and re-encrypting (``CredentialManager.rekey``)
before the old one is dropped.

Every API replica must hold the same keys: with several replicas, set ``SPACE_MASTER_KEY``
rather than letting each data dir make its own file.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from space import keytext
from space.errors import Internal

KEY_BYTES = keytext.KEY_BYTES
NONCE_BYTES = 12
ENV_VAR = "SPACE_MASTER_KEY"
KEY_FILE = "master.key"
#: First byte of every ciphertext, so that a future format can be told apart.
FORMAT_V1 = b"\x01"


class MasterKeyError(Internal):
    """The deployment's key material is missing, malformed, or not the one a value was sealed with
    (code ``internal``: nothing the caller can fix)."""


def key_id(key: bytes) -> str:
    """A fingerprint naming a key (not a secret: a one-way hash, safe to store and log)."""
    return hashlib.sha256(b"space-master-key-id:v1\0" + key).hexdigest()[:16]


def aad(tenant: str, scope: str, name: str) -> bytes:
    """What a ciphertext is bound to: sealed for one secret, it does not open as another."""
    return "\0".join(("space-secret:v1", tenant, scope, name)).encode()


def generate_key() -> bytes:
    return os.urandom(KEY_BYTES)


def encode_key(key: bytes) -> str:
    return base64.b64encode(key).decode()


def parse_keys(text: str, where: str) -> list[bytes]:
    return keytext.parse(text, where, what="a key", error=MasterKeyError)


class Keyring:
    """Master keys, newest first: the first encrypts, any of them decrypts what it sealed."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise MasterKeyError("a keyring needs at least one key")
        for k in keys:
            if len(k) != KEY_BYTES:
                raise MasterKeyError(f"a master key must be {KEY_BYTES} bytes, got {len(k)}")
        self._keys = {key_id(k): AESGCM(k) for k in keys}
        self.current_id = key_id(keys[0])
        self.key_ids = tuple(key_id(k) for k in keys)

    @classmethod
    def load(cls, data_dir: Path | None, env: Mapping[str, str] | None = None) -> Keyring:
        """From ``$SPACE_MASTER_KEY`` if set, else ``<data_dir>/master.key`` (made on first use)."""
        env = os.environ if env is None else env
        text = env.get(ENV_VAR, "").strip()
        if text:
            return cls(parse_keys(text, ENV_VAR))
        if data_dir is None:
            raise MasterKeyError(f"no master key: set {ENV_VAR} or give a data directory")
        path = data_dir / KEY_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return cls(parse_keys(path.read_text(), str(path)))
        with os.fdopen(fd, "w") as f:
            f.write(encode_key(generate_key()) + "\n")
        return cls(parse_keys(path.read_text(), str(path)))

    def encrypt(self, plaintext: bytes, associated: bytes) -> tuple[bytes, str]:
        """``(ciphertext, key_id)``: version byte, a fresh random 96-bit nonce, then AES-GCM output."""
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._keys[self.current_id].encrypt(nonce, plaintext, associated)
        return FORMAT_V1 + nonce + sealed, self.current_id

    def decrypt(self, blob: bytes, associated: bytes, kid: str | None) -> bytes:
        aead = self._keys.get(kid or "")
        if aead is None:
            raise MasterKeyError(f"sealed under master key {kid!r}, which this deployment does not hold "
                                 f"(it holds {', '.join(self.key_ids)})", key_id=kid)
        if blob[:1] != FORMAT_V1 or len(blob) < 1 + NONCE_BYTES + 16:
            raise MasterKeyError("not a sealed secret value (unknown format)", key_id=kid)
        try:
            return aead.decrypt(blob[1:1 + NONCE_BYTES], blob[1 + NONCE_BYTES:], associated)
        except InvalidTag:
            # Wrong key, tampered bytes, or a ciphertext moved from another secret (the AAD differs).
            raise MasterKeyError("a secret value failed authentication: it was altered or belongs to "
                                 "another secret", key_id=kid) from None
