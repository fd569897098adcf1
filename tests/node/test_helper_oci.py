"""``image.inspect`` and ``template.oci``: a container image pinned, then pulled by digest from a
registry on loopback (Debian's ``docker-registry``) and unpacked into a fresh build tree on a real
btrfs pool, through the helper's in-process backend.

The images are OCI layouts this module writes layer by layer (tar entries exactly as a test wants
them, hostile ones included) and pushes with ``skopeo``.

Aspects:
- layers apply in order: files, directories, symlinks, hard links, modes (setuid kept), owners and
  extended attributes as the image says; a whiteout removes a lower file, an opaque directory
  hides a lower directory's entries; the image's config comes back (env, user, workdir,
  entrypoint, cmd) with its digest and layer count
- refused before anything is pulled or written: a registry the operator did not list, a name that
  is not pinned by digest, a tree that is not an empty build this helper began
- a digest the registry does not have is a clear failure, and the tree is marked failed
- a hostile layer (``..`` paths, absolute paths, a file written through a symlink that points out
  of the tree) writes nothing outside the tree
- inspect pins a tag (or an index's digest) to the linux/amd64 manifest's digest, which is what
  ``template.oci`` then unpacks; a registry not listed, a malformed reference and a missing tag
  are clear errors
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from space.errors import Conflict, Forbidden, InvalidRequest, NotFound, RuntimeFailure
from space.node.helper.backend import InProcess
from space.node.helper.verbs import HelperContext
from space.node.storage.pool import Pool
from space.node.templates.store import DEFAULT_CACHE_DIR
from tests.waiting import wait_for

pytestmark = [pytest.mark.runtime, pytest.mark.anyio,
              pytest.mark.skipif(not all(shutil.which(t) for t in ("docker-registry", "skopeo", "umoci")),
                                 reason="needs Debian's docker-registry, skopeo and umoci (make setup installs them)")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def serve_registry(d: Path, extra_config: str = "") -> Iterator[int]:
    """Debian's docker-registry on a free loopback port, its storage in ``d``; the port."""
    port = _free_port()
    (d / "config.yml").write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
                                  f"    rootdirectory: {d / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n"
                                  + extra_config)
    log = (d / "registry.log").open("wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(d / "config.yml")], stdout=log, stderr=log)
    try:
        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        wait_for(up, timeout=30, what="the registry to listen")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry on loopback: ``127.0.0.1:<port>``."""
    with serve_registry(tmp_path_factory.mktemp("registry")) as port:
        yield f"127.0.0.1:{port}"


# -- images, layer by layer ------------------------------------------------------------------------


@dataclass
class Entry:
    name: str
    kind: str = "file"  # file | dir | symlink | hardlink
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    link: str = ""
    xattrs: dict[str, str] | None = None


def _layer(entries: list[Entry]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.mode, info.uid, info.gid, info.mtime = e.mode, e.uid, e.gid, 1_700_000_000
            info.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                         "hardlink": tarfile.LNKTYPE}[e.kind]
            info.linkname = e.link
            if e.xattrs:
                info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in e.xattrs.items()}
            if e.kind == "file":
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            else:
                tar.addfile(info)
    return gzip.compress(raw.getvalue(), mtime=0)


def _put_blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _tar_blob(layout: Path, tar: Path) -> dict[str, Any]:
    """An uncompressed tar file as a layer (linked into the layout): its diff id is its digest."""
    h = hashlib.sha256()
    with tar.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    size = tar.stat().st_size
    dest = layout / "blobs" / "sha256" / h.hexdigest()
    try:
        os.link(tar, dest)
    except OSError:
        shutil.copy(tar, dest)
    return {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": f"sha256:{h.hexdigest()}", "size": size}


def write_layout(layout: Path, layers: list[list[Entry] | Path], config: dict[str, Any]) -> None:
    """An OCI layout tagged v1; a layer is its entries, or a tar file already made."""
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    blobs, diff_ids = [], []
    for entries in layers:
        if isinstance(entries, Path):
            blob = _tar_blob(layout, entries)
            diff_ids.append(blob["digest"])
            blobs.append(blob)
            continue
        tgz = _layer(entries)
        diff_ids.append("sha256:" + hashlib.sha256(gzip.decompress(tgz)).hexdigest())
        blobs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **_put_blob(layout, tgz)})
    cfg = {"architecture": "amd64", "os": "linux", "config": config,
           "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           **_put_blob(layout, json.dumps(cfg).encode())},
                "layers": blobs}
    m = _put_blob(layout, json.dumps(manifest).encode())
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **m,
         "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}))


def push(tmp_path: Path, registry: str, repo: str, layers: list[list[Entry] | Path],
         config: dict[str, Any] | None = None) -> str:
    """The image pushed as ``registry/repo:v1``; its name pinned by digest."""
    layout = tmp_path / f"layout-{uuid.uuid4().hex[:8]}"
    write_layout(layout, layers, config or {})
    subprocess.run(["skopeo", "--insecure-policy", "copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false",
                    f"oci:{layout}:v1", f"docker://{registry}/{repo}:v1"], check=True, capture_output=True)
    index = json.loads((layout / "index.json").read_text())
    return f"{registry}/{repo}@{index['manifests'][0]['digest']}"


# -- the helper and its build trees ------------------------------------------------------------------


@pytest.fixture
def priv(btrfs_pool: Pool, registry: str) -> InProcess:
    return InProcess(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=DEFAULT_CACHE_DIR,
                                   pool_root=btrfs_pool.root, registries=(f"http://{registry}",)))


@pytest.fixture
async def work(btrfs_pool: Pool, priv: InProcess) -> AsyncIterator[tuple[str, Path]]:
    """An empty build begun by the helper: (REL, path)."""
    name = f"build-oci{uuid.uuid4().hex[:8]}@{uuid.uuid4().hex[:16]}"
    await priv.call("template.begin", {"work": f"tmp/{name}"})
    path = btrfs_pool.tmp_dir / name
    yield f"tmp/{name}", path
    await btrfs_pool.delete_subvolume(path)


async def test_an_image_larger_than_a_build_may_be_is_not_pulled(btrfs_pool: Pool, work: tuple[str, Path],
                                                                 registry: str, tmp_path: Path) -> None:
    rel, root = work
    image = push(tmp_path, registry, "test/too-big", [[Entry("blob", data=os.urandom(64 << 10))]], {})
    small = InProcess(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=DEFAULT_CACHE_DIR,
                                    pool_root=btrfs_pool.root, registries=(f"http://{registry}",),
                                    build_max_bytes=16 << 10))
    with pytest.raises(RuntimeFailure, match=r"compressed; a template build on this node may be at most 16384"):
        await small.call("template.oci", {"work": rel, "image": image})
    assert os.listdir(root) == []  # nothing pulled, nothing unpacked
    assert not list((btrfs_pool.data_dir / "build-bundles").glob("oci-*"))


# -- signature policies -------------------------------------------------------------------------


@dataclass
class Signer:
    """A GPG key (no passphrase) in a keyring of its own, and where its signatures are stored
    (a lookaside directory, as a registry's signature server would serve them)."""

    home: Path
    fingerprint: str
    public_key: Path
    registries_d: Path

    def sign_and_push(self, tmp_path: Path, registry: str, repo: str) -> str:
        """An image pushed as ``registry/repo:v1`` and signed by this key; its name pinned by digest."""
        layout = tmp_path / f"layout-{uuid.uuid4().hex[:8]}"
        write_layout(layout, [[Entry("signed", data=repo.encode())]], {})
        subprocess.run(["skopeo", "--insecure-policy", "--registries.d", str(self.registries_d), "copy", "--quiet",
                        "--preserve-digests", "--dest-tls-verify=false", "--sign-by", self.fingerprint,
                        f"oci:{layout}:v1", f"docker://{registry}/{repo}:v1"], check=True, capture_output=True,
                       env={"PATH": os.environ["PATH"], "GNUPGHOME": str(self.home)})
        index = json.loads((layout / "index.json").read_text())
        return f"{registry}/{repo}@{index['manifests'][0]['digest']}"


def make_signer(d: Path, registry: str) -> Signer:
    home = d / "gnupg"
    home.mkdir(mode=0o700, parents=True)
    params = d / "key-params"
    params.write_text("%no-protection\nKey-Type: EDDSA\nKey-Curve: ed25519\nName-Real: SPACE test signer\n"
                      "Expire-Date: 0\n%commit\n")
    env = {"PATH": os.environ["PATH"], "GNUPGHOME": str(home)}
    subprocess.run(["gpg", "--batch", "--gen-key", str(params)], check=True, capture_output=True, env=env)
    listed = subprocess.run(["gpg", "--batch", "--with-colons", "--list-keys"], check=True, capture_output=True,
                            text=True, env=env).stdout
    fingerprint = next(line.split(":")[9] for line in listed.splitlines() if line.startswith("fpr:"))
    public = d / "signer.gpg"
    public.write_bytes(subprocess.run(["gpg", "--batch", "--export", fingerprint], check=True, capture_output=True,
                                      env=env).stdout)
    sigs, registries_d = d / "signatures", d / "registries.d"
    sigs.mkdir()
    registries_d.mkdir()
    (registries_d / "test.yaml").write_text(f"docker:\n  {registry}:\n    lookaside: file://{sigs}\n"
                                            f"    lookaside-staging: file://{sigs}\n")
    return Signer(home, fingerprint, public, registries_d)


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory, registry: str) -> Signer:
    return make_signer(tmp_path_factory.mktemp("signer"), registry)


def policy_helper(btrfs_pool: Pool, registry: str, policy: Path, signatures: Path | None) -> InProcess:
    return InProcess(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=DEFAULT_CACHE_DIR,
                                   pool_root=btrfs_pool.root, registries=(f"http://{registry}",),
                                   image_policy=policy, signatures=signatures))


