"""Identifiers. Fixed length on purpose: runsc prefix-matches container ids, and E2B-style host
names (``<port>-<id>.<domain>``) need DNS-safe lowercase."""

from __future__ import annotations

import secrets

_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def _random(n: int) -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(n))


def sandbox_id() -> str:
    """20 characters, starts with a letter (host-name safe)."""
    return "s" + _random(19)


def operation_id() -> str:
    return "op-" + _random(20)


def command_id() -> str:
    return "c" + _random(15)


def apikey_id() -> str:
    return "key-" + _random(12)


def instance_id(sandbox: str) -> str:
    """runsc container id of one runtime instance of a sandbox: fixed length 26."""
    return f"{sandbox}-{_random(5)}"


def token(nbytes: int = 32) -> str:
    return secrets.token_urlsafe(nbytes)


def token_nonce() -> str:
    """A sandbox row's ``token_nonce`` (what its E2B tokens are made with: ``space.e2b.tokens``)."""
    return token(16)


def snapshot_id() -> str:
    """21 characters: ``snap-`` and 16 random (object-store keys and btrfs names both accept it)."""
    return "snap-" + _random(16)


def event_id() -> str:
    return "ev-" + _random(16)


def secret_id() -> str:
    return "sec-" + _random(16)
