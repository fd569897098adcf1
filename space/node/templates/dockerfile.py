"""A Dockerfile's common subset as a template spec (the request form ``space-template.toml`` gives).

    space template build NAME -f Dockerfile [--context DIR] [--build-arg NAME=VALUE ...]

One stage, these instructions; anything else is refused with its line number:

- ``FROM [registry/]repository[:tag|@digest]``: a template from that container image (the control
  plane pins it and takes its config's defaults; a name without a registry host is Docker Hub's,
  ``python:3.12`` is ``docker.io/library/python:3.12``); ``FROM <template>`` (a SPACE template's
  name: no ``/``, tag or digest): derived from it. ``ARG`` values before it may be used in it.
- ``RUN`` (shell or JSON form): a build step, run with ``/bin/sh -c`` in the environment, working
  directory and user the instructions before it set, as a Dockerfile's are (:func:`in_context`).
- ``COPY`` / ``ADD`` of files and directories of the build context (the Dockerfile's directory unless
  ``--context``): each a ``run`` copy in its place among the ``RUN`` steps, its files in a tar
  uploaded by sha256 (made the same for the same files: names sorted, owners and times zeroed);
  links are copied as links, a directory's contents go into the destination, a file into it when
  it ends in ``/``. What the context's ``.dockerignore`` excludes is never sent
  (:mod:`.dockerignore`). Files are root's unless ``--chown=user[:group]`` (by name);
  ``--chmod=0NNN`` sets their mode; ``--from``, ``--link``, wildcards, URLs and archives that ``ADD``
  would unpack are refused.
- ``ENV``, ``ARG`` (``--build-arg`` overrides a default), ``WORKDIR``, ``USER`` (a name): what later
  instructions see; the last ``ENV``s, ``WORKDIR`` and ``USER`` are the template's defaults.
- ``CMD`` / ``ENTRYPOINT``: the template's start command (entrypoint then command), started in the
  background at every boot.
- ``EXPOSE`` and ``LABEL`` describe the image and change nothing here: accepted and ignored.

Variables (``$NAME``, ``${NAME}``, ``${NAME:-default}``, ``${NAME:+alternate}``) are substituted in
``FROM``, ``ENV``, ``ARG``, ``WORKDIR``, ``USER``, ``COPY`` and ``ADD`` from the ``ARG``s and ``ENV``s
before them, as Docker does; ``RUN``'s are the shell's.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import stat
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Final

from space.errors import SpaceError, ValidationFailed
from space.node.storage.pool import check_name
from space.node.templates.dockerignore import DockerIgnore
from space.node.templates.spec import (
    _OWNER,
    MAX_BLOB_BYTES,
    ParsedTemplate,
    _mode,
    canonical_reference,
    check_build_fields,
    check_user,
    file_sha256,
    in_context,
    is_reference,
    with_instructions,
)

#: Instructions this subset runs; the two after them are accepted and change nothing.
SUPPORTED: Final = ("FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "CMD", "ENTRYPOINT")
IGNORED: Final = ("EXPOSE", "LABEL")
MAX_BYTES: Final = 1 << 20
_VAR = re.compile(r"\\\$|\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<op>[-+])(?P<word>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class DockerfileError(ValidationFailed):
    """A line of the Dockerfile this subset does not build (the message names the line)."""


def _bad(line: int, why: str) -> DockerfileError:
    return DockerfileError(f"Dockerfile line {line}: {why}", field="dockerfile", line=line)


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction text) with continuations joined and comments dropped."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#"):
            if not pending and re.match(r"#\s*(escape|syntax)\s*=", stripped):
                raise _bad(number, "parser directives (# escape=, # syntax=) are not supported")
            continue
        if not pending:
            if not stripped:
                continue
            start = number
        if raw.rstrip().endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        pending.append(raw)
        out.append((start, " ".join(p.strip() for p in pending if p.strip())))
        pending = []
    if pending:
        out.append((start, " ".join(p.strip() for p in pending if p.strip())))
    return out


def substitute(text: str, values: dict[str, str], line: int) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "\\$":
            return "$"
        name = m["braced"] or m["bare"]
        value = values.get(name)
        if m["op"] == "-":
            return value if value else m["word"]
        if m["op"] == "+":
            return m["word"] if value else ""
        return value or ""

    if "${" in text and not re.fullmatch(r"(?:[^$]|\\\$|\$(?!\{)|\$\{[^}]*\})*", text):
        raise _bad(line, "an unterminated ${...}")
    return _VAR.sub(one, text)


def _exec_or_shell(args: str, line: int) -> list[str] | str:
    if args.startswith("["):
        try:
            form = json.loads(args)
        except ValueError:
            raise _bad(line, "a JSON form that is not a JSON array of strings") from None
        if not isinstance(form, list) or not form or not all(isinstance(a, str) for a in form):
            raise _bad(line, "a JSON form must be a non-empty array of strings")
        return form
    return args


def _pairs(args: str, line: int, what: str) -> list[tuple[str, str]]:
    """``NAME=value ...`` (shell-quoted), or the legacy ``NAME value``."""
    try:
        words = shlex.split(args)
    except ValueError as exc:
        raise _bad(line, f"{what}: {exc}") from None
    if words and "=" not in words[0]:
        if what == "ARG" and len(words) == 1:
            return [(words[0], "\0")]  # declared without a default
        name, _, rest = args.strip().partition(" ")
        if not rest.strip():
            raise _bad(line, f"{what} needs NAME=value")
        return [(name, rest.strip())]
    out = []
    for w in words:
        name, eq, value = w.partition("=")
        if not eq and what == "ARG":
            out.append((name, "\0"))
            continue
        if not eq:
            raise _bad(line, f"{what} takes NAME=value pairs, not {w[:40]!r}")
        out.append((name, value))
    for name, _ in out:
        if not _NAME.fullmatch(name):
            raise _bad(line, f"{what} name {name[:40]!r} is not a variable name")
    return out


def parse(text: str, context: Path, *, name: str, build_args: dict[str, str] | None = None,
          scratch: Path | None = None) -> ParsedTemplate:
    """The request spec of a Dockerfile's ``text``; COPY sources resolve under ``context``, and each
    COPY's files are archived into ``scratch`` (a new temporary directory if None: the caller
    removes it once the archives, the spec's blobs, are uploaded)."""
    if len(text.encode()) > MAX_BYTES:
        raise DockerfileError(f"a Dockerfile is limited to {MAX_BYTES} bytes", field="dockerfile")
    given = dict(build_args or {})
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    workdir: str | None = None
    user: str | None = None
    spec: dict[str, Any] = {"name": name}
    run: list[str | dict[str, Any]] = []
    start: list[str] | str | None = None
    entrypoint: list[str] | str | None = None
    seen_from = False
    for line, instruction in logical_lines(text):
        keyword, _, rest = instruction.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword in IGNORED:
            continue
        if keyword not in SUPPORTED:
            raise _bad(line, f"{keyword[:20]} is not an instruction SPACE builds "
                             f"(it builds {', '.join(SUPPORTED)}; {' and '.join(IGNORED)} are ignored)")
        if keyword != "ARG" and not seen_from and keyword != "FROM":
            raise _bad(line, f"{keyword} before FROM")
        values = {**args, **env}
        if keyword == "FROM":
            if seen_from:
                raise _bad(line, "a second FROM: multi-stage builds are not supported")
            seen_from = True
            words = substitute(rest, args, line).split()
            if len(words) != 1 or words[0].startswith("--"):
                raise _bad(line, "FROM takes one image or template (no AS, no --platform)")
            _from(spec, words[0], line)
        elif keyword == "ARG":
            for k, v in _pairs(rest, line, "ARG"):
                default = None if v == "\0" else substitute(v, values, line)
                value = given.pop(k, default)
                if value is not None:
                    args[k] = value
        elif keyword == "ENV":
            for k, v in _pairs(rest, line, "ENV"):
                env[k] = substitute(v, values, line)
        elif keyword == "WORKDIR":
            path = substitute(rest, values, line)
            workdir = str(PurePosixPath(workdir or "/") / path) if not path.startswith("/") else path
        elif keyword == "USER":
            who = substitute(rest, values, line).partition(":")[0]
            try:
                user = check_user(who)
            except ValidationFailed:
                raise _bad(line, f"USER {who[:40]!r}: SPACE names users by name, not by uid") from None
        elif keyword == "RUN":
            form = _exec_or_shell(rest, line)
            if isinstance(form, str) and "<<" in form and re.search(r"<<-?\s*['\"]?[A-Za-z_]+['\"]?\s*$", form):
                raise _bad(line, "RUN with a heredoc is not supported")
            cmd = shlex.join(form) if isinstance(form, list) else form
            run.append(in_context(cmd, {**args, **env}, workdir, user))
        elif keyword in ("COPY", "ADD"):
            run.extend(_copy(keyword, substitute(rest, values, line), workdir, line, context))
        elif keyword == "CMD":
            start = _exec_or_shell(rest, line)
        elif keyword == "ENTRYPOINT":
            entrypoint = _exec_or_shell(rest, line)
    if not seen_from:
        raise DockerfileError("the Dockerfile has no FROM", field="dockerfile")
    if given:
        raise DockerfileError(f"--build-arg {sorted(given)[0]} names no ARG of the Dockerfile", field="build_arg")
    blobs: dict[str, Path] = {}
    if any(isinstance(step, dict) for step in run):
        ignore = DockerIgnore.of_context(context)
        where = scratch if scratch is not None else Path(tempfile.mkdtemp(prefix="space-dockerfile-"))
        for i, step in enumerate(run):
            if isinstance(step, dict):
                run[i] = _archived(step, context, where, blobs, ignore)
    command = _start(entrypoint, start)
    with_instructions(spec, run=run, env=env, workdir=workdir, user=user,
                      start={"cmd": command} if command else None)
    check_build_fields(spec)
    return ParsedTemplate(spec=spec, blobs=blobs)


