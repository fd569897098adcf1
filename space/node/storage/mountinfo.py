"""This process's mount table (``/proc/self/mountinfo``), parsed once per call."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mount:
    mount_id: int
    target: str
    fstype: str
    source: str
    #: The per-mount options (``ro``/``rw``, ``nosuid``, ``nodev``, ``noexec``, atime flags).
    options: tuple[str, ...] = ()


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts() -> list[Mount]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        out.append(Mount(int(fields[0]), _unescape(fields[4]), tail[0], _unescape(tail[1]),
                         tuple(fields[5].split(","))))
    return out