def signed_only(tmp_path: Path, registry: str, key: Path) -> Path:
    """An operator's policy: ``registry/signed/...`` images must be signed by ``key``; others as they are."""
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({
        "default": [{"type": "insecureAcceptAnything"}],
        "transports": {"docker": {f"{registry}/signed": [{"type": "signedBy", "keyType": "GPGKeys",
                                                            "keyPath": str(key)}]}}}))
    policy.chmod(0o644)
    return policy


@contextlib.asynccontextmanager
async def fresh_work(btrfs_pool: Pool, helper: InProcess) -> AsyncIterator[tuple[str, Path]]:
    """A new empty build (one refused pull ends a build: the next attempt gets its own)."""
    name = f"build-oci{uuid.uuid4().hex[:8]}@{uuid.uuid4().hex[:16]}"
    await helper.call("template.begin", {"work": f"tmp/{name}"})
    try:
        yield f"tmp/{name}", btrfs_pool.tmp_dir / name
    finally:
        await btrfs_pool.delete_subvolume(btrfs_pool.tmp_dir / name)


async def test_a_signature_policy_pulls_only_images_signed_by_its_key(
        btrfs_pool: Pool, registry: str, signer: Signer, tmp_path: Path) -> None:
    helper = policy_helper(btrfs_pool, registry, signed_only(tmp_path, registry, signer.public_key),
                           signer.registries_d)
    # Unsigned, where the policy wants a signature: refused before a layer is copied.
    unsigned = push(tmp_path, registry, "signed/unsigned", [[Entry("x", data=b"unsigned")]], {})
    async with fresh_work(btrfs_pool, helper) as (rel, root):
        with pytest.raises(Forbidden, match=r"refused by this node's image policy .*A signature was required"):
            await helper.call("template.oci", {"work": rel, "image": unsigned})
        assert os.listdir(root) == []
    # Signed by another key: refused too.
    other = make_signer(tmp_path / "other", registry)
    (other.registries_d / "test.yaml").write_text((signer.registries_d / "test.yaml").read_text())
    forged = other.sign_and_push(tmp_path, registry, "signed/forged")
    async with fresh_work(btrfs_pool, helper) as (rel, root):
        with pytest.raises(Forbidden, match=r"refused by this node's image policy"):
            await helper.call("template.oci", {"work": rel, "image": forged})
        assert os.listdir(root) == []
    # Signed by the key: pulled and unpacked.
    image = signer.sign_and_push(tmp_path, registry, "signed/app")
    async with fresh_work(btrfs_pool, helper) as (rel, root):
        res = await helper.call("template.oci", {"work": rel, "image": image})
        assert res["digest"] == image.rpartition("@")[2]
        assert (root / "signed").read_bytes() == b"signed/app"
    assert not list((btrfs_pool.data_dir / "build-bundles").glob("oci-*"))


