"""Keeping injected secrets from coming back to the sandbox in responses.

An upstream that echoes a request (a debugging endpoint, an error page quoting the Authorization
header) would otherwise hand the sandbox the very credential it must never see. Response headers
get ``[REDACTED]``; bodies get a same-length run of ``*`` (a streamed body's Content-Length stays true).
"""

from __future__ import annotations

from collections.abc import Iterable

from space.gateway.registry import Secret

REDACTED_HEADER = "[REDACTED]"


class StreamRedactor:
    """A ``response.stream`` callable masking secrets, even across chunk boundaries.

    It holds back the last ``longest - 1`` bytes of each chunk; masks keep the length (a streamed
    body's Content-Length must stay true).
    """

    def __init__(self, needles: list[bytes]) -> None:
        self.needles = sorted(set(needles), key=len, reverse=True)
        self.keep = max(len(n) for n in self.needles) - 1
        self.buf = b""

    def redact(self, data: bytes) -> bytes:
        for n in self.needles:
            if n in data:
                data = data.replace(n, b"*" * len(n))
        return data

    def __call__(self, chunk: bytes) -> list[bytes]:
        if not chunk:  # the end of the body
            out, self.buf = self.redact(self.buf), b""
            return [out] if out else []
        data = self.redact(self.buf + chunk)
        cut = len(data) - self.keep
        if cut <= 0:
            self.buf = data
            return []
        self.buf = data[cut:]
        return [data[:cut]]


def redact_text(text: str, needles: list[bytes]) -> str:
    for n in sorted(needles, key=len, reverse=True):
        text = text.replace(n.decode(errors="replace"), REDACTED_HEADER)
    return text


def needles_of(secrets: Iterable[Secret]) -> list[bytes]:
    out: list[bytes] = []
    for s in secrets:
        out.extend(s.needles())
    return out
