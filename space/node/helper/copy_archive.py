"""Place the files of an uploaded archive in a template: a ``copy`` of a spec's ``run`` (E2B's COPY).

This file is not imported by SPACE: :mod:`.build_scripts` hands its text to the template's own
``/usr/bin/python3`` inside a build sandbox (gVisor, no network, root over the work tree), so it
keeps to what Python 3.8 has and imports nothing but the standard library. Arguments::

    ARCHIVE SRC DEST OWNER MODE WORKDIR USER

``ARCHIVE`` is the tar (gzipped or not) the builder wrote at the tree's top; the members under
``SRC`` (up to its first glob character: the client matched the globs when it made the archive)
go to ``DEST``: a file or link to that path (into it when it ends with ``/`` or is a directory), a
directory's contents merged into it. A relative ``DEST`` is under ``WORKDIR``, else ``USER``'s
home. Everything placed is owned by ``OWNER`` (``user[:group]``; else ``USER``; else root) and,
with ``MODE``, has that mode.

What it does to the tree a ``run`` step could do too, so the archive is trusted no further than
the template's author; the checks keep a copy doing what it says: no member outside the staging
directory or through a link, nothing but files, directories and links, no name twice, and a bound
on the bytes and members it may unpack. The archive and the staging directory are gone after.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import shutil
import sys
import tarfile
from typing import Any, NoReturn

#: What the members of one archive may declare in all (a gzip bomb stops here, not at a full disk).
MAX_BYTES = 8 << 30
MAX_MEMBERS = 1000000
_GLOB = "*?[{"


def fail(message: str) -> NoReturn:
    print(message)
    sys.exit(3)


def literal_prefix(src: str) -> str:
    """The path ``src`` names before its first glob character (E2B's clients glob on their side)."""
    parts: list[str] = []
    for part in src.split("/"):
        if any(c in part for c in _GLOB):
            break
        if part not in ("", "."):
            parts.append(part)
    return "/".join(parts)


def unpack(archive: str, into: str) -> tuple[int, int]:
    os.mkdir(into, 0o700)
    seen: set[str] = set()
    links: set[str] = set()
    total = 0
    members: list[tarfile.TarInfo] = []
    with tarfile.open(archive, "r:*") as tf:
        for m in tf:
            if len(members) >= MAX_MEMBERS:
                fail(f"the archive has more than {MAX_MEMBERS} members")
            parts = [p for p in m.name.split("/") if p not in ("", ".")]
            if not parts:
                continue
            if m.name.startswith("/") or ".." in parts:
                fail(f"the archive's member {m.name[:200]!r} is outside it")
            if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
                fail(f"the archive's member {m.name[:200]!r} is not a file, directory or link")
            name = "/".join(parts)
            if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
                fail(f"the archive's member {m.name[:200]!r} is under a symbolic link")
            if name in seen:
                fail(f"the archive has {m.name[:200]!r} twice")
            if m.islnk():
                target = [p for p in m.linkname.split("/") if p not in ("", ".")]
                if m.linkname.startswith("/") or ".." in target or "/".join(target) not in seen:
                    fail(f"the archive's hard link {m.name[:200]!r} is not to an earlier member")
                m.linkname = "/".join(target)
            seen.add(name)
            if m.issym():
                links.add(name)
            total += m.size
            if total > MAX_BYTES:
                fail(f"the archive unpacks to more than {MAX_BYTES} bytes")
            m.name = name
            members.append(m)
        kwargs: dict[str, Any] = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
        tf.extractall(into, members=members, numeric_owner=True, **kwargs)  # checked above
    return len(members), total


def ids_of(owner: str, user: str) -> tuple[int, int]:
    name, _, group = (owner or user or "root").partition(":")
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        fail(f"the template has no user {name!r} to own the copied files")
    gid = pw.pw_gid
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            fail(f"the template has no group {group!r} to own the copied files")
    return pw.pw_uid, gid


def home_of(user: str) -> str:
    try:
        return pwd.getpwnam(user or "root").pw_dir or "/"
    except KeyError:
        fail(f"the template has no user {user!r} (a relative destination is under its home)")


def is_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def own(path: str, uid: int, gid: int, mode: int | None) -> None:
    """``path`` and, for a directory, everything under it: owned by uid:gid, with ``mode``."""
    for top, dirs, files in os.walk(path) if is_dir(path) else [(None, [], [path])]:
        names = ([top] if top is not None else []) + [os.path.join(top or "", n) for n in dirs + files]
        for p in names:
            os.lchown(p, uid, gid)
            if mode is not None and not os.path.islink(p):
                os.chmod(p, mode)


def put(src: str, dest: str) -> None:
    """``src`` at ``dest``: directories merged, anything else replaced."""
    if is_dir(src) and is_dir(dest):
        for name in sorted(os.listdir(src)):
            put(os.path.join(src, name), os.path.join(dest, name))
        return
    if is_dir(dest):
        shutil.rmtree(dest)
    elif os.path.lexists(dest):
        os.unlink(dest)
    try:
        os.rename(src, dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.move(src, dest)


def main(argv: list[str]) -> None:
    archive, src, dest, owner, mode_text, workdir, user = argv
    stage = archive[: -len(".tar")]
    try:
        place(stage, archive, src, dest, owner, mode_text, workdir, user)
    finally:  # a failed copy fails the build, which is thrown away; a good one leaves no trace either
        shutil.rmtree(stage, ignore_errors=True)
        if os.path.lexists(archive):
            os.unlink(archive)


def place(stage: str, archive: str, src: str, dest: str, owner: str, mode_text: str, workdir: str,
          user: str) -> None:
    count, size = unpack(archive, stage)
    base = literal_prefix(src)
    source = os.path.join(stage, base) if base else stage
    if not os.path.lexists(source):
        fail(f"{src[:200]!r} is not among the uploaded files")
    target = dest if dest.startswith("/") else os.path.join(workdir or home_of(user), dest)
    uid, gid = ids_of(owner, user)
    mode = int(mode_text, 8) if mode_text else None
    if is_dir(source):
        own(source, uid, gid, mode)
        os.makedirs(target, exist_ok=True)
        for name in sorted(os.listdir(source)):
            put(os.path.join(source, name), os.path.join(target, name))
    else:
        if dest.endswith("/") or is_dir(target):
            target = os.path.join(target, os.path.basename(source))
        own(source, uid, gid, mode)
        os.makedirs(os.path.dirname(target) or "/", exist_ok=True)
        put(source, target)
    print(f"copied {src or '.'} ({count} members, {size} bytes) to {os.path.normpath(target)}")

if __name__ == "__main__":
    main(sys.argv[1:])