async def test_an_image_outside_the_policys_scope_is_pulled_as_before(
        btrfs_pool: Pool, registry: str, signer: Signer, tmp_path: Path) -> None:
    helper = policy_helper(btrfs_pool, registry, signed_only(tmp_path, registry, signer.public_key), None)
    image = push(tmp_path, registry, "open/app", [[Entry("open", data=b"unsigned is fine here")]], {})
    async with fresh_work(btrfs_pool, helper) as (rel, root):
        await helper.call("template.oci", {"work": rel, "image": image})
        assert (root / "open").read_bytes() == b"unsigned is fine here"


async def test_a_policy_others_could_change_is_not_used(
        btrfs_pool: Pool, registry: str, signer: Signer, tmp_path: Path) -> None:
    policy = signed_only(tmp_path, registry, signer.public_key)
    image = push(tmp_path, registry, "signed/anything", [[Entry("x")]], {})
    helper = policy_helper(btrfs_pool, registry, policy, None)
    policy.chmod(0o666)  # anyone could loosen it: the helper decides nothing with it
    async with fresh_work(btrfs_pool, helper) as (rel, root):
        with pytest.raises(Forbidden, match=r"must be root's and writable by no one else"):
            await helper.call("template.oci", {"work": rel, "image": image})
        assert os.listdir(root) == []
    policy.chmod(0o644)
    policy.write_text("[]")
    async with fresh_work(btrfs_pool, helper) as (rel, root):
        with pytest.raises(Forbidden, match=r"not a containers-policy.json"):
            await helper.call("template.oci", {"work": rel, "image": image})
        assert os.listdir(root) == []
    assert not list((btrfs_pool.data_dir / "build-bundles").glob("oci-*"))  # no staging left either


