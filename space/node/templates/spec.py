"""Template specs beyond ``base``: the ``space-template.toml`` format and the spec forms it becomes.

A spec is a JSON object; its digest (:func:`space.node.templates.store.spec_digest`, sha256 of the
canonical JSON) names the template, so every key below is part of it. Three forms:

*debootstrap* (the original form; :data:`~space.node.templates.store.BASE_SPEC` is one)
    ``name, suite, mirror, packages, user, home`` -- a minbase Debian with ``packages``, user
    ``user`` with home ``home``. A spec with only these keys digests exactly as before.

*derived*
    ``name, base_template`` instead of ``suite/mirror/packages/home``. ``base_template`` is
    ``{"name", "digest", "spec"}``: the whole spec of the template it starts from (so a node lacking
    the base can materialize it, and a changed base changes every derived digest). A request may
    name the base as a plain string; the control plane resolves it (:func:`resolve_base`) before
    the spec is digested, and fills ``user``/``env``/``workdir``/``start`` it did not set from the
    base (a derived template inherits its base's defaults; ``env`` merges, its own keys winning).

*image*
    ``name, image`` instead of ``suite/mirror/packages/home``: the root filesystem of a container
    image, ``registry/repository@sha256:<digest>`` (a request may name a tag; the control plane
    pins it to the digest of the image's linux/amd64 manifest, and fills ``user``/``env``/
    ``workdir``/``start`` it did not set from the image's config, before the spec is digested).
    The image must have ``/bin/sh`` and ``/usr/bin/python3`` able to run the guest daemon (a
    build checks, and names what is missing), and the template's user among its users.

*saved* (made from a sandbox's snapshot, never built)
    ``name, from_snapshot, sandbox, parent_template_digest`` and the parent template's
    ``user``/``env``/``workdir``/``start``. A node that lacks it downloads its stream from object
    storage or fails: it cannot be rebuilt.

Optional keys of the debootstrap and derived forms, run in this order on top of the base:

- ``apt``: Debian package names (``apt-get install --no-install-recommends``);
- ``pip``: requirement strings, into the system python (``python3-pip`` is installed if missing);
- ``files``: ``[{"dest", "sha256", "mode"}]`` -- the bytes are the object ``blobs/<sha256>`` in the
  object store (the CLI uploads them); ``mode`` is four octal digits;
- ``run``: shell commands, run as root with ``/bin/sh -c``, and copies of uploaded archives'
  files (:data:`COPY_KEYS`), in the order given;
- and for sandboxes of the template: ``env`` (default environment), ``user`` (default user),
  ``workdir`` (default cwd), ``start`` = ``{"cmd", "ready": {"port" | "cmd", "timeout_s"}}`` (a
  command started in the background when a sandbox boots, and how to tell it is ready).

The TOML file (paths relative to it; ``name`` is optional, the CLI's NAME wins)::

    name = "py-web"
    [base]
    template = "base"            # or suite = "bookworm" (+ mirror, packages), or
                                 # image = "registry.example.com/team/app:1.4" (or @sha256:...)
    [build]
    apt = ["jq"]
    pip = ["requests==2.32.3"]
    files = [{ src = "app/", dest = "/opt/app", mode = "0644" }]   # a directory recurses
    run = ["echo hi > /etc/motd"]
    env = { FOO = "bar" }
    user = "user"
    workdir = "/home/user"
    [start]
    cmd = "python3 -m http.server 8000"
    ready = { port = 8000, timeout_s = 30 }   # or { cmd = "curl -sf localhost:8000" }
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import shlex
import stat
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final

from space.errors import SpaceError, ValidationFailed
from space.node.storage.pool import check_name

SPEC_FILE: Final = "space-template.toml"
#: The largest file a template may carry (one blob).
MAX_BLOB_BYTES: Final = 256 << 20
DEFAULT_READY_TIMEOUT: Final = 30.0
MAX_READY_TIMEOUT: Final = 3600.0
#: How deep templates may derive from templates.
MAX_DEPTH: Final = 8

#: The optional keys, in the order the builder applies them (the last four only describe sandboxes).
BUILD_KEYS: Final = ("apt", "pip", "files", "run", "env", "workdir", "start")
#: What a derived template takes from its base unless it sets it.
INHERITED: Final = ("user", "env", "workdir", "start")

_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.:-]{0,99}")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_SUITE = re.compile(r"[a-z][a-z0-9-]{0,31}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MODE = re.compile(r"0[0-7]{3}")
_OWNER = re.compile(r"[a-z_][a-z0-9_-]{0,31}(?::[a-z_][a-z0-9_-]{0,31})?")
#: The keys of a copy in ``run``: the files under ``src`` of the archive ``blobs/<archive>`` (a tar,
#: gzipped or not), placed at ``dest`` (relative: to ``workdir``, else ``user``'s home), owned by
#: ``owner`` (else ``user``, else root), with ``mode`` if set. E2B's template COPY is one.
COPY_KEYS: Final = frozenset({"archive", "src", "dest", "owner", "mode", "workdir", "user"})
_PIP = re.compile(r"[A-Za-z0-9][^\x00-\x1f\x7f]{0,299}")
#: ``host[:port]/path@sha256:<hex>``: lowercase repository path components as the distribution
#: spec allows them; no tag (a tag is resolved to a digest before a build is asked for).
IMAGE_RE: Final = re.compile(
    r"(?P<registry>[a-z0-9](?:[a-z0-9.-]{0,252}[a-z0-9])?(?::[0-9]{1,5})?)"
    r"/(?P<repository>[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*){0,15})"
    r"@(?P<digest>sha256:[0-9a-f]{64})")
#: What ``image.inspect`` takes: a tag, a digest, or both (the digest wins).
REFERENCE_RE: Final = re.compile(
    IMAGE_RE.pattern.split("@", 1)[0]
    + r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?")


def canonical_reference(ref: str) -> str:
    """``ref`` named in full as Docker names it: a reference whose first component is not a
    registry host (no ``.`` or ``:``, not ``localhost``) is Docker Hub's, ``ubuntu:22.04`` ->
    ``docker.io/library/ubuntu:22.04``, ``team/app:1`` -> ``docker.io/team/app:1``."""
    first, slash, _ = ref.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return ref
    return f"docker.io/{ref}" if slash else f"docker.io/library/{ref}"


def is_reference(value: object) -> bool:
    """Whether ``value`` names an image by tag or digest (``registry/repository:tag``, ``@sha256:``)."""
    m = REFERENCE_RE.fullmatch(value) if isinstance(value, str) else None
    return m is not None and bool(m["tag"] or m["digest"])


def bad(key: str, why: str) -> ValidationFailed:
    return ValidationFailed(f"template spec field {key!r} {why}", field=key)


def is_saved(spec: dict[str, Any]) -> bool:
    return "from_snapshot" in spec


def is_derived(spec: dict[str, Any]) -> bool:
    return "base_template" in spec


def is_image(spec: dict[str, Any]) -> bool:
    return "image" in spec


def has_build_steps(spec: dict[str, Any]) -> bool:
    return any(spec.get(k) for k in ("apt", "pip", "files", "run")) or bool(spec.get("workdir"))


# -- validation of the optional keys ----------------------------------------------------------------


def _str_list(spec: dict[str, Any], key: str, pattern: re.Pattern[str], what: str) -> None:
    items = spec.get(key)
    if items is None:
        return
    if not isinstance(items, list) or not all(isinstance(i, str) and pattern.fullmatch(i) for i in items):
        raise bad(key, f"must be a list of {what}")


def check_abs_path(value: Any, key: str) -> str:
    if (
        not isinstance(value, str)
        or not value.startswith("/")
        or value == "/"
        or str(PurePosixPath(value)) != value
        or ".." in PurePosixPath(value).parts
        or any(ord(c) < 0x20 or c == "\x7f" for c in value)
        or len(value) > 1024
    ):
        raise bad(key, "must be a normalized absolute path (not /)")
    return value


def check_user(value: Any, key: str = "user") -> str:
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise bad(key, "must be a POSIX user name")
    return value


def check_build_fields(spec: dict[str, Any]) -> None:
    """Validate whichever of :data:`BUILD_KEYS` the spec has (in place, raising ValidationFailed)."""
    _str_list(spec, "apt", _PACKAGE, "Debian package names")
    _str_list(spec, "pip", _PIP, "pip requirements (not options)")
    run = spec.get("run")
    if run is not None:
        if not isinstance(run, list):
            raise bad("run", "must be a list of shell commands and copies")
        for i, c in enumerate(run):
            if isinstance(c, dict):
                check_copy(c, f"run[{i}]")
            elif not isinstance(c, str) or not c.strip() or "\x00" in c:
                raise bad("run", f"entry {i} must be a non-empty shell command or a copy {{archive, src, dest, ...}}")
    files = spec.get("files")
    if files is not None:
        if not isinstance(files, list):
            raise bad("files", "must be a list of {dest, sha256, mode}")
        for i, f in enumerate(files):
            key = f"files[{i}]"
            if not isinstance(f, dict) or set(f) != {"dest", "sha256", "mode"}:
                raise bad(key, "must be exactly {dest, sha256, mode}")
            check_abs_path(f["dest"], f"{key}.dest")
            if not isinstance(f["sha256"], str) or not _SHA256.fullmatch(f["sha256"]):
                raise bad(f"{key}.sha256", "must be a lowercase hex sha256")
            if not isinstance(f["mode"], str) or not _MODE.fullmatch(f["mode"]):
                raise bad(f"{key}.mode", "must be four octal digits such as 0644")
    env = spec.get("env")
    if env is not None and (
        not isinstance(env, dict)
        or not all(isinstance(k, str) and _ENV_NAME.fullmatch(k) for k in env)
        or not all(isinstance(v, str) and "\x00" not in v for v in env.values())
    ):
        raise bad("env", "must map environment variable names to strings")
    if spec.get("workdir") is not None:
        check_abs_path(spec["workdir"], "workdir")
    if spec.get("user") is not None:
        check_user(spec["user"])
    start = spec.get("start")
    if start is not None:
        _check_start(start)


def check_copy(entry: dict[str, Any], key: str) -> None:
    """A ``run`` entry that copies files of an uploaded archive (:data:`COPY_KEYS`)."""
    if set(entry) != COPY_KEYS:
        raise bad(key, f"a copy must be exactly {{{', '.join(sorted(COPY_KEYS))}}}")
    if not isinstance(entry["archive"], str) or not _SHA256.fullmatch(entry["archive"]):
        raise bad(f"{key}.archive", "must be the lowercase hex sha256 of an uploaded archive")
    src = entry["src"]
    if not isinstance(src, str) or (src and not _is_relative(src)):
        raise bad(f"{key}.src", "must be '' or a relative path inside the archive (no '..')")
    dest = entry["dest"]
    if not isinstance(dest, str) or not dest or not _is_relative(dest.lstrip("/") or "."):
        raise bad(f"{key}.dest", "must be a path (absolute, or relative to workdir) without '..'")
    owner = entry["owner"]
    if not isinstance(owner, str) or (owner and not _OWNER.fullmatch(owner)):
        raise bad(f"{key}.owner", "must be '' or user[:group]")
    if not isinstance(entry["mode"], str) or (entry["mode"] and not _MODE.fullmatch(entry["mode"])):
        raise bad(f"{key}.mode", "must be '' or four octal digits such as 0755")
    if entry["workdir"] not in ("", "/"):  # "/": a Dockerfile's WORKDIR before any other
        check_abs_path(entry["workdir"], f"{key}.workdir")
    if entry["user"] != "":
        check_user(entry["user"], f"{key}.user")


def _is_relative(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return (not path.startswith("/") and ".." not in parts and len(path) <= 1024
            and not any(ord(c) < 0x20 or c == "\x7f" for c in path))


def run_commands(spec: dict[str, Any]) -> list[str]:
    """The shell commands of ``spec``'s ``run`` (its copies left out)."""
    return [c for c in spec.get("run") or [] if isinstance(c, str)]


