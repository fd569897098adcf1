"""Redaction of echoed secrets (finding 8), as properties: whatever the secret, whichever form an
upstream echoes it in (verbatim, JSON-escaped, percent-encoded, base64, Basic-decoded), and however
the body is cut into chunks, the sandbox never gets it back."""

from __future__ import annotations

import base64
import json
import re
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from space.credentials.manager import header_value, validate_format
from space.gateway.redact import REDACTED_HEADER, Redactor, StreamRedactor, base64_cores, needles_of, textual
from space.gateway.registry import Secret

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: What a header value may hold (no control characters: the control plane refuses them).
VALUE_CHARS = st.characters(min_codepoint=0x20, max_codepoint=0x10FFFF, blacklist_categories=("Cs", "Cc"),
                            blacklist_characters="\x7f")
#: Around an echo: the text of a JSON document, a query string, a page.
AROUND = st.text(alphabet=string.ascii_letters + string.digits + ' {}[]":,=&<>/.-_', max_size=60)


@st.composite
def secrets(draw: st.DrawFn) -> Secret:
    fmt = validate_format(draw(st.sampled_from(["Bearer {}", "token {}", "{}", "basic"])))
    token = draw(st.text(VALUE_CHARS, min_size=8, max_size=40).filter(lambda t: t.strip() == t))
    if fmt == "basic":
        token = draw(st.text(string.ascii_letters, min_size=1, max_size=10)) + ":" + token
    return Secret.from_doc({"name": "s", "secret_id": "s1", "hosts": ["api.example.com"], "header": "Authorization",
                            "value": header_value(fmt, token)})


def _hex(draw: st.DrawFn, n: int, width: int) -> str:
    digits = f"{n:0{width}x}"
    return "".join(c.upper() if draw(st.booleans()) else c for c in digits)


def json_spelling(draw: st.DrawFn, text: str) -> str:
    """``text`` as it can appear inside a JSON string: each character raw, ``\\uXXXX`` (either
    case) or its short escape."""
    out = []
    for c in text:
        cp = ord(c)
        forms = []
        if c not in '"\\' and cp >= 0x20:
            forms.append(c)
        if c in '"\\/':
            forms.append("\\" + c)
        if cp > 0xFFFF:
            hi, lo = 0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF)
            forms.append(f"\\u{_hex(draw, hi, 4)}\\u{_hex(draw, lo, 4)}")
        else:
            forms.append(f"\\u{_hex(draw, cp, 4)}")
        out.append(draw(st.sampled_from(forms)))
    return "".join(out)


def url_spelling(draw: st.DrawFn, raw: bytes) -> bytes:
    """``raw`` percent-encoded: each byte raw (unreserved ones) or ``%XX`` (either case), a space
    also ``+``."""
    out = []
    for b in raw:
        forms = [f"%{_hex(draw, b, 2)}".encode()]
        if chr(b) in string.ascii_letters + string.digits + "-._~":
            forms.append(bytes([b]))
        if b == 0x20:
            forms.append(b"+")
        out.append(draw(st.sampled_from(forms)))
    return b"".join(out)


def base64_spelling(draw: st.DrawFn, raw: bytes) -> bytes:
    """``raw`` inside a longer base64 text (any alignment), either alphabet, padded or not, maybe
    with its slashes JSON-escaped."""
    before = draw(st.binary(max_size=5))
    after = draw(st.binary(max_size=5))
    enc = (base64.urlsafe_b64encode if draw(st.booleans()) else base64.b64encode)(before + raw + after)
    if draw(st.booleans()):
        enc = enc.rstrip(b"=")
    if draw(st.booleans()):
        enc = enc.replace(b"/", b"\\/")
    return enc


Echo = tuple[Secret, bytes, str, bytes, slice]


@st.composite
def echoes(draw: st.DrawFn) -> Echo:
    """(secret, body, how it was spelled, the needle, where the spelling is in the body)."""
    secret = draw(secrets())
    needle = draw(st.sampled_from(needles_of([secret])))
    kind = draw(st.sampled_from(["raw", "json", "json_ascii", "url", "base64", "json_of_url"]))
    text = needle.decode()
    if kind == "raw":
        spelled = needle
    elif kind == "json":
        spelled = json_spelling(draw, text).encode()
    elif kind == "json_ascii":  # what json.dumps writes
        spelled = json.dumps(text)[1:-1].encode()
    elif kind == "url":
        spelled = url_spelling(draw, needle)
    elif kind == "base64":
        spelled = base64_spelling(draw, needle)
    else:  # a percent-encoded form inside a JSON string, escaped as JSON encoders escape
        spelled = json.dumps(url_spelling(draw, needle).decode())[1:-1].encode()
        if draw(st.booleans()):
            spelled = spelled.replace(b"/", b"\\/")
    before = draw(AROUND).encode()
    where = slice(len(before), len(before) + len(spelled))
    return secret, before + spelled + draw(AROUND).encode(), kind, needle, where