class Lines(list[str]):
    async def __call__(self, line: str) -> None:
        self.append(line)


async def test_layers_apply_in_order_with_owners_modes_xattrs_and_whiteouts(
        priv: InProcess, work: tuple[str, Path], registry: str, tmp_path: Path) -> None:
    rel, root = work
    lower = [Entry("etc", "dir", mode=0o755), Entry("etc/greeting", data=b"hello\n"),
             Entry("etc/gone", data=b"lower file\n"), Entry("opt", "dir", mode=0o755),
             Entry("opt/old", "dir", mode=0o755), Entry("opt/old/a", data=b"a"), Entry("opt/old/b", data=b"b"),
             Entry("home", "dir", mode=0o755), Entry("home/user", "dir", mode=0o750, uid=1000, gid=1000),
             Entry("home/user/notes", data=b"mine\n", mode=0o600, uid=1000, gid=1000,
                   xattrs={"user.origin": "layer-1"}),
             Entry("usr", "dir", mode=0o755), Entry("usr/bin", "dir", mode=0o755),
             Entry("usr/bin/tool", data=b"#!/bin/sh\n", mode=0o4755),
             Entry("etc/link", "symlink", link="/etc/greeting"),
             Entry("etc/hard", "hardlink", link="etc/greeting")]
    upper = [Entry("etc/.wh.gone"), Entry("opt/old", "dir", mode=0o755), Entry("opt/old/.wh..wh..opq"),
             Entry("opt/old/c", data=b"c"), Entry("etc/added", data=b"upper\n", mode=0o640, gid=1000)]
    config = {"Env": ["PATH=/usr/bin:/bin", "FOO=bar baz", "=bad", "NOEQUALS"], "User": "1000:1000",
              "WorkingDir": "/home/user", "Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo hi"]}
    image = push(tmp_path, registry, "test/layers", [lower, upper], config)
    lines = Lines()

    res = await priv.call("template.oci", {"work": rel, "image": image}, on_line=lines)

    assert res["digest"] == image.rpartition("@")[2] and res["layers"] == 2
    assert res["config"] == {"env": ["PATH=/usr/bin:/bin", "FOO=bar baz"], "user": "1000:1000",
                             "workdir": "/home/user", "entrypoint": ["/bin/sh", "-c"], "cmd": ["echo hi"]}
    assert (root / "etc/greeting").read_bytes() == b"hello\n"
    assert not (root / "etc/gone").exists()  # the whiteout
    assert sorted(os.listdir(root / "opt/old")) == ["c"]  # the opaque directory
    home = (root / "home/user").lstat()
    assert (home.st_uid, home.st_gid, home.st_mode & 0o7777) == (1000, 1000, 0o750)
    notes = (root / "home/user/notes").lstat()
    assert (notes.st_uid, notes.st_mode & 0o7777) == (1000, 0o600)
    assert os.getxattr(root / "home/user/notes", "user.origin", follow_symlinks=False) == b"layer-1"
    assert (root / "usr/bin/tool").lstat().st_mode & 0o7777 == 0o4755
    assert os.readlink(root / "etc/link") == "/etc/greeting"
    assert (root / "etc/hard").lstat().st_ino == (root / "etc/greeting").lstat().st_ino
    added = (root / "etc/added").lstat()
    assert (added.st_gid, added.st_mode & 0o777) == (1000, 0o640)
    assert any("unpacking 2 layer(s)" in ln for ln in lines)
    # The tree is a root now: a second image into it is refused.
    with pytest.raises(Conflict):
        await priv.call("template.oci", {"work": rel, "image": image})