def _check_start(start: Any) -> None:
    if not isinstance(start, dict) or not set(start) <= {"cmd", "ready"}:
        raise bad("start", "must be {cmd, ready}")
    cmd = start.get("cmd")
    if not isinstance(cmd, str) or not cmd.strip() or "\x00" in cmd:
        raise bad("start.cmd", "must be a non-empty shell command")
    ready = start.get("ready")
    if ready is None:
        return
    if not isinstance(ready, dict) or not set(ready) <= {"port", "cmd", "timeout_s"}:
        raise bad("start.ready", "must be {port | cmd, timeout_s}")
    if ("port" in ready) == ("cmd" in ready):
        raise bad("start.ready", "needs exactly one of port and cmd")
    port = ready.get("port")
    if "port" in ready and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
        raise bad("start.ready.port", "must be a TCP port (1-65535)")
    rcmd = ready.get("cmd")
    if "cmd" in ready and (not isinstance(rcmd, str) or not rcmd.strip() or "\x00" in rcmd):
        raise bad("start.ready.cmd", "must be a non-empty shell command")
    t = ready.get("timeout_s", DEFAULT_READY_TIMEOUT)
    if not isinstance(t, int | float) or isinstance(t, bool) or not 0 < t <= MAX_READY_TIMEOUT:
        raise bad("start.ready.timeout_s", f"must be a number of seconds in (0, {MAX_READY_TIMEOUT:g}]")


