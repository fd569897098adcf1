"""What the object storage tamper tests (finding 7) attack with: a bucket read and written behind the
server's back (its local directory, or the S3 bucket through a plain S3 client), a deployment of
its own per backend (a real ``space serve`` with a template cache of its own), a further node that
shares the bucket but not the cache, and a crafted template stream.

The attacker here can write the bucket and nothing else: it knows every byte stored there and
recomputes every checksum it finds, but holds no key of the deployment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx
import obstore
import pytest
from moto.server import ThreadedMotoServer
from obstore.store import S3Store

from space.node.templates.store import BASE_SPEC, spec_digest
from tests.e2e.harness import NodeAgent, Server, loop_devices, node_scratch, own_server, wait_operation
from tests.waiting import wait_for

#: The machine's template cache: only its ``base`` stream is copied, into each deployment's own.
HOST_CACHE = Path("/var/cache/space")
S3_PREFIX = "space"
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "space-test",
    "AWS_SECRET_ACCESS_KEY": "space-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class Bucket(Protocol):
    """Keys relative to the deployment's object store root."""

    def keys(self, under: str) -> list[str]: ...

    def read(self, key: str) -> bytes: ...

    def write(self, key: str, data: bytes) -> None: ...

    def delete(self, key: str) -> None: ...


@dataclasses.dataclass
class DirBucket:
    root: Path

    def keys(self, under: str) -> list[str]:
        base = self.root / under
        if not base.exists():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file())

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)


@dataclasses.dataclass
class S3Bucket:
    endpoint: str
    bucket: str
    prefix: str

    def _store(self) -> S3Store:
        return S3Store(self.bucket, prefix=self.prefix, endpoint=self.endpoint,
                       access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                       secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                       region=S3_CREDENTIALS["AWS_DEFAULT_REGION"], client_options={"allow_http": True})

    def keys(self, under: str) -> list[str]:
        return sorted(str(o["path"]) for batch in obstore.list(self._store(), prefix=under) for o in batch)

    def read(self, key: str) -> bytes:
        return bytes(obstore.get(self._store(), key).bytes())

    def write(self, key: str, data: bytes) -> None:
        obstore.put(self._store(), key, data)

    def delete(self, key: str) -> None:
        obstore.delete(self._store(), key)


@dataclasses.dataclass
class Deployment:
    kind: str
    server: Server
    bucket: Bucket
    #: The object store URL and environment another node of the deployment is given.
    url: str
    env: dict[str, str]


def own_cache(scratch: Path) -> Path:
    """A template cache of the deployment's own (this change names cached streams differently),
    seeded with the host cache's ``base`` stream so that ``base`` is received, not built."""
    cache = scratch / "cache"
    (cache / "templates").mkdir(parents=True, exist_ok=True)
    name = f"base-{spec_digest(BASE_SPEC)}.btrfs.zst"
    if (HOST_CACHE / "templates" / name).exists():
        shutil.copyfile(HOST_CACHE / "templates" / name, cache / "templates" / name)
    elif (HOST_CACHE / "debootstrap").is_dir() and not (cache / "debootstrap").exists():
        # base must be built after all: from the packages this host already downloaded.
        shutil.copytree(HOST_CACHE / "debootstrap", cache / "debootstrap", symlinks=True)
    return cache


@contextlib.contextmanager
def deployment(kind: str, tmp: Path, *, encrypt: bool = True) -> Iterator[Deployment]:
    """A ``space serve`` whose object store is a local directory (``dir``) or a moto S3 bucket
    (``s3``, credentials in the environment as in production); ``encrypt=False`` runs it with
    ``--no-object-encryption``."""
    moto: ThreadedMotoServer | None = None
    env: dict[str, str] = {}
    url = ""
    bucket: Bucket | None = None
    if kind == "s3":
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        host, port = moto.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        name = f"space-{uuid.uuid4().hex[:12]}"
        httpx.put(f"{endpoint}/{name}", timeout=10).raise_for_status()
        bucket = S3Bucket(endpoint, name, S3_PREFIX)
        url = f"s3://{name}/{S3_PREFIX}?endpoint={endpoint}"
        env = dict(S3_CREDENTIALS)
    try:
        with own_server(tmp, env=env, start=False) as srv:
            scratch = srv.data_dir.parent
            srv.extra_args += ["--cache-dir", str(own_cache(scratch))]
            if not encrypt:
                srv.extra_args += ["--no-object-encryption"]
            if kind == "s3":
                srv.extra_args += ["--object-store-url", url]
            else:
                url = str(srv.data_dir / "objects")
                bucket = DirBucket(srv.data_dir / "objects")
            srv.start()
            assert bucket is not None
            yield Deployment(kind, srv, bucket, url, env)
    finally:
        if moto is not None:
            moto.stop()