def _from(spec: dict[str, Any], ref: str, line: int) -> None:
    if not any(c in ref for c in "/:@"):
        try:
            spec["base_template"] = check_name(ref, "template name")
        except SpaceError:
            raise _bad(line, f"FROM {ref[:80]!r}: name a SPACE template, or an image with its registry "
                             "(registry.example.com/team/app:1; nodes pull from their operator's registries)") from None
        return
    if not is_reference(canonical_reference(ref)):
        raise _bad(line, f"FROM {ref[:80]!r}: an image is [registry/]repository:tag or "
                         "[registry/]repository@sha256:...")
    spec["image"] = canonical_reference(ref)


def _copy(keyword: str, rest: str, workdir: str | None, line: int, context: Path) -> list[dict[str, Any]]:
    try:
        words = shlex.split(rest)
    except ValueError as exc:
        raise _bad(line, f"{keyword}: {exc}") from None
    mode = None
    owner = "root"  # Docker's: a COPY's files are root's whatever USER says, unless --chown
    while words and words[0].startswith("--"):
        flag = words.pop(0)
        if flag.startswith("--chmod="):
            try:
                mode = _mode(flag.removeprefix("--chmod="), "chmod")
            except ValidationFailed:
                raise _bad(line, f"{keyword} {flag}: an octal mode such as --chmod=0755") from None
        elif flag.startswith("--chown="):
            owner = flag.removeprefix("--chown=")
            if not _OWNER.fullmatch(owner):
                raise _bad(line, f"{keyword} {flag[:60]}: --chown=user[:group] by name (SPACE names users by "
                                 "name, not by uid)")
        else:
            raise _bad(line, f"{keyword} {flag.split('=')[0]} is not supported")
    if rest.lstrip().startswith("["):
        raise _bad(line, f"{keyword} in JSON form is not supported: write {keyword} SRC... DEST")
    if len(words) < 2:
        raise _bad(line, f"{keyword} needs a source and a destination")
    *sources, dest = words
    if not dest.startswith("/"):
        dest = str(PurePosixPath(workdir or "/") / dest) + ("/" if dest.endswith("/") else "")
    if len(sources) > 1 and not dest.endswith("/"):
        raise _bad(line, f"{keyword} of several sources needs a destination directory ending in /")
    out = []
    for src in sources:
        if any(c in src for c in "*?["):
            raise _bad(line, f"{keyword} {src[:80]!r}: wildcards are not supported")
        if re.match(r"[a-z]+://", src):
            raise _bad(line, f"ADD of a URL ({src[:80]}) is not supported: download it in a RUN step")
        if keyword == "ADD" and re.search(r"\.(tar|tgz|tar\.(gz|bz2|xz|zst))$", src):
            raise _bad(line, f"ADD of an archive ({src[:80]}) would unpack it, which SPACE does not: "
                             "COPY it and unpack it in a RUN step")
        if PurePosixPath(src).is_absolute() or ".." in PurePosixPath(src).parts:
            raise _bad(line, f"{keyword} {src[:80]!r}: a source is a path inside the build context")
        # A directory's contents go into the destination; a file into it when it ends in / (the
        # copy step's rules: space/node/helper/copy_archive.py).
        out.append({"src": posixpath.normpath(src), "dest": dest, "owner": owner, "mode": mode or "",
                    "line": line, "keyword": keyword})
    return out