# -- validation of the derived and saved forms -------------------------------------------------------


def validate_node_spec(spec: dict[str, Any], validate_base: Callable[[dict[str, Any]], dict[str, Any]],
                       *, digest_of: Callable[[dict[str, Any]], str], depth: int = 0) -> None:
    """Validate a derived or saved spec in place; ``validate_base`` validates an embedded base spec."""
    try:
        check_name(str(spec.get("name", "")), "template name")
    except SpaceError:
        raise bad("name", "must be a simple name ([A-Za-z0-9._-])") from None
    if is_image(spec):
        if not isinstance(spec["image"], str) or IMAGE_RE.fullmatch(spec["image"]) is None:
            raise bad("image", "must be registry/repository@sha256:<64 hex> (the control plane pins a tag)")
        if any(k in spec for k in ("suite", "mirror", "packages", "home", "base_template")):
            raise bad("image", "excludes suite, mirror, packages, home and base_template")
        check_build_fields(spec)
        return
    if is_saved(spec):
        for key in ("from_snapshot", "sandbox"):
            try:
                check_name(str(spec.get(key, "")), key)
            except SpaceError:
                raise bad(key, "must be an id") from None
        parent = spec.get("parent_template_digest")
        if not isinstance(parent, str) or not _SHA256.fullmatch(parent):
            raise bad("parent_template_digest", "must be a sha256 digest")
        check_build_fields({k: spec[k] for k in INHERITED if k in spec})
        return
    base = spec["base_template"]
    if isinstance(base, str):
        raise bad("base_template", f"names template {base!r} but was not resolved to its spec "
                                   "(the control plane resolves it)")
    if not isinstance(base, dict) or set(base) != {"name", "digest", "spec"} or not isinstance(base["spec"], dict):
        raise bad("base_template", "must be {name, digest, spec}")
    if depth >= MAX_DEPTH:
        raise bad("base_template", f"derives more than {MAX_DEPTH} levels deep")
    if any(k in spec for k in ("suite", "mirror", "packages", "home")):
        raise bad("base_template", "excludes suite, mirror, packages and home (they belong to the base)")
    base_spec = validate_base(base["spec"])
    if base_spec.get("name") != base["name"] or digest_of(base_spec) != base["digest"]:
        raise bad("base_template", "has a name or digest that does not match its spec")
    base["spec"] = base_spec
    check_build_fields(spec)