@contextlib.contextmanager
def further_node(dep: Deployment, api: httpx.Client, node_id: str, tmp: Path) -> Iterator[NodeAgent]:
    """A node agent registered with the deployment, sharing its bucket but not its template cache;
    on exit its sandboxes are deleted and its pool, loop device and sockets released."""
    scratch = node_scratch(f"{node_id}-")
    node = NodeAgent(node_id=node_id, data_dir=scratch / "data", cache_dir=scratch / "cache",
                     log_path=tmp / f"{node_id}.log", object_store_url=dep.url, env=dict(dep.env))
    try:
        node.start(dep.server)
        yield node
    finally:
        try:
            for sb in api.get("/v1/sandboxes").json()["sandboxes"]:
                if sb["node_id"] == node_id:
                    r = api.delete(f"/v1/sandboxes/{sb['id']}")
                    if r.status_code == 202:
                        wait_operation(api, r.json()["operation"]["id"])
        finally:
            node.teardown()
        # A detached loop device still open is freed by the kernel when it is closed (a process of
        # another test that made a mount namespace while the pool was mounted holds a copy of the
        # mount until it exits): wait for that, with a deadline.
        wait_for(lambda: loop_devices(node.data_dir / "pool.img") == "", 120, f"{node_id}'s loop device to go")
        shutil.rmtree(scratch)


def crafted_template(server: Server, marker: str) -> bytes:
    """A valid, compressed ``btrfs send`` stream of a subvolume named like the server's ``base``
    template, with a backdoor file added: what an attacker who can write the bucket would plant."""
    pool = server.data_dir / "pool"
    found = [p for p in sorted((pool / "templates").glob("base@*")) if p.is_dir()]
    assert found, "the server has no base template"
    template = found[-1]
    work = pool / f"evil-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    sub = work / template.name
    try:
        _run("btrfs", "-q", "subvolume", "snapshot", str(template), str(sub))
        (sub / "etc" / "space-backdoor").write_text(marker + "\n")
        _run("btrfs", "property", "set", "-ts", str(sub), "ro", "true")
        send = subprocess.run(["bash", "-o", "pipefail", "-c", 'btrfs send -q "$1" | zstd -3 -q -c', "craft",
                               str(sub)], capture_output=True, check=False, timeout=600)
        assert send.returncode == 0, send.stderr.decode(errors="replace")
        return send.stdout
    finally:
        if sub.exists():
            _run("btrfs", "property", "set", "-ts", str(sub), "ro", "false")
            _run("btrfs", "-q", "subvolume", "delete", str(sub))
        work.rmdir()


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, (argv, done.stderr)


# ---- what the attacker does to a manifest -------------------------------------------------------


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entries(doc: Any, match: Callable[[dict[str, Any]], bool]) -> Iterator[dict[str, Any]]:
    """Every JSON object in ``doc`` (at any depth) that ``match`` accepts."""
    if isinstance(doc, dict):
        if match(doc):
            yield doc
        for v in doc.values():
            yield from entries(v, match)
    elif isinstance(doc, list):
        for v in doc:
            yield from entries(v, match)


def rewrite_json(bucket: Bucket, key: str, edit: Callable[[Any], None]) -> None:
    doc = json.loads(bucket.read(key))
    edit(doc)
    bucket.write(key, json.dumps(doc, indent=2, sort_keys=True).encode())


def fix_artifact(bucket: Bucket, manifest_key: str, name: str, data: bytes) -> None:
    """Make the manifest describe ``data`` as its artifact ``name``: the sha256 and size a
    checksum-only manifest would need to accept it."""
    def edit(doc: Any) -> None:
        found = list(entries(doc, lambda d: d.get("name") == name and "sha256" in d))
        assert found, f"no entry for {name} in {manifest_key}"
        for e in found:
            e["sha256"] = sha256(data)
            e["size"] = len(data)
    rewrite_json(bucket, manifest_key, edit)


def replace_text(bucket: Bucket, key: str, pairs: dict[str, str]) -> None:
    text = bucket.read(key).decode()
    for old, new in pairs.items():
        text = text.replace(old, new)
    bucket.write(key, text.encode())


@dataclasses.dataclass
class Saved:
    """What was under some prefixes before an attack, to put back (the operator's repair)."""

    bucket: Bucket
    prefixes: tuple[str, ...]
    objects: dict[str, bytes]

    @classmethod
    def take(cls, bucket: Bucket, *prefixes: str) -> Saved:
        return cls(bucket, prefixes, {k: bucket.read(k) for p in prefixes for k in bucket.keys(p)})

    def put_back(self) -> None:
        for p in self.prefixes:
            for k in self.bucket.keys(p):
                if k not in self.objects:
                    self.bucket.delete(k)
        for k, data in self.objects.items():
            self.bucket.write(k, data)


def skip_without_moto() -> None:
    pytest.importorskip("moto")
