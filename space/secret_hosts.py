"""Which host patterns a secret may be bound to.

The gateway adds a secret to every request whose host its patterns match, and the sandbox chooses
the host. A pattern that matches every host (``*``), or every name under a suffix where anyone can
register one (``*.com``, ``*.co.uk``, ``*.github.io``, ``*.s3.amazonaws.com``), therefore hands the
secret to a server the sandbox's owner runs. Such patterns are refused for every key, the operator's
included: no use of a credential needs to go to hosts nobody chose.

"Where anyone can register a name" is the Public Suffix List (ICANN and private sections), read
from the ``publicsuffix`` package's file (``scripts/setup-system.sh`` installs it). A wildcard
``*.X`` is too broad when ``X`` is a public suffix; the list's default rule makes every unlisted
top-level name one (``*.internal``). Without the list, every wildcard is refused (fail closed);
exact names always pass (they match one host).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

from space.errors import InvalidRequest

#: Where Debian's ``publicsuffix`` package puts the list.
PSL_FILES: tuple[Path, ...] = (Path("/usr/share/publicsuffix/public_suffix_list.dat"),)


@dataclasses.dataclass(frozen=True)
class PublicSuffixes:
    """The Public Suffix List's rules, in ASCII (IDNA) form; empty when the list was not found."""

    rules: frozenset[str]
    #: ``*.foo`` rules, as ``foo``.
    wildcards: frozenset[str]
    #: ``!www.ck`` rules, as ``www.ck``.
    exceptions: frozenset[str]
    found: bool

    @classmethod
    def load(cls, paths: Sequence[Path] = PSL_FILES) -> PublicSuffixes:
        for path in paths:
            try:
                text = path.read_text(encoding="utf-8")
            except OSError:
                continue
            return cls.parse(text.splitlines())
        return cls(frozenset(), frozenset(), frozenset(), found=False)

    @classmethod
    def parse(cls, lines: Iterable[str]) -> PublicSuffixes:
        rules, wildcards, exceptions = set(), set(), set()
        for raw in lines:
            line = raw.strip().split(None, 1)[0] if raw.strip() else ""
            if not line or line.startswith("//"):
                continue
            rule = _ascii(line.lstrip("!"))
            if rule is None:
                continue
            if line.startswith("!"):
                exceptions.add(rule)
            elif rule.startswith("*."):
                wildcards.add(rule[2:])
            else:
                rules.add(rule)
        return cls(frozenset(rules), frozenset(wildcards), frozenset(exceptions), found=True)

    def is_public(self, name: str) -> bool:
        """Whether ``name`` is itself a public suffix (strangers register names directly under it).
        Without the list every name counts as one."""
        if not self.found:
            return True
        name = name.lower().rstrip(".")
        if name in self.exceptions:
            return False
        if name in self.rules or "." not in name:  # "." absent: the default rule "*"
            return True
        return name.split(".", 1)[1] in self.wildcards


@functools.cache
def public_suffixes() -> PublicSuffixes:
    return PublicSuffixes.load()


def too_broad(pattern: str, suffixes: PublicSuffixes | None = None) -> str | None:
    """Why a (validated, lower-case) host pattern may not carry a secret; None when it may."""
    p = pattern.lower().rstrip(".")
    if p == "*":
        return "'*' matches every host: the sandbox could send the secret anywhere"
    if not p.startswith("*."):
        return None
    base = p[2:]
    psl = suffixes or public_suffixes()
    if not psl.found:
        return (f"{pattern!r} cannot be checked against the public suffix list, which is not installed "
                "(apt-get install publicsuffix): name the hosts instead")
    if psl.is_public(base):
        return (f"{pattern!r} matches every host under the public suffix {base!r}, where anyone can "
                "register a name: bind the secret to the hosts it is for")
    return None


def check(patterns: Iterable[str]) -> None:
    """:class:`InvalidRequest` (``field: hosts``) naming the first pattern too broad for a secret."""
    for p in patterns:
        reason = too_broad(p)
        if reason is not None:
            raise InvalidRequest(f"a secret's host pattern is too broad: {reason}", field="hosts", pattern=p)


def _ascii(rule: str) -> str | None:
    try:
        return ".".join(label if label == "*" else label.encode("idna").decode("ascii")
                        for label in rule.lower().split("."))
    except UnicodeError:
        return None
