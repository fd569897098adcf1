"""Container images as template bases: ``image.inspect`` pins a reference, ``template.oci`` unpacks it.

``image.inspect`` answers what a tag (or a digest) names now: the digest of this platform's image
manifest (an index of platforms is resolved to its linux/amd64 entry) and the defaults its config
gives a template. ``template.oci`` puts that image's root filesystem into the empty tree
``template.begin`` made.

The image is named by digest only (``registry/repository@sha256:<64 hex>``): the control plane
resolves a tag once, and the same digest is the same template. It is pulled from a registry on the
operator's list (``--registry``), the way debootstrap pulls only from the operator's mirrors, with
Debian's ``skopeo`` into a root-only staging directory (``--preserve-digests``: the manifest is
kept byte for byte, so the digest asked for is the digest unpacked, and skopeo checks every blob
against its digest), then unpacked with Debian's ``umoci`` (``raw unpack``: layers in order,
whiteouts applied, ownership, modes and extended attributes as the image says, every path resolved
inside the tree). Neither runs a binary of the image. The trust policy is the helper's own file, not
the host's ``/etc/containers/policy.json``; credentials never come from the host's either (no
``$XDG_RUNTIME_DIR`` auth file: the environment is the helper's fixed one).

umoci writes into the tree as :data:`FIRST_STAGE` binds it, on a root-only mount point in a mount
namespace of its own: the tree is the descriptor the check opened, never a path the agent could
swap. The image's config (env, user, working directory, entrypoint and command) is read from the
staging directory with every size bounded, and returned for the template's defaults.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from space.errors import Conflict, Forbidden, InvalidRequest, RuntimeFailure
from space.node.helper import privileged
from space.node.helper.verbs import Call, HelperContext, check, verb
from space.node.helper.verbs_template import _BUILDS, BUILD_XATTR, FIRST_STAGE, _exclusive, _open_work, is_work
from space.node.templates.spec import IMAGE_RE, REFERENCE_RE, is_reference

log = structlog.get_logger(__name__)

OCI_CAP: Final = 3600.0
#: A registry the operator allows: ``https://host[:port]``, or ``http://`` for one without TLS.
REGISTRY_RE: Final = re.compile(r"(?P<scheme>https?)://(?P<host>[a-z0-9](?:[a-z0-9.-]{0,252}[a-z0-9])?(?::[0-9]{1,5})?)")
#: A registry as logins name it: ``host[:port]``.
REGISTRY_HOST_RE: Final = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,252}[a-z0-9])?(?::[0-9]{1,5})?")
#: A mirror: ``NAME=URL`` (images named ``NAME/...`` pulled from the registry at URL).
MIRROR_RE: Final = re.compile(rf"(?P<name>{REGISTRY_HOST_RE.pattern})=(?P<url>\S+)")
#: The largest ``auth`` descriptor read (a few logins).
MAX_LOGINS: Final = 64 << 10
#: Bounds on what is read of the pulled image: its index, its manifest, its config.
MAX_INDEX: Final = 1 << 20
MAX_MANIFEST: Final = 4 << 20
MAX_CONFIG: Final = 4 << 20
#: The helper's trust policy: the digest pins the content (signature policies: not yet).
POLICY: Final = json.dumps({"default": [{"type": "insecureAcceptAnything"}]})
#: The most an operator's image policy may be.
MAX_POLICY: Final = 1 << 20
TAG: Final = "space"
#: skopeo and umoci get nothing of the helper's environment (no proxy, no auth file location).
ENV: Final = {"LC_ALL": "C.UTF-8"}
TAIL_LINES: Final = 40


#: Media types of an index of platforms (OCI's and Docker's).
INDEX_TYPES: Final = ("application/vnd.oci.image.index.v1+json",
                      "application/vnd.docker.distribution.manifest.list.v2+json")
#: The platform this node runs sandboxes on (gVisor here runs amd64).
PLATFORM: Final = {"os": "linux", "architecture": "amd64"}


def is_image(value: str) -> bool:
    return IMAGE_RE.fullmatch(value) is not None


@dataclass(frozen=True)
class OciArgs:
    work: str = field(metadata=check(is_work, "tmp/build-<name>@<digest16>"))
    image: str = field(metadata=check(is_image, "registry/repository@sha256:<64 hex>"))


@dataclass(frozen=True)
class InspectArgs:
    image: str = field(metadata=check(is_reference, "registry/repository:tag or registry/repository@sha256:<64 hex>"))


@dataclass(frozen=True)
class Source:
    """Where images a registry name names are pulled from: that registry, or its mirror."""

    scheme: str
    host: str

    @property
    def tls(self) -> str:
        return "true" if self.scheme == "https" else "false"


def registries_of(ctx: HelperContext) -> dict[str, Source]:
    """The operator's registries: ``https://host[:port]`` (``http://``: without TLS), or
    ``NAME=URL``, a mirror: images named ``NAME/...`` (``docker.io``: Docker Hub's) are pulled
    from the registry at URL. The digest pins the content wherever it comes from; a mirror gets
    no login meant for NAME (logins are per host)."""
    out: dict[str, Source] = {}
    for entry in ctx.registries:
        mirror = MIRROR_RE.fullmatch(entry)
        m = REGISTRY_RE.fullmatch((mirror["url"] if mirror else entry).rstrip("/"))
        if m is not None:
            out[mirror["name"] if mirror else m["host"]] = Source(m["scheme"], m["host"])
    return out


def _source(ctx: HelperContext, registry: str) -> Source:
    allowed = registries_of(ctx)
    source = allowed.get(registry)
    if source is None:
        raise InvalidRequest(f"registry {registry} is not one this node pulls images from "
                             f"({', '.join(sorted(allowed)) or 'none: the operator lists them with --registry'})",
                             registry=registry)
    return source


@verb("image.inspect", InspectArgs, cap=120, fds=("auth",))
async def image_inspect(ctx: HelperContext, args: InspectArgs, call: Call) -> dict[str, Any]:
    """What ``image`` (a tag or a digest) is now: pinned by the digest of this platform's manifest
    (an index of platforms is resolved to its linux/amd64 entry), and its config's defaults."""
    m = REFERENCE_RE.fullmatch(args.image)
    assert m is not None
    source = _source(ctx, m["registry"])
    stage = _staging(ctx)
    try:
        auth = f"--authfile={_auth_file(stage, call)}"
        return await _inspect(args.image, m, source, auth)
    finally:
        await asyncio.to_thread(shutil.rmtree, stage, True)


async def _inspect(image: str, m: re.Match[str], source: Source, auth: str) -> dict[str, Any]:
    repo = f"{m['registry']}/{m['repository']}"  # the name the template keeps
    at = f"{source.host}/{m['repository']}"  # where it is asked for
    tls = f"--tls-verify={source.tls}"
    ref = f"{at}@{m['digest']}" if m["digest"] else f"{at}:{m['tag']}"
    for _ in range(2):  # the reference, then (an index) its platform's entry
        raw = await _skopeo_out("inspect", "--raw", tls, auth, f"docker://{ref}", limit=MAX_MANIFEST)
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        if m["digest"] and ref.endswith(m["digest"]) and digest != m["digest"]:
            raise RuntimeFailure(f"{image}: the registry answered a manifest whose digest is {digest}")
        doc = _loads(raw, "manifest")
        if doc.get("mediaType") not in INDEX_TYPES and "manifests" not in doc:
            break
        entries = [e for e in doc.get("manifests") or [] if isinstance(e, dict)
                   and isinstance(e.get("platform"), dict)
                   and all(e["platform"].get(k) == v for k, v in PLATFORM.items())
                   and isinstance(e.get("digest"), str) and re.fullmatch(r"sha256:[0-9a-f]{64}", e["digest"])]
        if not entries:
            raise RuntimeFailure(f"{image} has no linux/amd64 image", image=image)
        ref = f"{at}@{entries[0]['digest']}"
        found = REFERENCE_RE.fullmatch(ref)
        assert found is not None
        m = found
    else:
        raise RuntimeFailure(f"{image}: an index of platforms inside an index")
    config = _loads(await _skopeo_out("inspect", "--config", tls, auth, f"docker://{at}@{digest}",
                                      limit=MAX_CONFIG), "config")
    return {"image": f"{repo}@{digest}", "config": image_defaults(config)}


async def _skopeo_out(*args: str, limit: int) -> bytes:
    res = await privileged.run("skopeo", "--insecure-policy", *args, timeout=120, check=False, env=ENV)
    if res.returncode != 0:
        err = res.stderr.decode(errors="replace").strip().splitlines()
        raise RuntimeFailure(f"skopeo {args[0]} failed: {err[-1] if err else 'no output'}",
                             image=args[-1].removeprefix("docker://"))
    if len(res.stdout) > limit:
        raise RuntimeFailure(f"the registry's answer exceeds {limit} bytes")
    return bytes(res.stdout)


def _loads(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise RuntimeFailure(f"the image's {what} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise RuntimeFailure(f"the image's {what} is not a JSON object")
    return doc


@verb("template.oci", OciArgs, cap=OCI_CAP, streaming=True, fds=("auth",))
async def template_oci(ctx: HelperContext, args: OciArgs, call: Call) -> dict[str, Any]:
    """Pull ``image`` and unpack its root filesystem into the empty work tree; lines stream (a
    failure raises with their tail). Returns the image's digest, layer count and config."""
    m = IMAGE_RE.fullmatch(args.image)
    assert m is not None  # checked by the argument parser
    source = _source(ctx, m["registry"])
    pulled = f"{source.host}/{m['repository']}@{m['digest']}"  # the image, or the same digest on its mirror
    with _exclusive(args.work):
        fd = await asyncio.to_thread(_open_work, ctx, args.work, "empty")
        build = _BUILDS[args.work]
        try:
            if os.listdir(fd):
                raise Conflict(f"{args.work} is not empty: an image is unpacked only into a fresh tree",
                               path=args.work)
            build.stage = "bootstrapping"
            stage = _staging(ctx)
            try:
                tail: deque[str] = deque(maxlen=TAIL_LINES)

                async def line(text: str) -> None:
                    tail.append(text)
                    await call.line(text)

                auth = _auth_file(stage, call)
                await _check_size(pulled, m["digest"], source, auth, ctx.build_max_bytes)
                await _pull(stage, pulled, source, auth, line, tail, signatures_dir(ctx, stage))
                manifest, config = await asyncio.to_thread(_read_image, stage, m["digest"])
                await call.line(f"unpacking {len(manifest['layers'])} layer(s)")
                await _unpack(fd, stage, line, tail)
                # The image's own root entry may have replaced the tree root's extended attributes,
                # this helper's mark among them.
                os.setxattr(fd, BUILD_XATTR, build.token)
            finally:
                await asyncio.to_thread(shutil.rmtree, stage, True)
            build.stage = "ready"
        except BaseException:
            build.stage = "failed"
            raise
        finally:
            os.close(fd)
    return {"digest": m["digest"], "layers": len(manifest["layers"]),
            "bytes": sum(int(layer.get("size", 0)) for layer in manifest["layers"]),
            "config": image_defaults(config)}


async def _check_size(image: str, digest: str, source: Source, auth: str, limit: int) -> None:
    """Refuse, before pulling, an image whose layers (as its manifest declares them, compressed)
    are larger than a build may be: the staging directory is on the host's disk. skopeo checks
    each blob against its digest as it pulls, so the manifest is what arrives."""
    try:
        raw = await _skopeo_out("inspect", "--raw", f"--tls-verify={source.tls}",
                                f"--authfile={auth}", f"docker://{image}", limit=MAX_MANIFEST)
    except RuntimeFailure as exc:
        raise RuntimeFailure(f"pulling {image} failed: {exc.message.removeprefix('skopeo inspect failed: ')}",
                             image=image) from None
    if "sha256:" + hashlib.sha256(raw).hexdigest() != digest:
        raise RuntimeFailure(f"{image}: the registry answered a manifest of another digest")
    manifest = _loads(raw, "manifest")
    blobs = [*(manifest.get("layers") or []), manifest.get("config") or {}]
    sizes = [b.get("size") if isinstance(b, dict) else None for b in blobs]
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes):
        raise RuntimeFailure(f"{image}: its manifest does not say the size of every layer")
    total = sum(s for s in sizes if isinstance(s, int))
    if total > limit:
        raise RuntimeFailure(f"{image} is {total} bytes compressed; a template build on this node may be at most "
                             f"{limit} bytes ($SPACE_BUILD_MAX_BYTES)", image=image, bytes=total, limit=limit)


def _staging(ctx: HelperContext) -> str:
    policy = image_policy(ctx)  # before the directory: a refused policy leaves nothing behind
    parent = ctx.data_dir / "build-bundles"
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(parent, 0o700)
    stage = parent / f"oci-{secrets.token_hex(8)}"
    stage.mkdir(mode=0o700)
    (stage / "policy.json").write_bytes(policy)
    (stage / "registries.d").mkdir(mode=0o700)  # none of the host's (/etc/containers/registries.d)
    return str(stage)


def _root_only(fd: int, path: object, what: str) -> os.stat_result:
    """The file at ``fd`` (``path``, for the message), if only root can change it (as sshd asks of
    its configuration): root decides with it, so no one else may write it."""
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Forbidden(f"{what} {path} must be root's and writable by no one else "
                        f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)})", path=str(path))
    return st


