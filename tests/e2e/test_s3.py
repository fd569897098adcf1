"""Suspend and restore through an S3-compatible object store given by URL (a real S3-protocol server,
moto, on loopback): the snapshot's manifest and artifacts and the template stream land in the
bucket, and the restored sandbox has its files and its running process back."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import obstore
import pytest
from moto.server import ThreadedMotoServer
from obstore.store import S3Store

from tests.e2e.harness import (
    Server,
    create_sandbox,
    own_server,
    wait_operation,
)
from tests.e2e.test_lifecycle import act, count, sh, start_counter, state
from tests.waiting import wait_for

pytestmark = pytest.mark.runtime

PREFIX = "space"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "space-test",
    "AWS_SECRET_ACCESS_KEY": "space-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3:
    """The bucket, read with a plain S3 client: what is really stored, independently of the
    object store code under test."""

    endpoint: str
    bucket: str

    def _store(self) -> S3Store:
        return S3Store(self.bucket, endpoint=self.endpoint, access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                       secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                       region=CREDENTIALS["AWS_DEFAULT_REGION"], client_options={"allow_http": True})

    def keys(self, under: str) -> list[str]:
        return [str(o["path"]) for batch in obstore.list(self._store(), prefix=under) for o in batch]

    def read(self, key: str) -> bytes:
        return bytes(obstore.get(self._store(), key).bytes())


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        bucket = f"space-{uuid.uuid4().hex[:12]}"
        httpx.put(f"{endpoint}/{bucket}", timeout=10).raise_for_status()
        yield S3(endpoint, bucket)
    finally:
        moto.stop()


@pytest.fixture(scope="module")
def s3_server(s3: S3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose object store is the bucket, credentials in the environment as in production."""
    url = f"s3://{s3.bucket}/{PREFIX}?endpoint={s3.endpoint}"
    with own_server(tmp_path_factory.mktemp("s3srv"), "--object-store-url", url, env=CREDENTIALS) as srv:
        yield srv


def test_suspend_to_s3_and_restore_brings_files_and_processes_back(s3: S3, s3_server: Server) -> None:
    with s3_server.client() as api:
        sid = create_sandbox(api)
        try:
            cid = start_counter(api, sid)
            digest = sh(api, sid, "head -c 1000000 /dev/urandom > /home/user/blob && sha256sum /home/user/blob"
                        ).split()[0]
            before = count(api, sid)
            act(api, sid, "suspend")
            sb = api.get(f"/v1/sandboxes/{sid}").json()
            assert sb["state"] == "suspended" and sb["node_id"] is None, sb
            snap = api.get(f"/v1/snapshots/{sb['snapshot_id']}").json()
            assert snap["restorable"] and snap["location"] == ["object_store"], snap

            # Everything is in the bucket, under the URL's prefix; nothing went to a local directory.
            where = f"{PREFIX}/tenants/default/sandboxes/{sid}/snapshots/{snap['id']}/"
            keys = set(s3.keys(where))
            assert where + "manifest.json" in keys and where + "rootfs.btrfs.zst" in keys, sorted(keys)
            manifest = json.loads(s3.read(where + "manifest.json"))
            assert manifest["format"] == 2 and manifest["mac"]["alg"] == "hmac-sha256", manifest
            names = {a["name"] for a in manifest["body"]["artifacts"]}
            assert "rootfs.btrfs.zst" in names and any(n.startswith("checkpoint/") for n in names), names
            assert {where + n for n in names} <= keys
            # The template went too, so that any node can materialize it: its stream named by the
            # hash of its bytes, which the snapshot's manifest names.
            stream = manifest["body"]["meta"]["template"]["stream"]["sha256"]
            key = next(k for k in s3.keys(f"{PREFIX}/templates/") if k.startswith(f"{PREFIX}/templates/base-")
                       and k.endswith(f"-{stream}.btrfs.zst"))
            assert hashlib.sha256(s3.read(key)).hexdigest() == stream
            assert not (s3_server.data_dir / "objects").exists()

            act(api, sid, "restore")
            assert state(api, sid) == "running"
            assert sh(api, sid, "sha256sum /home/user/blob").split()[0] == digest
            first = count(api, sid)
            assert first >= before, (first, before)  # from memory, not from zero
            wait_for(lambda: count(api, sid) > first, 30, "the restored counter to continue")
            cmds = api.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]
            assert any(c["id"] == cid and c["state"] == "running" for c in cmds), cmds
        finally:
            r = api.delete(f"/v1/sandboxes/{sid}")
            assert r.status_code == 202, r.text
            assert wait_operation(api, r.json()["operation"]["id"])["status"] == "succeeded"
        # Deleting the sandbox deletes its objects.
        assert s3.keys(f"{PREFIX}/tenants/default/sandboxes/{sid}/") == []