async def test_refused_before_anything_is_pulled(
        priv: InProcess, work: tuple[str, Path], registry: str, tmp_path: Path) -> None:
    rel, root = work
    image = push(tmp_path, registry, "test/refused", [[Entry("f", data=b"x")]])
    digest = image.rpartition("@")[2]
    with pytest.raises(InvalidRequest, match="not one this node pulls images from"):
        await priv.call("template.oci", {"work": rel, "image": f"127.0.0.2:1/test/refused@{digest}"})
    for bad in (f"{registry}/test/refused:v1", f"{registry}/Test/refused@{digest}", f"{registry}/test/refused",
                f"{registry}/../x@{digest}", f"{registry}/test/refused@sha256:{'0' * 63}", "x" * 5000):
        with pytest.raises(InvalidRequest):
            await priv.call("template.oci", {"work": rel, "image": bad})
    with pytest.raises(NotFound):
        await priv.call("template.oci", {"work": "tmp/build-never-begun@0123456789abcdef", "image": image})
    assert os.listdir(root) == []
    # Still an empty build: the image goes in now.
    await priv.call("template.oci", {"work": rel, "image": image})
    assert (root / "f").read_bytes() == b"x"


async def test_a_digest_the_registry_lacks_fails_clearly(
        priv: InProcess, work: tuple[str, Path], registry: str, tmp_path: Path) -> None:
    rel, _ = work
    push(tmp_path, registry, "test/missing", [[Entry("f", data=b"x")]])
    with pytest.raises(RuntimeFailure, match=r"pulling .* failed"):
        await priv.call("template.oci", {"work": rel, "image": f"{registry}/test/missing@sha256:{'ab' * 32}"})
    with pytest.raises(Conflict, match="failed"):  # the tree is marked: delete it and begin again
        await priv.call("template.oci", {"work": rel, "image": f"{registry}/test/missing@sha256:{'ab' * 32}"})


HOSTILE = {
    "dotdot": lambda out: [Entry("../../../../../../" + str(out).lstrip("/") + "/dotdot", data=b"escaped")],
    "absolute": lambda out: [Entry(str(out) + "/absolute", data=b"escaped")],
    "through a symlink": lambda out: [Entry("out", "symlink", link=str(out)),
                                      Entry("out/through-link", data=b"escaped")],
    "through a relative symlink": lambda out: [Entry("up", "symlink", link="../../../../../../" + str(out).lstrip("/")),
                                               Entry("up/through-link", data=b"escaped")],
    "a hard link out": lambda out: [Entry("hl", "hardlink", link="../../../../../../etc/passwd")],
    "a symlinked directory then a file": lambda out: [Entry("d", "symlink", link=str(out)),
                                                      Entry("d/f", data=b"escaped")],
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
async def test_a_hostile_layer_writes_nothing_outside_the_tree(
        priv: InProcess, work: tuple[str, Path], registry: str, tmp_path: Path, kind: str) -> None:
    rel, root = work
    outside = tmp_path / f"outside-{uuid.uuid4().hex[:8]}"
    outside.mkdir()
    image = push(tmp_path, registry, "test/hostile", [[Entry("ok", data=b"ok")], HOSTILE[kind](outside)])
    with contextlib.suppress(RuntimeFailure):  # refusing the layer is as good as confining it
        await priv.call("template.oci", {"work": rel, "image": image})
    assert os.listdir(outside) == []
    with contextlib.suppress(FileNotFoundError):  # a link to the host's file would be an escape
        assert os.lstat(root / "hl").st_ino != os.lstat("/etc/passwd").st_ino


async def test_a_mirror_serves_docker_hubs_names(btrfs_pool: Pool, work: tuple[str, Path], registry: str,
                                                tmp_path: Path) -> None:
    """``docker.io=URL``: an image named ``docker.io/library/...`` (``ubuntu:22.04`` in full) is
    asked for and pulled at the mirror, and keeps its own name; without the mirror, docker.io is
    not a registry this node pulls from."""
    rel, root = work
    pushed = push(tmp_path, registry, "library/ubuntu", [[Entry("etc-issue", data=b"mirrored\n")]], {"Env": ["M=1"]})
    digest = pushed.rpartition("@")[2]
    mirrored = InProcess(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=DEFAULT_CACHE_DIR,
                                       pool_root=btrfs_pool.root, registries=(f"docker.io=http://{registry}",)))
    res = await mirrored.call("image.inspect", {"image": "docker.io/library/ubuntu:v1"})
    assert res["image"] == f"docker.io/library/ubuntu@{digest}" and res["config"]["env"] == ["M=1"]
    await mirrored.call("template.oci", {"work": rel, "image": res["image"]})
    assert (root / "etc-issue").read_bytes() == b"mirrored\n"
    plain = InProcess(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=DEFAULT_CACHE_DIR,
                                    pool_root=btrfs_pool.root, registries=(f"http://{registry}",)))
    with pytest.raises(InvalidRequest, match=r"registry docker\.io is not one this node pulls images from"):
        await plain.call("image.inspect", {"image": "docker.io/library/ubuntu:v1"})


