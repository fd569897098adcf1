"""Finding 7 of issue 13: object storage was trusted blindly.

Whoever can write the bucket (its directory, its S3 credentials, or the API user, which shares the
local store's directory) must not be able to make a node restore, receive or boot anything the
deployment did not write. Each test plays that attacker against a real ``space serve`` whose
object store is a local directory and then a moto S3 bucket: it knows every byte in the bucket and
recomputes every checksum it finds, but holds no deployment key. Every attack must be refused
before root touches a tampered byte (no ``btrfs receive``, no ``runsc`` restore of it), with the
stable error code ``object_tampered``, a sandbox event and an audit record; the sandbox stays
suspended, and once the operator puts the bucket back the same restore succeeds.

Attacks: a flipped byte in a memory image; the root filesystem delta of another sandbox swapped
in; another sandbox's manifest and artifacts replayed verbatim, or with its ids rewritten; a
truncated memory image and an extended delta; the ``base`` template's stream rewritten with a
backdoor (alone, or with every manifest that names it), fetched by a node that lacks the template.
And objects from before sealing: refused until ``space objects migrate`` seals those that agree
with the database (one tampered with before the upgrade stays refused).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.node.templates.store import BASE_SPEC, spec_digest
from tests.e2e.harness import SPACE, NodeAgent, Server, create_sandbox, sh, wait_operation
from tests.e2e.test_lifecycle import act, count, start_counter, state
from tests.security.objstore_fixtures import (
    Deployment,
    Saved,
    crafted_template,
    deployment,
    entries,
    fix_artifact,
    further_node,
    replace_text,
    rewrite_json,
    sha256,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.runtime

TAMPERED = "object_tampered"
MARK = "/home/user/mark"


@pytest.fixture(scope="module", params=["dir", "s3"])
def dep(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    # Without object encryption: these are the attacks on sealing (authenticated manifests and
    # template streams) as it stands alone, on objects whose fields an attacker can read and edit,
    # and the migration of objects written before sealing, which were never encrypted either. The
    # encrypted form's refusals (frames flipped, swapped or cut, a rewritten private part, a
    # swapped wrapped key) are in tests/node/test_artifacts_encrypted.py and tests/e2e/test_byok.py.
    with deployment(str(request.param), tmp_path_factory.mktemp(f"tamper-{request.param}"), encrypt=False) as d:
        yield d


@pytest.fixture(scope="module")
def api(dep: Deployment) -> Iterator[httpx.Client]:
    with dep.server.client(timeout=120) as c:
        yield c


class Parked:
    """A sandbox with a marker file and a counting process, suspended to object storage."""

    def __init__(self, api: httpx.Client, *, memory: bool = True) -> None:
        self.id = create_sandbox(api)
        self.mark = f"mark-of-{self.id}"
        sh(api, self.id, f"echo {self.mark} > {MARK} && sync")
        if memory:
            start_counter(api, self.id)
        act(api, self.id, "suspend", {"memory": memory})
        sb = api.get(f"/v1/sandboxes/{self.id}").json()
        assert sb["state"] == "suspended", sb
        self.snap = str(sb["snapshot_id"])
        self.prefix = f"tenants/default/sandboxes/{self.id}/snapshots/{self.snap}"
        self.manifest = f"{self.prefix}/manifest.json"


@pytest.fixture
def parked(api: httpx.Client) -> Iterator[list[Parked]]:
    """Sandboxes a test suspends; deleted after it."""
    made: list[Parked] = []
    yield made
    for p in made:
        r = api.delete(f"/v1/sandboxes/{p.id}")
        if r.status_code == 202:
            assert wait_operation(api, r.json()["operation"]["id"])["status"] == "succeeded"


def park(api: httpx.Client, made: list[Parked], *, memory: bool = True) -> Parked:
    p = Parked(api, memory=memory)
    made.append(p)
    return p


def log_offset(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def helper_calls(path: Path, since: int, verb: str, needle: str) -> list[str]:
    """The root helper's logged calls of ``verb`` since ``since`` whose arguments mention ``needle``."""
    with open(path, "rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    return [ln for ln in lines if "helper.call" in ln and f'"{verb}"' in ln and needle in ln]


def restore(api: httpx.Client, p: Parked, node: str | None = None) -> dict[str, Any]:
    r = api.post(f"/v1/sandboxes/{p.id}/restore", json={"node": node} if node else None)
    assert r.status_code == 202, r.text
    return wait_operation(api, r.json()["operation"]["id"], timeout=600)


def assert_refused(api: httpx.Client, server: Server, p: Parked, *, key: str, node: NodeAgent | None = None
                   ) -> dict[str, Any]:
    """Restore ``p`` (on ``node``, else where the scheduler puts it): refused as tampered, naming
    ``key``, before root received or restored any of it; the sandbox stays suspended, and the
    refusal is a sandbox event and an audit record."""
    log = node.log_path if node is not None else server.log_path
    since = log_offset(log)
    op = restore(api, p, node.node_id if node is not None else None)
    assert op["status"] == "failed", op
    assert op["error"]["code"] == TAMPERED, op["error"]
    assert key in op["error"]["message"], op["error"]
    sb = api.get(f"/v1/sandboxes/{p.id}").json()
    assert (sb["state"], sb["node_id"]) == ("suspended", None), sb
    assert sb["error"]["code"] == TAMPERED, sb
    data_dir = node.data_dir if node is not None else server.data_dir
    assert not (data_dir / "pool" / "sandboxes" / p.id).exists()
    # Root never parsed a byte of it: no receive into the sandbox, no runtime restore of it.
    assert helper_calls(log, since, "stream.receive", f"sandboxes/{p.id}") == []
    assert helper_calls(log, since, "runtime.launch", p.id) == []
    events = api.get(f"/v1/sandboxes/{p.id}/events").json()["events"]
    tampered = [e for e in events if e["kind"] == TAMPERED]
    assert tampered and tampered[-1]["data"]["key"] == key, events[-3:]
    assert tampered[-1]["data"]["reason"], tampered[-1]
    records = api.get("/v1/audit", params={"action": "objstore.tampered", "target": key}).json()["records"]
    assert records and records[-1]["result"] == TAMPERED and records[-1]["tenant"] == "default", records
    return dict(tampered[-1])


def assert_restores(api: httpx.Client, p: Parked, node: NodeAgent | None = None) -> None:
    """After the operator's repair, the same sandbox restores with its own files and processes."""
    op = restore(api, p, node.node_id if node is not None else None)
    assert op["status"] == "succeeded", op
    assert state(api, p.id) == "running"
    assert sh(api, p.id, f"cat {MARK}").strip() == p.mark


def largest_image(dep: Deployment, p: Parked) -> str:
    images = [k for k in dep.bucket.keys(f"{p.prefix}/checkpoint/")]
    assert images, dep.bucket.keys(p.prefix)
    return max(images, key=lambda k: len(dep.bucket.read(k)))


def test_a_flipped_byte_in_a_memory_image_is_refused(dep: Deployment, api: httpx.Client,
                                                     parked: list[Parked]) -> None:
    p = park(api, parked)
    saved = Saved.take(dep.bucket, p.prefix)
    image = largest_image(dep, p)
    data = bytearray(dep.bucket.read(image))
    data[len(data) // 2] ^= 0x01
    dep.bucket.write(image, bytes(data))
    fix_artifact(dep.bucket, p.manifest, image.removeprefix(p.prefix + "/"), bytes(data))
    assert_refused(api, dep.server, p, key=p.manifest)
    saved.put_back()
    assert_restores(api, p)
    n = count(api, p.id)
    wait_for(lambda: count(api, p.id) > n, 60, "the restored counter to continue")


def test_the_delta_of_another_sandbox_swapped_in_is_refused(dep: Deployment, api: httpx.Client,
                                                            parked: list[Parked]) -> None:
    a, b = park(api, parked, memory=False), park(api, parked, memory=False)
    saved = Saved.take(dep.bucket, a.prefix)
    theirs = dep.bucket.read(f"{b.prefix}/rootfs.btrfs.zst")
    dep.bucket.write(f"{a.prefix}/rootfs.btrfs.zst", theirs)
    fix_artifact(dep.bucket, a.manifest, "rootfs.btrfs.zst", theirs)
    assert_refused(api, dep.server, a, key=a.manifest)
    saved.put_back()
    assert_restores(api, a)


@pytest.mark.parametrize("how", ["verbatim", "ids-rewritten"])
def test_another_sandboxs_manifest_replayed_is_refused(dep: Deployment, api: httpx.Client,
                                                       parked: list[Parked], how: str) -> None:
    a, b = park(api, parked, memory=False), park(api, parked, memory=False)
    saved = Saved.take(dep.bucket, a.prefix)
    for k in dep.bucket.keys(a.prefix):
        dep.bucket.delete(k)
    for k in dep.bucket.keys(b.prefix):
        dep.bucket.write(a.prefix + k.removeprefix(b.prefix), dep.bucket.read(k))
    if how == "ids-rewritten":
        # Every id of b the manifest names becomes a's: all a checksum-only manifest could check.
        replace_text(dep.bucket, a.manifest, {b.id: a.id, b.snap: a.snap})
    assert_refused(api, dep.server, a, key=a.manifest)
    saved.put_back()
    assert_restores(api, a)


@pytest.mark.parametrize("how", ["truncated-image", "extended-delta"])
def test_a_truncated_or_extended_artifact_is_refused(dep: Deployment, api: httpx.Client,
                                                     parked: list[Parked], how: str) -> None:
    p = park(api, parked)
    saved = Saved.take(dep.bucket, p.prefix)
    if how == "truncated-image":
        key = largest_image(dep, p)
        data = dep.bucket.read(key)
        data = data[: len(data) // 2]
    else:
        key = f"{p.prefix}/rootfs.btrfs.zst"
        data = dep.bucket.read(key) + os.urandom(4096)
    dep.bucket.write(key, data)
    fix_artifact(dep.bucket, p.manifest, key.removeprefix(p.prefix + "/"), data)
    assert_refused(api, dep.server, p, key=p.manifest)
    saved.put_back()
    assert_restores(api, p)


def _template_streams(dep: Deployment) -> list[str]:
    return [k for k in dep.bucket.keys("templates/") if k.startswith("templates/base-") and k.endswith(".btrfs.zst")]


@pytest.mark.parametrize("how", ["stream", "stream-and-manifests"])
def test_a_rewritten_template_stream_is_refused_by_a_node_that_fetches_it(
        dep: Deployment, api: httpx.Client, parked: list[Parked], how: str, tmp_path: Path) -> None:
    """The attack that backdoors every tenant's next boot: ``base``'s stream in the bucket replaced
    by a valid one with a backdoor; a node without the template must refuse it (for a restore,
    and for a plain materialization), before ``btrfs receive`` sees a byte."""
    p = park(api, parked, memory=False)  # its suspend published base to the bucket
    streams = _template_streams(dep)
    assert streams, dep.bucket.keys("templates/")
    backdoor = f"backdoor-{p.id}"
    crafted = crafted_template(dep.server, backdoor)
    manifests = [k for k in dep.bucket.keys("templates/") if k.endswith(".json")] + [p.manifest]
    saved = Saved.take(dep.bucket, "templates/", p.prefix)
    for key in streams:
        legit = dep.bucket.read(key)
        dep.bucket.write(key, crafted)
        if how == "stream-and-manifests":
            # Also under the crafted bytes' own hash, and every manifest that names the stream
            # made to name the crafted one instead: all an attacker without the key can do.
            old, new = sha256(legit), sha256(crafted)
            if old in key:
                dep.bucket.write(key.replace(old, new), crafted)
            for m in manifests:
                def edit(doc: Any, old: str = old, new: str = new, size: int = len(legit)) -> None:
                    for e in entries(doc, lambda d: old in d.values()):
                        for f, v in list(e.items()):
                            if v == old:
                                e[f] = new
                            elif v == size:
                                e[f] = len(crafted)
                rewrite_json(dep.bucket, m, edit)
                replace_text(dep.bucket, m, {old: new})
    with further_node(dep, api, "node-2" if how == "stream" else "node-3", tmp_path) as node:
        assert node.info()["templates"] == []
        since = log_offset(node.log_path)
        assert_refused(api, dep.server, p, key=streams[0] if how == "stream" else p.manifest, node=node)
        # A node that materializes base without a snapshot naming it refuses the stream too.
        with node.client(timeout=600) as c:
            lines = [json.loads(ln) for ln in c.post("/v1/templates/ensure", json={"spec": BASE_SPEC}
                                                      ).text.splitlines() if ln.strip()]
        assert lines[-1].get("error", {}).get("code") == TAMPERED, lines[-3:]
        pool = node.data_dir / "pool" / "templates"
        assert not list(pool.glob("base@*/etc/space-backdoor")), "the backdoored template was received"
        assert node.info()["templates"] == []
        assert helper_calls(node.log_path, since, "stream.receive", "templates") == []
        saved.put_back()
        assert_restores(api, p, node)
        assert sh(api, p.id, "test ! -e /etc/space-backdoor && echo clean").strip() == "clean"


def _unseal(bucket: Any, key: str) -> None:
    """What the code before sealing wrote: the same body as plain JSON, format 1."""
    body = json.loads(bucket.read(key))["body"]
    meta = {k: v for k, v in body["meta"].items() if k != "template"}
    bucket.write(key, json.dumps({"format": 1, "created_at": body["created_at"], "meta": meta,
                                  "artifacts": body["artifacts"]}, indent=2, sort_keys=True).encode() + b"\n")


def _legacy_templates(bucket: Any) -> None:
    """base's stream where it was before content addressing, and no template manifest."""
    for key in bucket.keys("templates/"):
        if key.endswith(".json"):
            bucket.delete(key)
        elif key.endswith(".btrfs.zst"):
            digest = spec_digest(BASE_SPEC)
            bucket.write(f"templates/base-{digest}.btrfs.zst", bucket.read(key))
            bucket.delete(key)


def _migrate(dep: Deployment) -> subprocess.CompletedProcess[str]:
    srv = dep.server
    argv = [SPACE, "objects", "migrate", "--data-dir", str(srv.data_dir),
            "--cache-dir", str(srv.data_dir.parent / "cache")]
    if dep.kind == "s3":
        argv += ["--object-store-url", dep.url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, env={**os.environ, **dep.env})


def test_objects_from_before_sealing_are_refused_until_the_operator_migrates_them(
        dep: Deployment, api: httpx.Client, parked: list[Parked]) -> None:
    """An upgraded deployment: suspended sandboxes whose manifests and template stream were written
    unsealed. Nodes refuse them (``unauthenticated``); ``space objects migrate`` checks them
    against the database and seals what agrees with it, and refuses one tampered with before."""
    p, q = park(api, parked), park(api, parked, memory=False)
    _legacy_templates(dep.bucket)
    for x in (p, q):
        _unseal(dep.bucket, x.manifest)
    # q was tampered with before the upgrade: its delta extended, its checksum fixed to match.
    delta = f"{q.prefix}/rootfs.btrfs.zst"
    extended = dep.bucket.read(delta) + os.urandom(4096)
    dep.bucket.write(delta, extended)
    fix_artifact(dep.bucket, q.manifest, "rootfs.btrfs.zst", extended)
    for x in (p, q):
        assert assert_refused(api, dep.server, x, key=x.manifest)["data"]["reason"] == "unauthenticated"

    done = _migrate(dep)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert f"sealed: {p.manifest}" in done.stdout and f"REFUSED: {q.manifest}" in done.stdout, done.stdout
    assert f"sealed: templates/base-{spec_digest(BASE_SPEC)}.json" in done.stdout, done.stdout
    assert_restores(api, p)
    n = count(api, p.id)
    wait_for(lambda: count(api, p.id) > n, 60, "the migrated sandbox's counter to continue")
    assert_refused(api, dep.server, q, key=q.manifest)
    # Idempotent: a second run finds the sealed objects sealed (and refuses q again).
    again = _migrate(dep)
    assert again.returncode == 1 and f"REFUSED: {q.manifest}" in again.stdout, again.stdout
    assert f"already sealed: templates/base-{spec_digest(BASE_SPEC)}.json" in again.stdout, again.stdout


def test_the_manifest_key_is_out_of_reach_of_the_api_and_the_bucket(dep: Deployment) -> None:
    """Sealing is only as strong as the key's home: root's node agent made it, 0600 root, in the
    data dir (which the API's user may pass through but not list or write); nothing in the bucket."""
    key = dep.server.data_dir / "manifest.key"
    st = key.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600), (st.st_uid, oct(st.st_mode))
    text = key.read_text().strip()
    for k in dep.bucket.keys(""):
        assert text.encode() not in dep.bucket.read(k), k


def test_a_tampered_retained_snapshot_is_refused_for_a_rollback_and_a_new_sandbox(
        dep: Deployment, api: httpx.Client) -> None:
    """A snapshot that only object storage holds, its manifest given an environment to boot with
    (``LD_PRELOAD``): a rollback to it is refused and leaves the sandbox running as it was; a
    sandbox created from it fails, refused; after the repair the rollback works."""
    made = [create_sandbox(api)]
    sid = made[0]
    snap: str | None = None
    try:
        sh(api, sid, f"echo at-snapshot > {MARK}")
        r = api.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "disk", "retain": True})
        assert r.status_code == 202, r.text
        op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
        assert op["status"] == "succeeded", op
        snap = str(op["result"]["snapshot"])
        # A suspend and a restore leave the retained snapshot in object storage only.
        act(api, sid, "suspend")
        act(api, sid, "restore")
        assert api.get(f"/v1/snapshots/{snap}").json()["location"] == ["object_store"]
        sh(api, sid, f"echo after > {MARK}")
        manifest = f"tenants/default/snapshots/{snap}/manifest.json"
        saved = Saved.take(dep.bucket, f"tenants/default/snapshots/{snap}")

        def env(doc: Any) -> None:
            # The environment is the manifest's private part, beside the snapshot's description
            # (plain here: no object encryption).
            found = [d["private"] for d in entries(doc, lambda d: isinstance(d.get("snapshot"), dict)
                                                   and d["snapshot"].get("id") == snap
                                                   and isinstance(d.get("private"), dict) and "env" in d["private"])]
            assert found, doc
            for e in found:
                e["env"]["LD_PRELOAD"] = "/tmp/evil.so"
        rewrite_json(dep.bucket, manifest, env)

        since = log_offset(dep.server.log_path)
        r = api.post(f"/v1/sandboxes/{sid}/rollback", json={"snapshot": snap})
        assert r.status_code == 202, r.text
        op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
        assert op["status"] == "failed" and op["error"]["code"] == TAMPERED, op
        assert state(api, sid) == "running"
        assert sh(api, sid, f"cat {MARK}").strip() == "after"  # untouched
        kinds = [e["kind"] for e in api.get(f"/v1/sandboxes/{sid}/events").json()["events"]]
        assert TAMPERED in kinds and "rollback_failed" in kinds, kinds

        r = api.post("/v1/sandboxes", json={"snapshot": snap})
        assert r.status_code == 202, r.text
        child = str(r.json()["sandbox"]["id"])
        made.append(child)
        op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
        assert op["status"] == "failed" and op["error"]["code"] == TAMPERED, op
        sb = api.get(f"/v1/sandboxes/{child}").json()
        assert sb["state"] == "failed" and sb["error"]["code"] == TAMPERED, sb
        assert [e for e in api.get(f"/v1/sandboxes/{child}/events").json()["events"] if e["kind"] == TAMPERED]
        assert helper_calls(dep.server.log_path, since, "stream.receive", f"snapshots/{snap}") == []
        assert helper_calls(dep.server.log_path, since, "runtime.launch", child) == []

        saved.put_back()
        act(api, sid, "rollback", {"snapshot": snap})
        assert sh(api, sid, f"cat {MARK}").strip() == "at-snapshot"
    finally:
        for x in made:
            r = api.delete(f"/v1/sandboxes/{x}")
            if r.status_code == 202:
                wait_operation(api, r.json()["operation"]["id"])
        if snap is not None:
            api.delete(f"/v1/snapshots/{snap}")
