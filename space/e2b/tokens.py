"""The E2B facade's two per-sandbox credentials, and how they are checked.

- The **envd access token** (``ea_…``, ``X-Access-Token``, and the key of signed ``/files`` URLs)
  is full control of the sandbox's guest: processes, files. Only keys that may write get it.
- The **traffic access token** (``ta_…``, ``E2B-Traffic-Access-Token``) opens the sandbox's ports
  when they are private, and nothing else: a preview link carries it, and must not grant exec.

Both are MACs under the deployment's secret of their purpose, the sandbox id and the sandbox row's
``token_nonce``: a random value made with the row, replaced by a rotation and by the sandbox's
delete. So a token names one sandbox row, never outlives a rotation, and never passes for a later
sandbox that gets the same id. Checking one is a MAC of a row the request names (looked up by its
id) and a constant-time compare: no scan, no token store.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Final

from space import ids
from space.store import Sandbox

ENVD_PREFIX: Final = "ea_"
TRAFFIC_PREFIX: Final = "ta_"
#: Longer than any token made here: a longer one is refused without work.
MAX_TOKEN: Final = 64


def fresh_nonce() -> str:
    """A new ``token_nonce``: every token made with the one before stops passing."""
    return ids.token_nonce()


def _mac(secret: bytes, purpose: str, sb: Sandbox) -> str:
    if not sb.token_nonce:
        raise ValueError(f"sandbox {sb.id} has no token nonce")
    msg = f"e2b-{purpose}\n{sb.id}\n{sb.token_nonce}".encode()
    return base64.urlsafe_b64encode(hmac.new(secret, msg, hashlib.sha256).digest()[:24]).decode().rstrip("=")


def envd_token(secret: bytes, sb: Sandbox) -> str:
    return ENVD_PREFIX + _mac(secret, "envd", sb)


def traffic_token(secret: bytes, sb: Sandbox) -> str:
    return TRAFFIC_PREFIX + _mac(secret, "traffic", sb)


def _same(expected: str, given: str) -> bool:
    if len(given) > MAX_TOKEN:
        return False
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def check_envd(secret: bytes, sb: Sandbox, token: str) -> bool:
    return bool(sb.token_nonce) and _same(envd_token(secret, sb), token)


def check_traffic(secret: bytes, sb: Sandbox, token: str) -> bool:
    return bool(sb.token_nonce) and _same(traffic_token(secret, sb), token)
