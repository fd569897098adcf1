"""Sandbox path rules, shared by the API, the node and (a copy in) the guest."""

from __future__ import annotations

import posixpath

from space.errors import InvalidPath

MAX_PATH = 4096


def normalize(path: str) -> str:
    """Return the normalized absolute sandbox path, or raise InvalidPath.

    A path must be absolute, free of NUL bytes and must not climb above ``/`` with ``..``: such a
    path is an attempt to escape, not a typo worth silently clamping.
    """
    if not path or not path.startswith("/"):
        raise InvalidPath(f"path must be absolute: {path!r}", path=path)
    if "\x00" in path:
        raise InvalidPath("path contains a NUL byte", path=path)
    if len(path) > MAX_PATH:
        raise InvalidPath(f"path longer than {MAX_PATH} bytes", path=path[:100])
    depth = 0
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            depth -= 1
            if depth < 0:
                raise InvalidPath(f"path escapes the sandbox root: {path!r}", path=path)
        else:
            depth += 1
    return posixpath.normpath(path).replace("//", "/")
