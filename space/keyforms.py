"""The two spellings of a SPACE API key: SPACE's own (``sk_…``) and E2B's (``e2b_`` and lowercase
hex), which some versions of E2B's SDKs demand before they send anything ("Invalid API key format:
expected "e2b_" followed by hex characters").

The E2B spelling is the key's own text, hex-encoded: nothing is stored for it, any key has it, and
revoking the key revokes both. No dependencies: the CLI and the server both use it.
"""

from __future__ import annotations

#: What every key SPACE makes starts with.
API_KEY_PREFIX = "sk_"
E2B_PREFIX = "e2b_"
#: Longer than any key SPACE makes (43 characters); a longer e2b_ string is not decoded at all.
MAX_KEY_CHARS = 256


def e2b_spelling(key: str) -> str:
    """``key`` as E2B's SDKs accept it."""
    return E2B_PREFIX + key.encode().hex()


def canonical(given: str) -> str:
    """The key a client sent, in SPACE's spelling: an E2B spelling of an ``sk_`` key decoded, any
    other text as it came (it authenticates or not on its own)."""
    if not given.startswith(E2B_PREFIX) or len(given) > len(E2B_PREFIX) + 2 * MAX_KEY_CHARS:
        return given
    try:
        text = bytes.fromhex(given[len(E2B_PREFIX):]).decode("ascii")
    except ValueError:  # not hex, odd length, or not ASCII (UnicodeDecodeError is a ValueError)
        return given
    return text if text.startswith(API_KEY_PREFIX) and text.isprintable() else given