def stream(red: StreamRedactor, body: bytes, cuts: list[int]) -> bytes:
    out = []
    pos = 0
    for c in [*sorted(set(cuts)), len(body)]:
        if c > pos:
            out += red(body[pos:c])
            pos = c
    out += red(b"")
    return b"".join(out)


_ESCAPE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}"
                     rb"|\\[\\/\"bfnrt]|%[0-9a-fA-F]{2}")


def _unescape(data: bytes, plus: bool) -> bytes:
    """Every JSON and percent escape decoded, as a sandbox would (independently of the redactor)."""
    def one(m: re.Match[bytes]) -> bytes:
        e = m.group()
        if e[:1] == b"%":
            return bytes([int(e[1:], 16)])
        if len(e) == 12:
            return (chr(0x10000 + ((int(e[2:6], 16) - 0xD800) << 10) + int(e[8:12], 16) - 0xDC00)).encode()
        if len(e) == 6:
            return chr(int(e[2:], 16)).encode("utf-8", "surrogatepass")
        return {b"/": b"/", b'"': b'"', b"\\": b"\\", b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r",
                b"t": b"\t"}[e[1:]]
    out = _ESCAPE.sub(one, data)
    return out.replace(b"+", b" ") if plus else out


def _secret_part(secret: Secret, needle: bytes) -> bytes:
    """What of ``needle`` is secret: the smallest needle inside it (the token, not ``Bearer ``)."""
    inside = [n for n in needles_of([secret]) if n in needle]
    return min(inside, key=len)


def _revealed(kind: str, segment: bytes, secret: Secret, needle: bytes) -> bool:
    part = _secret_part(secret, needle)
    if kind == "base64":
        plain = segment.replace(b"\\/", b"/")
        return any(core in plain for core in base64_cores(part))
    return any(part in _unescape(segment, plus) for plus in (False, True))


@SETTINGS
@given(echo=echoes(), cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=12))
def test_an_echo_in_any_encoding_is_masked_streamed_and_buffered(echo: Echo, cuts: list[int]) -> None:
    secret, body, kind, needle, where = echo
    red = Redactor.of(needles_of([secret]))
    for out in (red.mask(body), stream(StreamRedactor(red), body, cuts)):
        assert len(out) == len(body)
        assert not _revealed(kind, out[where], secret, needle), (kind, body, out)
        # Nothing but masks changed.
        assert all(o == b or o == ord("*") for o, b in zip(out, body, strict=True))


@SETTINGS
@given(echo=echoes(), cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=12))
def test_streaming_masks_at_least_what_buffering_does(echo: Echo, cuts: list[int]) -> None:
    secret, body, *_ = echo
    red = Redactor.of(needles_of([secret]))
    whole, streamed = red.mask(body), stream(StreamRedactor(red), body, cuts)
    assert len(streamed) == len(body)
    for w, s, b in zip(whole, streamed, body, strict=True):
        assert s == ord("*") if w == ord("*") and b != ord("*") else s in (b, ord("*"))


@SETTINGS
@given(echo=echoes())
def test_a_header_echo_in_any_encoding_is_redacted(echo: Echo) -> None:
    secret, body, kind, needle, _ = echo
    red = Redactor.of(needles_of([secret]))
    text = body.decode("utf-8", "surrogateescape")
    out = red.redact_text(text)
    assert REDACTED_HEADER in out
    raw = out.encode("utf-8", "surrogateescape")
    if kind == "base64":
        assert not any(core in raw.replace(b"\\/", b"/") for core in base64_cores(needle))
    else:
        assert needle not in raw