def defaults_of(spec: dict[str, Any]) -> dict[str, Any]:
    """The sandbox defaults a spec declares (``user``, ``env``, ``workdir``, ``start``), non-empty only."""
    return {k: copy.deepcopy(spec[k]) for k in INHERITED if spec.get(k)}


def resolve_base(spec: dict[str, Any], base_spec: dict[str, Any], digest: str) -> dict[str, Any]:
    """A derived request spec whose ``base_template`` is a name, with that base's spec embedded and
    the defaults it does not set taken from the base. Returns a new dict."""
    out = copy.deepcopy(spec)
    out["base_template"] = {"name": base_spec["name"], "digest": digest, "spec": copy.deepcopy(base_spec)}
    inherited = defaults_of(base_spec)
    for key in ("user", "workdir", "start"):
        if not out.get(key) and key in inherited:
            out[key] = inherited[key]
    env = {**inherited.get("env", {}), **(out.get("env") or {})}
    if env:
        out["env"] = env
    return out


# -- build steps from instruction lists (Dockerfiles, E2B's template SDK) ---------------------------


def with_instructions(spec: dict[str, Any], *, run: Sequence[str | dict[str, str]], env: dict[str, str],
                      workdir: str | None, user: str | None, start: dict[str, Any] | None) -> dict[str, Any]:
    """``spec`` with what a list of instructions (a Dockerfile's, E2B's SDK's) came to, the empty
    ones left out (an empty key would change the digest of the same template)."""
    for key, value in (("run", run), ("env", env), ("workdir", workdir), ("user", user), ("start", start)):
        if value:
            spec[key] = value
    return spec


