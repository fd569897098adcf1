"""The frame format of encrypted artifacts (space.objcrypt).

- round trips for every size around the frame boundaries, fed in pieces of any size
- nothing of the plaintext appears in the ciphertext
- refused, with no plaintext of the bad frame released: a flipped bit anywhere, frames reordered,
  a frame from another artifact of the same snapshot, the stream cut at a frame boundary or inside
  a frame, bytes after the last frame, another data key, a missing or wrong header
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator

import pytest

from space.errors import ObjectTampered
from space.objcrypt import (
    HEADER_BYTES,
    TAG,
    ArtifactKey,
    Decryptor,
    Encryptor,
    ciphertext_size,
    encrypt_stream,
    identity,
    new_data_key,
)

FRAME = 1024  # small frames: many of them in little data
BINDING = b'{"prefix":"tenants/t/sandboxes/s/snapshots/n","sandbox_id":"s","snapshot_id":"n","tenant":"t"}'


def _key(data_key: bytes, name: str = "rootfs.btrfs.zst") -> ArtifactKey:
    return ArtifactKey.derive(data_key, identity(BINDING, name))


def encrypt(key: ArtifactKey, data: bytes, pieces: int = 1) -> bytes:
    enc = Encryptor(key, FRAME)
    rng = random.Random(len(data) * 31 + pieces)
    out, at = [], 0
    while at < len(data):
        n = rng.randint(1, max(1, len(data) // pieces + 1))
        out.append(enc.update(data[at:at + n]))
        at += n
    out.append(enc.finish())
    return b"".join(out)


def decrypt(key: ArtifactKey, blob: bytes, piece: int = 777) -> bytes:
    dec = Decryptor(key, what="rootfs.btrfs.zst")
    out = [dec.update(blob[i:i + piece]) for i in range(0, len(blob), piece)]
    out.append(dec.finish())
    return b"".join(out)


@pytest.mark.parametrize("size", [0, 1, FRAME - 1, FRAME, FRAME + 1, 3 * FRAME, 3 * FRAME + 17])
@pytest.mark.parametrize("pieces", [1, 7])
def test_round_trips_at_every_size_in_pieces_of_any_size(size: int, pieces: int) -> None:
    key = _key(new_data_key())
    data = os.urandom(size)
    blob = encrypt(key, data, pieces)
    assert len(blob) == ciphertext_size(size, FRAME)
    assert decrypt(key, blob) == data
    assert decrypt(key, blob, piece=1) == data


def test_the_plaintext_does_not_appear_in_the_ciphertext() -> None:
    marker = b"SPACE-MARKER-do-not-leak-" * 200
    blob = encrypt(_key(new_data_key()), b"x" * 5000 + marker + b"y" * 5000)
    assert b"SPACE-MARKER" not in blob


def _refused(key: ArtifactKey, blob: bytes) -> str:
    with pytest.raises(ObjectTampered) as e:
        decrypt(key, blob)
    assert e.value.details["reason"] == "decryption"
    return e.value.message


def test_a_flipped_bit_anywhere_is_refused() -> None:
    key = _key(new_data_key())
    blob = bytearray(encrypt(key, os.urandom(3 * FRAME + 5)))
    for at in (0, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + FRAME + TAG + 3, len(blob) - 1):
        bad = bytearray(blob)
        bad[at] ^= 0x01
        _refused(key, bytes(bad))


def test_no_plaintext_of_a_bad_frame_is_released() -> None:
    key = _key(new_data_key())
    data = os.urandom(3 * FRAME)
    blob = bytearray(encrypt(key, data))
    blob[HEADER_BYTES + (FRAME + TAG) + 10] ^= 0x80  # inside the second frame
    dec = Decryptor(key)
    released = dec.update(bytes(blob[:HEADER_BYTES + FRAME + TAG + 1]))  # frame 0 and a byte of frame 1
    assert released == data[:FRAME]
    with pytest.raises(ObjectTampered, match="frame 1"):
        dec.update(bytes(blob[HEADER_BYTES + FRAME + TAG + 1:]))


def _frames(blob: bytes) -> tuple[bytes, list[bytes]]:
    body = blob[HEADER_BYTES:]
    return blob[:HEADER_BYTES], [body[i:i + FRAME + TAG] for i in range(0, len(body), FRAME + TAG)]


def test_reordered_swapped_truncated_and_extended_streams_are_refused() -> None:
    data_key = new_data_key()
    key = _key(data_key)
    header, frames = _frames(encrypt(key, os.urandom(3 * FRAME + 100)))
    assert len(frames) == 4
    _refused(key, header + frames[1] + frames[0] + frames[2] + frames[3])  # reordered
    assert "cut short" in _refused(key, header + b"".join(frames[:3]))  # cut at a frame boundary
    _refused(key, header + b"".join(frames)[:-1])  # cut inside the last frame
    _refused(key, header + b"".join(frames) + frames[3])  # a frame after the last
    # A frame of another artifact of the same snapshot (same data key, same position).
    _, other = _frames(encrypt(_key(data_key, "checkpoint/pages.img"), os.urandom(3 * FRAME + 100)))
    _refused(key, header + frames[0] + other[1] + frames[2] + frames[3])
    # The whole of another artifact.
    _refused(key, header + b"".join(other))


def test_another_data_key_or_no_header_is_refused() -> None:
    blob = encrypt(_key(new_data_key()), b"hello")
    _refused(_key(new_data_key()), blob)
    assert "no SPACE encryption header" in _refused(_key(new_data_key()), b"PLAINTEXT" * 10)
    assert "no SPACE encryption header" in _refused(_key(new_data_key()), b"")


def test_bytes_after_the_end_are_refused_and_the_encryptor_ends_once() -> None:
    key = _key(new_data_key())
    dec = Decryptor(key)
    dec.update(encrypt(key, b"abc"))
    assert dec.finish() == b"abc"
    with pytest.raises(ObjectTampered, match="after its last frame"):
        dec.update(b"x")
    enc = Encryptor(key)
    enc.finish()
    with pytest.raises(ValueError):
        enc.update(b"more")


async def test_the_stream_encrypts_what_the_iterator_yields() -> None:
    key = _key(new_data_key())
    data = os.urandom(5 * 256 * 1024 + 3)

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 100_000):
            yield data[i:i + 100_000]

    blob = b"".join([c async for c in encrypt_stream(key, chunks())])
    dec = Decryptor(key)
    assert dec.update(blob) + dec.finish() == data
