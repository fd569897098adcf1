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
#: Chunks :func:`encrypt_stream` encrypts ahead of its consumer.
_AHEAD = 4

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

    def _seal(self, plaintext: bytes | bytearray | memoryview, last: bool) -> bytes:
        out = self._aead.encrypt(_NONCE.pack(self._index), plaintext, self._key.aad(self._index, last))
        self._index += 1
        return out

    def _header(self) -> bytes:
        if self._header_sent:
            return b""
        self._header_sent = True
        return _HEADER.pack(MAGIC, VERSION, self._frame)

    def _complete(self, data: bytes | bytearray | memoryview) -> list[bytes | bytearray | memoryview]:
        """The plaintext frames ``data`` completes (views into it where whole, else assembled);
        a full frame is held back until more follows: only the end says which frame is last."""
        if self._done:
            raise ValueError("the artifact is finished")
        out: list[bytes | bytearray | memoryview] = []
        view = memoryview(data)
        if self._pending:
            take = view[:self._frame - len(self._pending)]
            self._pending += take
            view = view[len(take):]
            if len(self._pending) == self._frame and len(view) > 0:
                out.append(self._pending)
                self._pending = bytearray()
        if not self._pending:  # else ``data`` went into it whole
            while len(view) > self._frame:
                out.append(view[:self._frame])
                view = view[self._frame:]
            self._pending += view
        return out

    def update(self, data: bytes | bytearray | memoryview) -> bytearray:
        """The artifact's bytes ``data`` completes, sealed into one buffer (one allocation, no
        joining copy)."""
        plain = self._complete(data)
        header = self._header()
        out = bytearray(len(header) + sum(len(p) for p in plain) + TAG * len(plain))
        out[:len(header)] = header
        at = len(header)
        dest = memoryview(out)
        for p in plain:
            self._aead.encrypt_into(_NONCE.pack(self._index), p, self._key.aad(self._index, False),
                                    dest[at:at + len(p) + TAG])
            self._index += 1
            at += len(p) + TAG
        return out

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

    def _fail(self, last: bool) -> ObjectTampered:
        where = "its last frame" if last else f"frame {self._index}"
        return self._refuse(f"{where} does not authenticate (altered, moved, from another artifact, "
                            "or the stream was cut short)")

    def _open(self, sealed: bytes | bytearray | memoryview, last: bool) -> bytes:
        try:
            out = self._aead.decrypt(_NONCE.pack(self._index), sealed, self._key.aad(self._index, last))
        except InvalidTag:
            raise self._fail(last) from None
        self._index += 1
        return out

    def _complete(self, data: bytes | bytearray | memoryview) -> list[bytes | bytearray | memoryview]:
        """The sealed frames ``data`` completes (views into it where whole, else assembled); a
        whole frame with more behind it is not the last one, so one is held back until more comes."""
        if self._done:
            raise self._refuse("bytes after its last frame")
        view = memoryview(data)
        if self._frame is None:
            self._buf += view
            if len(self._buf) < HEADER_BYTES:
                return []
            magic, version, frame = _HEADER.unpack_from(self._buf)
            if magic != MAGIC or version != VERSION or not 0 < frame <= _MAX_FRAME:
                raise self._refuse("no SPACE encryption header")
            self._frame = frame
            view = memoryview(bytes(self._buf[HEADER_BYTES:]))
            self._buf = bytearray()
        sealed = self._frame + TAG
        out: list[bytes | bytearray | memoryview] = []
        if self._buf:
            take = view[:sealed - len(self._buf)]
            self._buf += take
            view = view[len(take):]
            if len(self._buf) == sealed and len(view) > 0:
                out.append(self._buf)
                self._buf = bytearray()
        if not self._buf:  # else ``data`` went into it whole
            while len(view) > sealed:
                out.append(view[:sealed])
                view = view[sealed:]
            self._buf += view
        return out

    def update(self, data: bytes | bytearray | memoryview) -> bytearray:
        """The plaintext of the frames ``data`` completes, in one buffer, each frame's tag checked
        before any of it is returned."""
        frames = self._complete(data)
        out = bytearray(sum(len(f) - TAG for f in frames))
        dest, at = memoryview(out), 0
        for f in frames:
            try:
                self._aead.decrypt_into(_NONCE.pack(self._index), f, self._key.aad(self._index, False),
                                        dest[at:at + len(f) - TAG])
            except InvalidTag:
                raise self._fail(False) from None
            self._index += 1
            at += len(f) - TAG
        return out

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


async def encrypt_stream(key: ArtifactKey, chunks: AsyncIterator[bytes],
                         frame: int = FRAME) -> AsyncIterator[bytes | bytearray]:
    """The artifact's bytes of the plaintext ``chunks``, encrypted up to :data:`_AHEAD` chunks
    ahead of the consumer: on two cores the encryption of one chunk overlaps the hashing and
    upload of the one before. An error of ``chunks`` comes out unchanged; ``chunks`` is closed
    however the stream ends."""
    enc = Encryptor(key, frame)
    queue: asyncio.Queue[bytes | bytearray | Exception | None] = asyncio.Queue(_AHEAD)

    async def produce() -> None:
        try:
            async for chunk in chunks:
                # A large chunk is encrypted off the event loop, in one piece: a consumer's work
                # per piece (a hash, a hop to a thread) is then per chunk, as without encryption.
                out = await asyncio.to_thread(enc.update, chunk) if len(chunk) >= _OFF_LOOP else enc.update(chunk)
                await queue.put(out)
            await queue.put(enc.finish())
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)
        finally:
            closing = getattr(chunks, "aclose", None)
            if closing is not None:
                await closing()

    producer = asyncio.create_task(produce())
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, Exception):
                raise item
            if item:
                yield item
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