def push_index(tmp_path: Path, registry: str, repo: str) -> tuple[str, str]:
    """An index of two platforms (arm64 first) pushed as ``repo:multi``: (its digest, the amd64
    manifest's digest)."""
    layout = tmp_path / f"index-{uuid.uuid4().hex[:8]}"
    write_layout(layout, [[Entry("platform", data=b"amd64")]], {"Env": ["ARCH=amd64"]})
    amd64 = json.loads((layout / "index.json").read_text())["manifests"][0]
    other = tmp_path / f"other-{uuid.uuid4().hex[:8]}"
    write_layout(other, [[Entry("platform", data=b"arm64")]], {"Env": ["ARCH=arm64"]})
    arm64 = json.loads((other / "index.json").read_text())["manifests"][0]
    for blob in (other / "blobs" / "sha256").iterdir():
        shutil.copy(blob, layout / "blobs" / "sha256" / blob.name)
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
        {"mediaType": arm64["mediaType"], "digest": arm64["digest"], "size": arm64["size"],
         "platform": {"os": "linux", "architecture": "arm64"}},
        {"mediaType": amd64["mediaType"], "digest": amd64["digest"], "size": amd64["size"],
         "platform": {"os": "linux", "architecture": "amd64"}}]}
    d = _put_blob(layout, json.dumps(index).encode())
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": index["mediaType"], **d, "annotations": {"org.opencontainers.image.ref.name": "multi"}}]}))
    subprocess.run(["skopeo", "--insecure-policy", "copy", "--all", "--quiet", "--preserve-digests",
                    "--dest-tls-verify=false", f"oci:{layout}:multi", f"docker://{registry}/{repo}:multi"],
                   check=True, capture_output=True)
    return str(d["digest"]), str(amd64["digest"])


