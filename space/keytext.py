"""Keys written as text, the one format of the deployment's keys (the master key, the manifest key):
base64 of ``KEY_BYTES`` random bytes, several separated by commas or whitespace, newest first."""

from __future__ import annotations

import base64
import binascii
import re

KEY_BYTES = 32


def parse(text: str, where: str, *, what: str, error: type[Exception]) -> list[bytes]:
    """The keys in ``text``, newest first; ``error(message)`` naming ``where`` for anything else."""
    keys: list[bytes] = []
    for item in (t for t in re.split(r"[\s,]+", text) if t):
        try:
            key = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise error(f"{where}: {what} is not valid base64") from None
        if len(key) != KEY_BYTES:
            raise error(f"{where}: {what} is {len(key)} bytes, expected {KEY_BYTES}")
        keys.append(key)
    if not keys:
        raise error(f"{where}: no {what.removeprefix('a ')}")
    return keys
