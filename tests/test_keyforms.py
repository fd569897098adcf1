"""The E2B spelling of a SPACE API key (space.keyforms): a round trip for any key SPACE makes, and
anything else left as it came (to fail authentication on its own, never to raise)."""

from __future__ import annotations

import re
import secrets

from hypothesis import given
from hypothesis import strategies as st

from space.keyforms import API_KEY_PREFIX, E2B_PREFIX, MAX_KEY_CHARS, canonical, e2b_spelling


def test_a_key_and_its_e2b_spelling() -> None:
    key = API_KEY_PREFIX + secrets.token_urlsafe(30)
    spelled = e2b_spelling(key)
    assert re.fullmatch(r"e2b_[0-9a-f]+", spelled)  # what E2B's SDKs check
    assert canonical(spelled) == key
    assert canonical(spelled.upper().replace("E2B_", "e2b_")) == key  # hex of either case
    assert canonical(key) == key


@given(st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=80))
def test_every_printable_key_round_trips(tail: str) -> None:
    key = API_KEY_PREFIX + tail
    assert canonical(e2b_spelling(key)) == key


@given(st.text(max_size=300))
def test_anything_else_is_left_as_it_came(text: str) -> None:
    got = canonical(text)
    assert got == text or (text.startswith(E2B_PREFIX) and got.startswith(API_KEY_PREFIX))


def test_what_is_not_an_e2b_spelling_of_a_space_key_stays_as_it_is() -> None:
    for odd in ("e2b_", "e2b_zz", "e2b_abc",                      # not hex, odd length
                E2B_PREFIX + b"not-a-space-key".hex(),            # decodes, but to no sk_ key
                E2B_PREFIX + "sk_\u00e9".encode().hex(),          # not ASCII
                E2B_PREFIX + b"sk_a\nb".hex(),                    # a control character
                E2B_PREFIX + (API_KEY_PREFIX + "a" * MAX_KEY_CHARS).encode().hex()):  # too long to decode
        assert canonical(odd) == odd