@pytest.mark.parametrize("chunk", [1, 2, 5, 13, 64, 4096])
def test_examples_of_each_encoding(chunk: int) -> None:
    secret = Secret.from_doc({"name": "n", "secret_id": "s", "hosts": ["x.com"], "header": "Authorization",
                              "value": header_value("basic", "alice:pa/ss w0rd+é")})
    pair = "alice:pa/ss w0rd+é"
    forms = [
        json.dumps({"auth": secret.value}),                               # verbatim
        json.dumps({"pair": pair}),                                       # Basic-decoded, \u00e9
        json.dumps({"pw": "pa/ss w0rd+é"}, ensure_ascii=False).replace("/", "\\/"),  # the password, \/
        "q=" + "".join(f"%{b:02x}" for b in pair.encode()),               # percent, lower case
        "q=alice%3Apa%2Fss+w0rd%2B%C3%A9",                                # form encoding
        base64.b64encode(b"prefix:" + secret.value.encode()).decode(),    # base64 of the header value
        base64.urlsafe_b64encode(b"x" + pair.encode()).decode(),          # base64url of the pair
    ]
    red = Redactor.of(needles_of([secret]))
    body = ("\n".join(forms) + "\n").encode()
    out = stream(StreamRedactor(red), body, list(range(chunk, len(body), chunk)))
    assert len(out) == len(body)
    text = out.decode(errors="replace")
    assert "alice:pa" not in text and "w0rd" not in text and "YWxpY2U6cGEvc3Mg" not in text
    assert "%3Apa%2F" not in text and "3a%70%61" not in text.lower()
    assert base64.b64encode(pair.encode()).decode()[:12] not in text


def test_a_body_without_the_secret_is_untouched() -> None:
    secret = Secret.from_doc({"name": "n", "secret_id": "s", "hosts": ["x.com"], "header": "Authorization",
                              "value": "Bearer sk-live-0123456789abcdef"})
    red = Redactor.of(needles_of([secret]))
    body = (json.dumps({"url": "https://a.b/c?d=%20e+f", "esc": "\u00e9\\/\"", "b64": "c2stbGl2ZS0"}) * 50).encode()
    assert stream(StreamRedactor(red), body, list(range(7, len(body), 7))) == body
    assert red.redact_text("a=%41&b=\\u0042") == "a=%41&b=\\u0042"


@pytest.mark.parametrize(("value", "echo"), [
    ("ab%41cdefgh", b"ab%41c\\u0064efgh"),       # a "%" of the secret is no escape in a JSON spelling
    ("ab%41cdefgh", b"ab%2541cdefgh"),           # ... and is one, escaped, in a percent spelling
    ("x1 y\\zzzzzzzz", b"x1+y%5Czzzzzzzz"),        # "+" for the space, "%5C" for the backslash
    ("x1 y\\zzzzzzzz", b"x1 y\\\\zzz\\u007azzzz"),  # a JSON spelling: "\\\\" and "\\u007a"
], ids=["percent-in-secret-json", "percent-in-secret-percent", "form-backslash", "json-backslash"])
def test_a_secret_holding_escape_characters(value: str, echo: bytes) -> None:
    secret = Secret.from_doc({"name": "n", "secret_id": "s", "hosts": ["x.com"], "header": "X-Key", "value": value})
    red = Redactor.of(needles_of([secret]))
    body = b"<" + echo + b">"
    assert red.mask(body) == b"<" + b"*" * len(echo) + b">"
    assert stream(StreamRedactor(red), body, list(range(1, len(body)))) == red.mask(body)


def test_binary_media_types_are_searched_for_literal_forms_only() -> None:
    assert not textual("application/octet-stream") and not textual("image/png") and not textual("Application/Zip")
    assert textual(None) and textual("") and textual("application/json; charset=utf-8") and textual("text/html")
    assert textual("application/vnd.github+json") and textual("application/x-unknown")
    secret = Secret.from_doc({"name": "n", "secret_id": "s", "hosts": ["x.com"], "header": "Authorization",
                              "value": "Bearer sk-live-0123456789abcdef"})
    red = Redactor.of(needles_of([secret]))
    b64 = base64.b64encode(b"<<" + secret.value.encode()).decode()
    body = f"raw {secret.value} b64 {b64} pct sk%2Dlive%2D0123456789abcdef".encode()
    out = stream(StreamRedactor(red, escapes=False), body, list(range(3, len(body), 3)))
    assert b"sk-live" not in out and not any(core in out for core in base64_cores(b"sk-live-0123456789abcdef"))
    assert out.endswith(b"pct sk%2Dlive%2D0123456789abcdef")  # escapes are not decoded in a binary body
