"""Keeping injected secrets from coming back to the sandbox in responses.

An upstream that echoes a request (a debugging endpoint, an error page quoting the Authorization
header, a JSON document of what it received) would otherwise hand the sandbox the very credential
it must never see, and the echo need not be verbatim. What is looked for, for each secret:

- its needles (:meth:`~space.gateway.registry.Secret.needles`: the header value, and the token
  after an auth scheme), and for a ``Basic`` value the decoded ``user:password`` and the password;
  each also in ISO-8859-1 when it has non-ASCII characters that has (a header echoed by a server
  that writes headers in Latin-1);
- the base64 of each (standard and URL alphabet, at any offset within a longer base64 text: the
  three alignments' stable characters);
- each of those spelled with escapes, any character any way: JSON (``\\uXXXX`` in either case,
  surrogate pairs, ``\\/``, ``\\"``, ``\\\\``...), percent-encoding (either case of hex) and ``+`` for a
  space.

Response headers get ``[REDACTED]`` in place of a match; bodies get a same-length run of ``*`` (a
streamed body's Content-Length stays true). Streamed bodies are masked across chunk boundaries.

Speed: most bodies hold no secret and no escape. Every literal form contains one of a few short
*anchors* (the bare token is inside the header value, an alignment of its base64 inside the base64
of the value), so a chunk is first searched for the anchors only (``bytes.__contains__``). Escapes
are decoded only around the escape characters a chunk holds, and searched there.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import functools
import re
from collections.abc import Iterable, Sequence

from space.gateway.registry import MIN_BARE, Secret

REDACTED_HEADER = "[REDACTED]"

Span = tuple[int, int]

#: One escape of either kind; a surrogate pair first, so that it decodes as one character.
_ESCAPE = (rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}"
           rb"|\\[\\/\"bfnrt]|%[0-9a-fA-F]{2}")
ESCAPES = re.compile(_ESCAPE)
#: The same, with ``+`` for a space (form encoding): used when a needle holds a space.
ESCAPES_PLUS = re.compile(_ESCAPE + rb"|\+")
_SHORT = {b"\\\\": b"\\", b"\\/": b"/", b'\\"': b'"', b"\\b": b"\b", b"\\f": b"\f", b"\\n": b"\n",
          b"\\r": b"\r", b"\\t": b"\t"}
#: The longest escape of one character: a surrogate pair (``\\uD83D\\uDE00``) or 4 UTF-8 bytes as %XX.
_MAX_ESCAPED_CHAR = 12


def _decode_escape(esc: bytes) -> bytes:
    if esc == b"+":
        return b" "
    if esc[:1] == b"%":
        return bytes([int(esc[1:], 16)])
    if len(esc) == 12:
        hi, lo = int(esc[2:6], 16), int(esc[8:12], 16)
        return chr(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)).encode()
    if len(esc) == 6:
        return chr(int(esc[2:], 16)).encode("utf-8", "surrogatepass")
    return _SHORT[esc]


def base64_cores(needle: bytes) -> set[bytes]:
    """The base64 characters that ``needle`` alone decides, at each of the three offsets it can sit
    at in a longer base64 text, in both alphabets (padding, and the characters shared with the
    neighbouring bytes, are left out)."""
    out = set()
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + needle)
        core = enc[-(-8 * k // 6):(8 * (k + len(needle))) // 6]
        out.add(core)
        out.add(core.translate(bytes.maketrans(b"+/", b"-_")))
    return out


def _latin1(needle: bytes) -> bytes | None:
    """A UTF-8 needle's ISO-8859-1 spelling, when it has one of its own: HTTP header values are
    Latin-1 to many servers (Python's among them), so an echoed ``é`` comes back as one byte."""
    try:
        other = needle.decode("utf-8").encode("latin-1")
    except UnicodeError:
        return None
    return other if other != needle else None


def _max_spelling(literal: bytes) -> int:
    """The longest a literal can be written with every character escaped."""
    text = literal.decode("utf-8", "replace")
    return sum(min(_MAX_ESCAPED_CHAR, max(6 * (1 + (ord(c) > 0xFFFF)), 3 * len(c.encode()))) for c in text)


class Redactor:
    """What one set of needles must never show: literal forms, anchors, and the escapes to decode.
    Build it with :meth:`of` (cached: the same secrets give the same redactor)."""

    def __init__(self, needles: Iterable[bytes]) -> None:
        given = {n for n in needles if n}
        if not given:
            raise ValueError("a redactor needs at least one needle")
        base = sorted(given | {v for n in given if (v := _latin1(n)) is not None}, key=len, reverse=True)
        literals = set(base)
        for n in base:
            if len(n) >= MIN_BARE:  # a short value's base64 fragments would mangle unrelated text
                literals |= base64_cores(n)
        #: Every literal form, longest first.
        self.literals: tuple[bytes, ...] = tuple(sorted(literals, key=len, reverse=True))
        #: The literals no other one is inside of: each literal holds one of these.
        self.anchors: tuple[bytes, ...] = tuple(
            a for a in self.literals if not any(b != a and b in a for b in self.literals))
        #: How long an escaped spelling of a literal can be: the window matches are sought in,
        #: and (less one) what a streamed body holds back.
        self.max_span = max(_max_spelling(lit) for lit in self.literals)
        plus = any(b" " in lit for lit in self.literals)
        self._escapes = (ESCAPES, ESCAPES_PLUS) if plus else (ESCAPES,)
        self._triggers = (b"\\", b"%", b"+") if plus else (b"\\", b"%")

    @classmethod
    def of(cls, needles: Iterable[bytes]) -> Redactor:
        return _cached(tuple(sorted(set(needles))))

    # ---- finding ----------------------------------------------------------------------------------

    def spans(self, data: bytes) -> list[Span]:
        """Where ``data`` shows a secret in any form: sorted, merged ``(start, end)`` pairs."""
        found: list[Span] = []
        if any(a in data for a in self.anchors):
            found += self._literal_spans(data)
        if any(t in data for t in self._triggers):
            for escapes in self._escapes:
                found += self._escaped_spans(data, escapes)
        return _merge(found)

    def _literal_spans(self, data: bytes) -> list[Span]:
        out = []
        for lit in self.literals:
            i = data.find(lit)
            while i >= 0:
                out.append((i, i + len(lit)))
                i = data.find(lit, i + 1)
        return out

    def _escaped_spans(self, data: bytes, escapes: re.Pattern[bytes]) -> list[Span]:
        """Matches that use an escape: only near one can they be, so only there is data decoded."""
        out: list[Span] = []
        region: list[re.Match[bytes]] = []
        reach = self.max_span
        for m in escapes.finditer(data):
            if region and m.start() - region[-1].end() > 2 * reach:
                out += self._decoded_spans(data, region)
                region = []
            region.append(m)
        if region:
            out += self._decoded_spans(data, region)
        return out

    def _decoded_spans(self, data: bytes, escs: Sequence[re.Match[bytes]]) -> list[Span]:
        lo, hi = max(0, escs[0].start() - self.max_span), min(len(data), escs[-1].end() + self.max_span)
        pieces: list[bytes] = []
        #: Per piece of the decoded text: where it starts there, where it starts and ends in data.
        dec_at: list[int] = []
        raw: list[Span] = []
        at, pos = 0, lo
        for m in escs:
            if m.start() > pos:
                pieces.append(data[pos:m.start()])
                dec_at.append(at)
                raw.append((pos, m.start()))
                at += m.start() - pos
            piece = _decode_escape(m.group())
            pieces.append(piece)
            dec_at.append(at)
            raw.append((m.start(), -m.end()))  # negative end: an escape, mapped as a whole
            at += len(piece)
            pos = m.end()
        if hi > pos:
            pieces.append(data[pos:hi])
            dec_at.append(at)
            raw.append((pos, hi))
        decoded = b"".join(pieces)
        if not any(a in decoded for a in self.anchors):
            return []

        def to_raw(i: int, end: bool) -> int:
            k = bisect.bisect_right(dec_at, i if not end else i - 1) - 1
            start, stop = raw[k]
            if stop < 0:  # inside an escape: all of it
                return -stop if end else start
            return start + (i - dec_at[k])

        return [(to_raw(s, False), to_raw(e, True)) for s, e in self._literal_spans(decoded)]

    # ---- masking ----------------------------------------------------------------------------------

    def mask(self, data: bytes) -> bytes:
        """``data`` with every secret in it replaced by as many ``*``."""
        return mask(data, self.spans(data))

    def redact_text(self, text: str) -> str:
        """A header value with every secret in it replaced by ``[REDACTED]``."""
        raw = text.encode("utf-8", "surrogateescape")
        spans = self.spans(raw)
        if not spans:
            return text
        out, pos = [], 0
        for s, e in spans:
            out.append(raw[pos:s].decode("utf-8", "surrogateescape"))
            out.append(REDACTED_HEADER)
            pos = e
        out.append(raw[pos:].decode("utf-8", "surrogateescape"))
        return "".join(out)


@functools.lru_cache(maxsize=256)
def _cached(needles: tuple[bytes, ...]) -> Redactor:
    return Redactor(needles)


def _merge(spans: list[Span]) -> list[Span]:
    if len(spans) < 2:
        return spans
    spans.sort()
    out = [spans[0]]
    for s, e in spans[1:]:
        if s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def mask(data: bytes, spans: Iterable[Span]) -> bytes:
    spans = list(spans)
    if not spans:
        return data
    buf = bytearray(data)
    for s, e in spans:
        buf[s:e] = b"*" * (e - s)
    return bytes(buf)


class StreamRedactor:
    """A ``response.stream`` callable masking secrets, even across chunk boundaries.

    It holds back the last ``max_span - 1`` bytes of what it was given (raw, so that a match
    completed by the next chunk is found whole), and how many of those a match already found
    reaches into.
    """

    def __init__(self, redactor: Redactor | Iterable[bytes]) -> None:
        self.redactor = redactor if isinstance(redactor, Redactor) else Redactor.of(redactor)
        self.keep = self.redactor.max_span - 1
        self.tail = b""
        #: The first ``carry`` bytes of ``tail`` belong to a match found before.
        self.carry = 0

    def redact(self, data: bytes) -> bytes:
        return self.redactor.mask(data)

    def __call__(self, chunk: bytes) -> list[bytes]:
        if not chunk:  # the end of the body
            data, self.tail = self.tail, b""
            out = mask(data, _merge([(0, self.carry), *self.redactor.spans(data)]) if self.carry
                       else self.redactor.spans(data))
            self.carry = 0
            return [out] if out else []
        data = self.tail + chunk
        cut = len(data) - self.keep
        if cut <= 0:
            self.tail = data
            return []
        spans = self.redactor.spans(data)
        if self.carry:
            spans = _merge([(0, self.carry), *spans])
        self.carry = max((e - cut for s, e in spans if s < cut < e), default=0)
        self.tail = data[cut:]
        return [mask(data[:cut], ((s, min(e, cut)) for s, e in spans if s < cut))]


def basic_needles(value: str) -> list[bytes]:
    """For a ``Basic <base64>`` value, what an upstream that decoded it could echo: ``user:password``
    and the password alone (when it is long enough not to mangle unrelated text)."""
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic" or not token:
        return []
    try:
        pair = base64.b64decode(token, validate=True)
    except (binascii.Error, ValueError):
        return []
    _user, sep, password = pair.partition(b":")
    out = [pair] if sep else []
    if len(password) >= MIN_BARE:
        out.append(password)
    return out


def redact_text(text: str, needles: list[bytes]) -> str:
    return Redactor.of(needles).redact_text(text)


def needles_of(secrets: Iterable[Secret]) -> list[bytes]:
    out: list[bytes] = []
    for s in secrets:
        out.extend(s.needles())
        out.extend(basic_needles(s.value))
    return out
