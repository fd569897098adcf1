"""A build context's ``.dockerignore``, read as Docker reads it: what ``COPY``/``ADD`` never see.

One pattern a line (``#`` starts a comment line; blank lines are nothing); a leading ``/`` and
``./`` are dropped and the rest cleaned as a path. ``*`` is any run of characters but ``/``, ``?``
one such character, ``[...]`` a class (``[^...]`` its complement), ``\\`` escapes the next
character, and ``**`` any number of directories, none included. A pattern excludes a path it
matches and everything under a directory it matches; ``!pattern`` takes a path back in. The last
pattern that matches a path decides.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from space.errors import ValidationFailed

FILE: Final = ".dockerignore"
#: A .dockerignore larger than this is refused (Docker reads it whole too).
MAX_BYTES: Final = 1 << 20


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    include: bool  # a ``!`` rule: takes matching paths back in


@dataclass(frozen=True)
class DockerIgnore:
    rules: tuple[Rule, ...]

    @classmethod
    def of_context(cls, context: Path) -> DockerIgnore | None:
        """The context's ``.dockerignore``, or None without one."""
        path = context / FILE
        if not path.is_file():
            return None
        data = path.read_bytes()
        if len(data) > MAX_BYTES:
            raise ValidationFailed(f"{FILE} is larger than {MAX_BYTES} bytes", field="dockerignore")
        return cls.parse(data.decode("utf-8", "replace"))

    @classmethod
    def parse(cls, text: str) -> DockerIgnore:
        rules = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            include = line.startswith("!")
            line = line[1:].strip() if include else line
            cleaned = posixpath.normpath(line.lstrip("/")) if line.lstrip("/") else "."
            if cleaned.startswith("./"):
                cleaned = cleaned[2:]
            rules.append(Rule(re.compile(_regex(cleaned)), include))
        return cls(tuple(rules))

    def excluded(self, rel: str) -> bool:
        """Whether the context-relative posix path ``rel`` is left out of the build."""
        parts = rel.strip("/").split("/")
        candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        out = False
        for rule in self.rules:
            if any(rule.pattern.fullmatch(c) for c in candidates):
                out = not rule.include
        return out


def _regex(pattern: str) -> str:
    """Go's ``filepath.Match`` with Docker's ``**``, as a regular expression over posix paths."""
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):  # "**/": any directories, none included
                out.append("(?:.*/)?")
                i += 1
            else:
                out.append(".*")
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 2)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end]
                negate = body.startswith("^")
                body = body[1:] if negate else body
                out.append(f"[{'^' if negate else ''}{body.replace(chr(92), chr(92) * 2)}]")
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)
