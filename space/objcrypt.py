"""Envelope encryption of a tenant's artifacts in object storage: the frame format and data keys.

Every artifact of a snapshot (a disk delta, a memory image file, a backup link) is encrypted on the
node as it streams to object storage, and decrypted as it streams back, under the snapshot's **data
key**: 32 random bytes the tenant's **key-encryption key** wraps (:mod:`space.kms`). The wrapped key
travels in the snapshot's sealed manifest; the plaintext key exists only in the node's memory.

One artifact's bytes::

    header   b"SPACEENC" | version (1) | frame size (u32, big-endian)
    frames   AES-256-GCM(frame of plaintext) | 16-byte tag, each; every frame holds ``frame size``
             bytes of plaintext except the last, which holds the rest (possibly none)

Each artifact gets a key of its own, derived from the data key and the artifact's **identity** (the
snapshot's binding and the artifact's name: HKDF-SHA256), so a nonce never repeats under a key: the
nonce is the frame's index. Each frame's associated data is the identity's digest, its index and
whether it is the last, so that a frame moved within the artifact (reordered), to another artifact
(swapped), a stream cut at a frame boundary (truncated) or extended past its last frame, and any
flipped bit are all refused (:class:`~space.errors.ObjectTampered`) -- before any plaintext of the
frame is released.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from space.errors import ObjectTampered

MAGIC = b"SPACEENC"
VERSION = 1
#: Plaintext bytes per frame: big enough that the tags and calls cost nothing measurable, small
#: enough that a reader holds one frame (it releases no byte of a frame before its tag checks).
FRAME = 256 * 1024
TAG = 16
DATA_KEY_BYTES = 32
_HEADER = struct.Struct("!8sBI")
_AAD = struct.Struct("!32sQ?")
_NONCE = struct.Struct("!4xQ")
#: Frames larger than this are not ours (the header is read from object storage).
_MAX_FRAME = 16 << 20
_KDF_INFO = b"space-artifact:v1\0"
#: Chunks at least this large are encrypted in a thread.
_OFF_LOOP = 64 * 1024

HEADER_BYTES = _HEADER.size


def new_data_key() -> bytes:
    return os.urandom(DATA_KEY_BYTES)


def identity(binding: bytes, name: str) -> bytes:
    """What an artifact is: its snapshot's canonical binding and its own name, digested."""
    return hashlib.sha256(b"space-artifact-identity:v1\0" + binding + b"\0" + name.encode()).digest()


@dataclass(frozen=True)
class ArtifactKey:
    """The key of one artifact: derived from its snapshot's data key and its identity."""

    key: bytes
    identity: bytes

    @classmethod
    def derive(cls, data_key: bytes, artifact: bytes) -> ArtifactKey:
        if len(data_key) != DATA_KEY_BYTES or len(artifact) != 32:
            raise ValueError("a data key is 32 bytes, an identity a 32-byte digest")
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_KDF_INFO + artifact).derive(data_key)
        return cls(key, artifact)

    def aad(self, index: int, last: bool) -> bytes:
        return _AAD.pack(self.identity, index, last)


def ciphertext_size(plaintext: int, frame: int = FRAME) -> int:
    """The stored size of ``plaintext`` bytes: the header, and a tag per frame (at least one)."""
    frames = max(1, -(-plaintext // frame))
    return HEADER_BYTES + plaintext + frames * TAG


class Encryptor:
    """Plaintext in, in pieces of any size; the artifact's bytes out."""

    def __init__(self, key: ArtifactKey, frame: int = FRAME) -> None:
        if not 0 < frame <= _MAX_FRAME:
            raise ValueError(f"frame size {frame} is out of range")
        self._key, self._aead, self._frame = key, AESGCM(key.key), frame
        self._pending = bytearray()
        self._index = 0
        self._header_sent = False
        self._done = False

    def _seal(self, plaintext: bytes | bytearray, last: bool) -> bytes:
        out = self._aead.encrypt(_NONCE.pack(self._index), bytes(plaintext), self._key.aad(self._index, last))
        self._index += 1
        return out

    def _header(self) -> bytes:
        if self._header_sent:
            return b""
        self._header_sent = True
        return _HEADER.pack(MAGIC, VERSION, self._frame)

    def update(self, data: bytes) -> bytes:
        """The frames ``data`` completes. A full frame is held back until more follows: only the
        end of the input says which frame is the last."""
        if self._done:
            raise ValueError("the artifact is finished")
        self._pending += data
        out = [self._header()]
        while len(self._pending) > self._frame:
            out.append(self._seal(self._pending[:self._frame], False))
            del self._pending[:self._frame]
        return b"".join(out)

    def finish(self) -> bytes:
        """The last frame (with what is left, possibly nothing)."""
        if self._done:
            raise ValueError("the artifact is finished")
        self._done = True
        return self._header() + self._seal(self._pending, True)


class Decryptor:
    """The artifact's bytes in, in pieces of any size; plaintext out, a frame at a time, each only
    once its tag checked. :meth:`finish` says whether the artifact ended where it should."""

    def __init__(self, key: ArtifactKey, *, what: str = "artifact") -> None:
        self._key, self._aead = key, AESGCM(key.key)
        self._what = what
        self._buf = bytearray()
        self._frame: int | None = None
        self._index = 0
        self._done = False

    def _refuse(self, why: str) -> ObjectTampered:
        return ObjectTampered(f"{self._what} is not what was encrypted: {why}", reason="decryption", object=self._what)

    def _open(self, sealed: bytes | bytearray, last: bool) -> bytes:
        try:
            out = self._aead.decrypt(_NONCE.pack(self._index), bytes(sealed), self._key.aad(self._index, last))
        except InvalidTag:
            where = "its last frame" if last else f"frame {self._index}"
            raise self._refuse(f"{where} does not authenticate (altered, moved, from another artifact, "
                               "or the stream was cut short)") from None
        self._index += 1
        return out

    def update(self, data: bytes) -> bytes:
        if self._done:
            raise self._refuse("bytes after its last frame")
        self._buf += data
        if self._frame is None:
            if len(self._buf) < HEADER_BYTES:
                return b""
            magic, version, frame = _HEADER.unpack_from(self._buf)
            if magic != MAGIC or version != VERSION or not 0 < frame <= _MAX_FRAME:
                raise self._refuse("no SPACE encryption header")
            self._frame = frame
            del self._buf[:HEADER_BYTES]
        sealed = self._frame + TAG
        out = []
        # A whole frame with more behind it is not the last one.
        while len(self._buf) > sealed:
            out.append(self._open(self._buf[:sealed], False))
            del self._buf[:sealed]
        return b"".join(out)

    def finish(self) -> bytes:
        """The last frame's plaintext; ObjectTampered if the artifact is cut short."""
        if self._done:
            raise self._refuse("finished twice")
        self._done = True
        if self._frame is None:
            raise self._refuse("no SPACE encryption header")
        if not TAG <= len(self._buf) <= self._frame + TAG:
            raise self._refuse("it ends inside a frame")
        return self._open(self._buf, True)


async def encrypt_stream(key: ArtifactKey, chunks: AsyncIterator[bytes], frame: int = FRAME) -> AsyncIterator[bytes]:
    """The artifact's bytes of the plaintext ``chunks``."""
    enc = Encryptor(key, frame)
    async for chunk in chunks:
        # A large chunk is encrypted off the event loop (a frame's AES-GCM is ~0.1 ms).
        out = await asyncio.to_thread(enc.update, chunk) if len(chunk) >= _OFF_LOOP else enc.update(chunk)
        if out:
            yield out
    yield enc.finish()