def image_policy(ctx: HelperContext) -> bytes:
    """The containers-policy.json(5) an image is pulled under: the operator's (read anew for each
    pull, checked: root's alone, at most :data:`MAX_POLICY` bytes, a JSON object with a default),
    else any image of a listed registry."""
    if ctx.image_policy is None:
        return POLICY.encode()
    try:
        fd = os.open(ctx.image_policy, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise Forbidden(f"the image policy {ctx.image_policy} cannot be read: {exc.strerror}") from None
    try:
        st = _root_only(fd, ctx.image_policy, "the image policy")
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_POLICY:
            raise Forbidden(f"the image policy {ctx.image_policy} must be a file of at most {MAX_POLICY} bytes")
        data = os.pread(fd, MAX_POLICY + 1, 0)
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise Forbidden(f"the image policy {ctx.image_policy} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("default"), list):
        raise Forbidden(f"the image policy {ctx.image_policy} is not a containers-policy.json(5) "
                        "(an object with a \"default\" list)")
    return data


def signatures_dir(ctx: HelperContext, stage: str) -> str:
    """The containers-registries.d(5) directory saying where signatures are: the operator's
    (root's alone), else an empty one of the stage's."""
    if ctx.signatures is None:
        return f"{stage}/registries.d"
    try:
        fd = os.open(ctx.signatures, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise Forbidden(f"the signatures directory {ctx.signatures} cannot be read: {exc.strerror}") from None
    try:
        _root_only(fd, ctx.signatures, "the signatures directory")
    finally:
        os.close(fd)
    return str(ctx.signatures)


async def _pull(stage: str, image: str, source: Source, auth: str, line: privileged.LineCallback,
                tail: deque[str], signatures: str) -> None:
    """skopeo copies the image under the stage's policy, which it checks (signatures included)
    before it copies a layer; the layout keeps none of them (``--remove-signatures``)."""
    argv = ["skopeo", "--policy", f"{stage}/policy.json", "--registries.d", signatures, "copy", "--quiet",
            "--preserve-digests", "--remove-signatures", "--retry-times", "2", f"--src-tls-verify={source.tls}",
            f"--src-authfile={auth}",
            f"docker://{image}", f"oci:{stage}/layout:{TAG}"]
    rc = await privileged.stream_lines(*argv, on_line=line, timeout=OCI_CAP, env=ENV)
    if rc != 0:
        last = _last(tail)
        if "Source image rejected" in last:
            why = last.partition("Source image rejected: ")[2].rstrip('"') or last
            raise Forbidden(f"{image} is refused by this node's image policy ($SPACE_BUILD_IMAGE_POLICY): {why}",
                            image=image)
        raise RuntimeFailure(f"pulling {image} failed (skopeo exit {rc}): {last}", image=image,
                             output="\n".join(tail))


async def _unpack(fd: int, stage: str, line: privileged.LineCallback, tail: deque[str]) -> None:
    at = f"{stage}/rootfs"
    os.mkdir(at, 0o700)
    argv = [*FIRST_STAGE, str(fd), at, "umoci", "--log", "error", "raw", "unpack", "--image",
            f"{stage}/layout:{TAG}", at]
    rc = await privileged.stream_lines(*argv, on_line=line, timeout=OCI_CAP, env=ENV, pass_fds=(fd,))
    if rc != 0:
        raise RuntimeFailure(f"unpacking the image failed (umoci exit {rc}): {_last(tail)}", output="\n".join(tail))


def _auth_file(stage: str, call: Call) -> str:
    """The skopeo auth file of this call, in its root-only staging directory: the logins passed as
    ``auth`` (``{registry: {"username", "password"}}``, at most :data:`MAX_LOGINS` bytes), or none.
    Always this file: skopeo would otherwise read root's own (``/run/containers/0/auth.json``,
    ``~/.docker/config.json``) and pull with whatever login the host's root once made."""
    auths: dict[str, dict[str, str]] = {}
    fd = call.fds.get("auth")
    if fd is not None:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidRequest("the auth descriptor must be a regular file (a memfd)")
        data = os.pread(fd, MAX_LOGINS + 1, 0)
        if len(data) > MAX_LOGINS:
            raise InvalidRequest(f"registry logins are limited to {MAX_LOGINS} bytes")
        try:
            logins = json.loads(data)
        except ValueError:
            raise InvalidRequest("registry logins are not JSON") from None
        if not isinstance(logins, dict):
            raise InvalidRequest("registry logins are {registry: {username, password}}")
        for registry, login in logins.items():
            if (not isinstance(registry, str) or REGISTRY_HOST_RE.fullmatch(registry) is None
                    or not isinstance(login, dict) or set(login) != {"username", "password"}
                    or not all(isinstance(v, str) and v and v.isprintable() for v in login.values())
                    or ":" in login["username"]):
                raise InvalidRequest("registry logins are {registry: {username, password}}")
            token = base64.b64encode(f"{login['username']}:{login['password']}".encode()).decode()
            auths[registry] = {"auth": token}
    path = f"{stage}/auth.json"
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(out, "w") as f:
        json.dump({"auths": auths}, f)
    return path


def _last(tail: deque[str]) -> str:
    return next((t for t in reversed(tail) if t.strip()), "no output")


def _blob(stage: str, digest: str, limit: int) -> dict[str, Any]:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or re.fullmatch(r"[0-9a-f]{64}", hexd) is None:
        raise RuntimeFailure(f"the image names a blob as {digest[:80]!r}: not a sha256 digest")
    return _json(f"{stage}/layout/blobs/sha256/{hexd}", limit, f"blob {digest[:19]}")


def _json(path: str, limit: int, what: str) -> dict[str, Any]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise RuntimeFailure(f"the image's {what} exceeds {limit} bytes")
    return _loads(data, what)


def _read_image(stage: str, digest: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pulled image's manifest and config, the manifest proven to be the digest asked for."""
    index = _json(f"{stage}/layout/index.json", MAX_INDEX, "index")
    found = [d for d in index.get("manifests") or [] if isinstance(d, dict)
             and (d.get("annotations") or {}).get("org.opencontainers.image.ref.name") == TAG]
    if len(found) != 1 or found[0].get("digest") != digest:
        raise RuntimeFailure(f"the pulled image is not {digest}", digest=digest)
    manifest = _blob(stage, digest, MAX_MANIFEST)
    layers = manifest.get("layers")
    cfg = manifest.get("config")
    if not isinstance(layers, list) or not isinstance(cfg, dict) or not isinstance(cfg.get("digest"), str):
        raise RuntimeFailure(f"{digest} is not an image manifest (an index of platforms is resolved first)")
    return manifest, _blob(stage, cfg["digest"], MAX_CONFIG)


def image_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """What a template takes from an image's config: its env (``NAME=value`` entries), user,
    working directory and start command (entrypoint then cmd), each checked for shape."""
    c = config.get("config") if isinstance(config.get("config"), dict) else {}
    assert isinstance(c, dict)

    def strings(value: Any, limit: int) -> list[str]:
        if not isinstance(value, list):
            return []
        return [v for v in value if isinstance(v, str) and len(v) <= 65536][:limit]

    env = [e for e in strings(c.get("Env"), 1024) if "=" in e and e.index("=") > 0]
    user = c.get("User") if isinstance(c.get("User"), str) and len(c["User"]) <= 256 else ""
    workdir = c.get("WorkingDir") if isinstance(c.get("WorkingDir"), str) and len(c["WorkingDir"]) <= 4096 else ""
    return {"env": env, "user": user, "workdir": workdir, "entrypoint": strings(c.get("Entrypoint"), 256),
            "cmd": strings(c.get("Cmd"), 256)}