async def test_inspect_pins_a_tag_to_this_platforms_manifest(
        priv: InProcess, work: tuple[str, Path], registry: str, tmp_path: Path) -> None:
    rel, root = work
    image = push(tmp_path, registry, "test/inspect", [[Entry("f", data=b"x")]],
                 {"User": "user", "Env": ["A=1"], "Cmd": ["serve"]})
    res = await priv.call("image.inspect", {"image": f"{registry}/test/inspect:v1"})
    assert res["image"] == image
    assert res["config"] == {"env": ["A=1"], "user": "user", "workdir": "", "entrypoint": [], "cmd": ["serve"]}
    assert (await priv.call("image.inspect", {"image": image}))["image"] == image  # a digest stays itself

    index_digest, amd64 = push_index(tmp_path, registry, "test/multi")
    for ref in (f"{registry}/test/multi:multi", f"{registry}/test/multi@{index_digest}"):
        res = await priv.call("image.inspect", {"image": ref})
        assert res["image"] == f"{registry}/test/multi@{amd64}" and res["config"]["env"] == ["ARCH=amd64"]
    # What inspect pinned is what template.oci unpacks.
    await priv.call("template.oci", {"work": rel, "image": res["image"]})
    assert (root / "platform").read_bytes() == b"amd64"

    with pytest.raises(InvalidRequest, match="not one this node pulls images from"):
        await priv.call("image.inspect", {"image": "127.0.0.2:1/test/inspect:v1"})
    for bad in (f"{registry}/test/inspect", f"{registry}/test/inspect:-bad", f"{registry}/Test/x:v1"):
        with pytest.raises(InvalidRequest):
            await priv.call("image.inspect", {"image": bad})
    with pytest.raises(RuntimeFailure, match="skopeo inspect failed"):
        await priv.call("image.inspect", {"image": f"{registry}/test/inspect:no-such-tag"})


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry that wants a login (alice / s3cret, htpasswd), as ``localhost:<port>``."""
    import warnings

    with warnings.catch_warnings():  # crypt: the one stdlib way to bcrypt (libxcrypt), going in 3.13
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt
    d = tmp_path_factory.mktemp("auth-registry")
    (d / "htpasswd").write_text(f"alice:{crypt.crypt('s3cret', crypt.mksalt(crypt.METHOD_BLOWFISH))}\n")
    with serve_registry(d, f"auth:\n  htpasswd:\n    realm: test\n    path: {d / 'htpasswd'}\n") as port:
        yield f"localhost:{port}"


def push_with_login(tmp_path: Path, registry: str, repo: str, layers: list[list[Entry] | Path]) -> str:
    layout = tmp_path / f"layout-{uuid.uuid4().hex[:8]}"
    write_layout(layout, layers, {})
    subprocess.run(["skopeo", "--insecure-policy", "copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false",
                    "--dest-creds", "alice:s3cret", f"oci:{layout}:v1", f"docker://{registry}/{repo}:v1"],
                   check=True, capture_output=True)
    index = json.loads((layout / "index.json").read_text())
    return f"{registry}/{repo}@{index['manifests'][0]['digest']}"


@pytest.fixture
def priv_auth(btrfs_pool: Pool, auth_registry: str) -> InProcess:
    return InProcess(HelperContext(data_dir=btrfs_pool.data_dir, cache_dir=DEFAULT_CACHE_DIR,
                                   pool_root=btrfs_pool.root, registries=(f"http://{auth_registry}",)))


async def test_a_registry_that_wants_a_login_gets_the_one_passed(
        priv_auth: InProcess, work: tuple[str, Path], auth_registry: str, tmp_path: Path) -> None:
    from space.node.templates.logins import logins_fd

    rel, root = work
    image = push_with_login(tmp_path, auth_registry, "private/app", [[Entry("secret-file", data=b"ok")]])
    tag = image.split("@")[0] + ":v1"
    # No login, a wrong one: refused by the registry, said so.
    with pytest.raises(RuntimeFailure, match=r"skopeo inspect failed.*(unauthorized|authentication)"):
        await priv_auth.call("image.inspect", {"image": tag})
    with logins_fd({auth_registry: {"username": "alice", "password": "wrong"}}) as fds, \
            pytest.raises(RuntimeFailure, match=r"unauthorized|authentication"):
        await priv_auth.call("image.inspect", {"image": tag}, fds=fds)
    login = {auth_registry: {"username": "alice", "password": "s3cret"}}
    with logins_fd(login) as fds:
        assert (await priv_auth.call("image.inspect", {"image": tag}, fds=fds))["image"] == image
    with logins_fd(login) as fds:
        await priv_auth.call("template.oci", {"work": rel, "image": image}, fds=fds)
    assert (root / "secret-file").read_bytes() == b"ok"
    # The login never stays on the node: the staging directories are gone.
    assert not [p for p in (priv_auth.ctx.data_dir / "build-bundles").glob("oci-*")]


async def test_malformed_logins_are_refused(priv_auth: InProcess, auth_registry: str) -> None:
    for bad in (b"not json", b"[]", json.dumps({"Bad Host": {"username": "a", "password": "b"}}).encode(),
                json.dumps({auth_registry: {"username": "a:b", "password": "c"}}).encode(),
                json.dumps({auth_registry: {"username": "a", "password": "line\nbreak"}}).encode(),
                json.dumps({auth_registry: {"username": "a"}}).encode(), b"x" * (65 << 10)):
        fd = os.memfd_create("bad-logins")
        try:
            os.write(fd, bad)
            with pytest.raises(InvalidRequest, match=r"registry logins|limited"):
                await priv_auth.call("image.inspect", {"image": f"{auth_registry}/private/app:v1"}, fds={"auth": fd})
        finally:
            os.close(fd)