def in_context(cmd: str, env: dict[str, str], workdir: str | None, user: str | None, *,
               home_default: bool = False, missing_user: str | None = None) -> str:
    """A ``run`` step (``/bin/sh -c``) that runs ``cmd`` as a Dockerfile's RUN does after the ENV,
    WORKDIR and USER before it: with ``env`` exported, in ``workdir`` (made if missing), as ``user``
    (``su``; root otherwise). Without a workdir it runs in ``/`` as Docker's does, or with
    ``home_default`` in the user's home, as E2B's builds do (where a relative COPY lands too).
    ``missing_user``: what the step says (its last line, the build's error) when ``user`` does not
    exist (else su's own words)."""
    lines = [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    if workdir:
        lines.append(f"mkdir -p {shlex.quote(workdir)} && cd {shlex.quote(workdir)}")
    elif home_default:
        lines.append('cd "$HOME"')  # su sets it to the user's home; the build's own is /root
    lines.append(cmd)
    script = "\n".join(lines)
    if user and user != "root":
        su = f"su -s /bin/sh {shlex.quote(user)} -c {shlex.quote(script)}"
        if missing_user is None:
            return su
        return (f"if ! id -u {shlex.quote(user)} >/dev/null 2>&1; then echo {shlex.quote(missing_user)} >&2; "
                f"exit 1; fi\n{su}")
    return script


# -- the TOML file ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedTemplate:
    """A spec read from a TOML file, and the local files its ``files`` entries name by sha256."""

    spec: dict[str, Any]
    blobs: dict[str, Path] = field(default_factory=dict)


def load(path: Path, name: str | None = None) -> ParsedTemplate:
    """Read ``space-template.toml`` at ``path`` (files hashed); ``name`` overrides the file's."""
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValidationFailed(f"cannot read {path}: {exc.strerror}", field="file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValidationFailed(f"{path} is not valid TOML: {exc}", field="file") from None
    return from_toml(doc, path.resolve().parent, name=name)


def _table(doc: dict[str, Any], key: str, allowed: set[str]) -> dict[str, Any]:
    t = doc.get(key, {})
    if not isinstance(t, dict):
        raise bad(key, "must be a table")
    unknown = sorted(set(t) - allowed)
    if unknown:
        raise bad(f"{key}.{unknown[0]}", "is not a known field")
    return t


def from_toml(doc: dict[str, Any], base_dir: Path, *, name: str | None = None) -> ParsedTemplate:
    """The request spec of a parsed TOML document (``base_template`` still a name, if any)."""
    from space.node.templates.store import BASE_SPEC  # templates imports this module

    unknown = sorted(set(doc) - {"name", "base", "build", "start"})
    if unknown:
        raise bad(unknown[0], "is not a known field")
    spec_name = name if name is not None else doc.get("name")
    if not isinstance(spec_name, str) or not spec_name:
        raise bad("name", "is required (in the file or as the template's NAME)")
    try:
        check_name(spec_name, "template name")
    except SpaceError:
        raise bad("name", "must be a simple name ([A-Za-z0-9._-])") from None
    base = _table(doc, "base", {"suite", "mirror", "packages", "template", "image"})
    build = _table(doc, "build", {"apt", "pip", "files", "run", "env", "user", "workdir"})
    start = _table(doc, "start", {"cmd", "ready"})

    spec: dict[str, Any] = {"name": spec_name}
    if sum(k in base for k in ("suite", "template", "image")) != 1:
        raise bad("base", "needs exactly one of suite, template and image")
    user = build.get("user")
    if "image" in base:
        if set(base) != {"image"}:
            raise bad("base", "with image takes no suite, mirror or packages")
        ref = canonical_reference(base["image"]) if isinstance(base["image"], str) else base["image"]
        if not is_reference(ref):
            raise bad("base.image", "must be registry/repository:tag or registry/repository@sha256:<64 hex>")
        spec["image"] = ref  # the control plane pins it (and takes the image's defaults)
        if user is not None:
            spec["user"] = check_user(user, "build.user")
    elif "template" in base:
        if set(base) != {"template"}:
            raise bad("base", "with template takes no suite, mirror or packages")
        try:
            check_name(str(base["template"]), "template name")
        except SpaceError:
            raise bad("base.template", "must be a template name") from None
        if base["template"] == spec_name:
            raise bad("base.template", "cannot be the template itself")
        spec["base_template"] = base["template"]
        if user is not None:
            spec["user"] = check_user(user, "build.user")
    else:
        if not isinstance(base["suite"], str) or not _SUITE.fullmatch(base["suite"]):
            raise bad("base.suite", "must be a Debian suite name")
        spec["suite"] = base["suite"]
        spec["mirror"] = base.get("mirror", BASE_SPEC["mirror"])
        spec["packages"] = list(base.get("packages", BASE_SPEC["packages"]))
        spec["user"] = check_user(user if user is not None else BASE_SPEC["user"], "build.user")
        spec["home"] = "/root" if spec["user"] == "root" else f"/home/{spec['user']}"
        if spec["user"] != "root":
            spec["sudo"] = True  # the user may sudo, as base's may (space/guest/guest_sudo.py)

    for key in ("apt", "pip", "run"):
        if build.get(key):
            spec[key] = build[key]
    blobs: dict[str, Path] = {}
    if build.get("files"):
        spec["files"] = _files(build["files"], base_dir, blobs)
    if build.get("env"):
        spec["env"] = build["env"]
    if build.get("workdir") is not None:
        spec["workdir"] = build["workdir"]
    if start:
        if "cmd" not in start:
            raise bad("start.cmd", "is required in [start]")
        s: dict[str, Any] = {"cmd": start["cmd"]}
        if start.get("ready") is not None:
            ready = start["ready"]
            if not isinstance(ready, dict):
                raise bad("start.ready", "must be a table")
            s["ready"] = {**ready, "timeout_s": ready.get("timeout_s", DEFAULT_READY_TIMEOUT)}
            if isinstance(s["ready"]["timeout_s"], int) and not isinstance(s["ready"]["timeout_s"], bool):
                s["ready"]["timeout_s"] = float(s["ready"]["timeout_s"])  # 30 and 30.0: one digest
        spec["start"] = s
    try:
        check_build_fields(spec)
    except ValidationFailed as exc:
        # Name the field as the TOML file spells it.
        where = str(exc.details.get("field", ""))
        table = "start" if where.startswith("start") else "build"
        toml_field = where if where.startswith("start") else f"{table}.{where}"
        raise bad(toml_field, exc.message.split(f"{where!r} ", 1)[-1]) from None
    return ParsedTemplate(spec=spec, blobs=blobs)


def _files(entries: Any, base_dir: Path, blobs: dict[str, Path]) -> list[dict[str, str]]:
    if not isinstance(entries, list):
        raise bad("build.files", "must be a list of {src, dest, mode}")
    out: dict[str, dict[str, str]] = {}
    for i, entry in enumerate(entries):
        key = f"build.files[{i}]"
        if not isinstance(entry, dict) or not {"src", "dest"} <= set(entry) <= {"src", "dest", "mode"}:
            raise bad(key, "must be {src, dest, mode?}")
        if not isinstance(entry["src"], str) or not entry["src"]:
            raise bad(f"{key}.src", "must be a path")
        dest = check_abs_path(entry["dest"], f"{key}.dest")
        mode = _mode(entry.get("mode"), f"{key}.mode")
        src = (base_dir / entry["src"]).resolve()
        try:
            st = src.stat()
        except OSError:
            raise bad(f"{key}.src", f"names {src}, which does not exist") from None
        if stat.S_ISDIR(st.st_mode):
            found = _walk(src)
            if not found:
                raise bad(f"{key}.src", f"names the directory {src}, which holds no files")
            for rel in found:
                _add(out, blobs, src / rel, str(PurePosixPath(dest) / rel), mode, f"{key}.src")
        elif stat.S_ISREG(st.st_mode):
            _add(out, blobs, src, dest, mode, f"{key}.src")
        else:
            raise bad(f"{key}.src", f"names {src}, which is neither a file nor a directory")
    return [out[d] for d in sorted(out)]


def _walk(top: Path) -> list[str]:
    """Regular files under ``top`` (following symlinks to files), as sorted relative posix paths."""
    found = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for n in filenames:
            p = Path(dirpath) / n
            if p.is_file():
                found.append(p.relative_to(top).as_posix())
    return sorted(found)


def _mode(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0o7777:
        return f"{value:04o}"
    if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3}", value):
        return value.rjust(4, "0")
    raise bad(key, "must be an octal mode such as \"0644\"")


def _add(out: dict[str, dict[str, str]], blobs: dict[str, Path], src: Path, dest: str, mode: str | None,
         key: str) -> None:
    size = src.stat().st_size
    if size > MAX_BLOB_BYTES:
        raise bad(key, f"has {src} of {size} bytes; files are limited to {MAX_BLOB_BYTES >> 20} MiB")
    sha = file_sha256(src)
    if mode is None:
        mode = "0755" if src.stat().st_mode & 0o111 else "0644"
    out[dest] = {"dest": dest, "sha256": sha, "mode": mode}
    blobs[sha] = src


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def blob_key(sha256: str) -> str:
    """Where a file's bytes live in object storage."""
    if not _SHA256.fullmatch(sha256):
        raise ValidationFailed(f"not a sha256: {sha256!r}", field="sha256")
    return f"blobs/{sha256}"