def _archived(step: dict[str, Any], context: Path, scratch: Path, blobs: dict[str, Path],
              ignore: DockerIgnore | None) -> dict[str, str]:
    """A COPY's source as a spec ``run`` copy: its files (what ``.dockerignore`` leaves) in a tar
    made the same for the same files (names sorted, owners and times zeroed: the same context is
    the same template), kept in ``blobs`` under its sha256."""
    line, src = int(step["line"]), str(step["src"])
    top = context / src
    if not top.exists() and not top.is_symlink():
        raise _bad(line, f"{step['keyword']} {src[:80]!r} does not exist in the build context {context}")
    members = sorted(_members(context, src, ignore))
    if not members:
        raise _bad(line, f"{step['keyword']} {src[:80]!r}: nothing to copy (.dockerignore excludes it)")
    fd, name = tempfile.mkstemp(prefix="copy-", suffix=".tar", dir=scratch)
    os.close(fd)
    path = Path(name)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for rel in members:
            info = tar.gettarinfo(str(context / rel), arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            if info.isreg():
                with open(context / rel, "rb") as f:
                    tar.addfile(info, f)
            elif info.isdir() or info.issym():
                tar.addfile(info)
            if path.stat().st_size > MAX_BLOB_BYTES:
                raise _bad(line, f"{step['keyword']} {src[:80]!r}: more than {MAX_BLOB_BYTES} bytes to copy")
    sha = file_sha256(path)
    final = scratch / f"{sha}.tar"
    path.replace(final)
    blobs[sha] = final
    return {"archive": sha, "src": src, "dest": str(step["dest"]), "owner": str(step["owner"]),
            "mode": str(step["mode"]), "workdir": "", "user": ""}


def _members(context: Path, src: str, ignore: DockerIgnore | None) -> list[str]:
    """``src`` and what is under it (links kept as links), as context-relative posix paths: only
    files, directories and links, and none that ``ignore`` excludes (nor what is under those)."""
    def kept(rel: str) -> bool:
        return ignore is None or not ignore.excluded(rel)

    def copyable(path: Path) -> bool:
        mode = os.lstat(path).st_mode
        return stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)

    top, rel_top = context / src, posixpath.normpath(src)
    if not kept(rel_top) or not copyable(top):
        return []
    if top.is_symlink() or not top.is_dir():
        return [rel_top]
    out = [rel_top]
    for dirpath, dirnames, filenames in os.walk(top):  # links to directories are listed, not entered
        keep = []
        for n in sorted(dirnames):
            rel = (Path(dirpath) / n).relative_to(context).as_posix()
            if kept(rel):
                keep.append(n)
                out.append(rel)
        dirnames[:] = keep
        for n in filenames:
            rel = (Path(dirpath) / n).relative_to(context).as_posix()
            if kept(rel) and copyable(context / rel):
                out.append(rel)
    return out


def _start(entrypoint: list[str] | str | None, cmd: list[str] | str | None) -> str | None:
    """Docker's rules: a JSON entrypoint takes a JSON CMD as its arguments; a shell-form entrypoint
    ignores CMD; without an entrypoint, CMD alone."""
    def text(form: list[str] | str) -> str:
        return shlex.join(form) if isinstance(form, list) else form

    if entrypoint is None:
        return text(cmd) if cmd else None
    if isinstance(entrypoint, str):
        return entrypoint
    if isinstance(cmd, list):
        return shlex.join([*entrypoint, *cmd])
    return shlex.join(entrypoint)
