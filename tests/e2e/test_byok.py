"""Bring your own key, end to end: a ``space serve`` whose object store is a bucket on moto's S3 and
whose tenants' keys live in moto's KMS (its server mode, on loopback).

- What a suspend stores is sealed: every artifact is encrypted frames, the manifest's private part
  is too, and a marker the sandbox wrote to a file, held in a process's memory and carried in its
  environment appears in none of the bucket's bytes. The restore brings files and processes back.
- A tenant's AWS KMS key disabled: the restore fails at once with ``key_unavailable``, the
  sandbox stays suspended, an event names the key; enabled again, the same restore works.
- Rotating a tenant's key re-wraps what it stored before (the manifests name the new key; the
  artifacts are untouched) and every old snapshot stays readable, a retained one's fork included.
- A lost node's sandbox comes back on another node from its backup chain, sealed under AWS KMS.
- Deleting a sandbox destroys its shred secret: a copy of its objects does not open with the
  deployment's key file and any secret the database still holds.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import os
import secrets
import shutil
import signal
import sqlite3
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from moto.server import ThreadedMotoServer

from space import objcrypt
from space.errors import KeyUnavailable, ObjectTampered
from space.kms import LOCAL, DataKeys, KeyRef, LocalKeyring
from space.node.storage.artifacts import Manifest, SealingSpec, download_snapshot
from space.objauth import ManifestKeys
from space.objstore import ObjectStore
from tests.e2e.harness import (
    NodeAgent,
    Server,
    create_sandbox,
    loop_devices,
    node_processes,
    node_scratch,
    own_server,
    wait_operation,
)
from tests.e2e.test_lifecycle import act, sh, state
from tests.e2e.test_s3 import CREDENTIALS, PREFIX, S3
from tests.e2e.test_sdk_cli import cli
from tests.e2e.test_snapshots_retained import take
from tests.waiting import wait_for

pytestmark = pytest.mark.runtime

class Moto(S3):
    """The bucket (read with a plain S3 client, independently of SPACE's code) and the KMS, driven
    with AWS's own client."""

    @property
    def kms(self) -> Any:
        return boto3.client("kms", endpoint_url=self.endpoint, region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def new_key(self) -> str:
        return str(self.kms.create_key(Description="a SPACE tenant's key")["KeyMetadata"]["Arn"])


@pytest.fixture(scope="module")
def moto() -> Iterator[Moto]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        bucket = f"space-{uuid.uuid4().hex[:12]}"
        httpx.put(f"{endpoint}/{bucket}", timeout=10).raise_for_status()
        yield Moto(endpoint, bucket)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def srv(moto: Moto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    url = f"s3://{moto.bucket}/{PREFIX}?endpoint={moto.endpoint}"
    with own_server(tmp_path_factory.mktemp("byok"), "--object-store-url", url, "--warm-pool", "0",
                    env={**CREDENTIALS, "SPACE_KMS_ENDPOINT": moto.endpoint}) as server:
        yield server


def _tenant(api: httpx.Client, admin: httpx.Client, srv: Server) -> tuple[str, httpx.Client]:
    """A tenant of its own (its key settings touch no other test) and a client with its admin key."""
    name = f"byok-{secrets.token_hex(3)}"
    r = admin.post("/v1/apikeys", json={"tenant": name, "role": "admin", "name": "byok"})
    assert r.status_code == 201, r.text
    return name, srv.client(key=r.json()["key"])


def _set_key(api: httpx.Client, tenant: str, provider: str | None, key_id: str | None) -> dict[str, Any]:
    r = api.put(f"/v1/tenants/{tenant}/key", json={"provider": provider, "key_id": key_id})
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "succeeded", op
    return dict(op)


def _delete(api: httpx.Client, sid: str) -> None:
    r = api.delete(f"/v1/sandboxes/{sid}")
    if r.status_code == 202:
        wait_operation(api, r.json()["operation"]["id"])


def _snapshot_prefix(tenant: str, sid: str, snap_id: str) -> str:
    return f"{PREFIX}/tenants/{tenant}/sandboxes/{sid}/snapshots/{snap_id}/"


def test_a_suspended_sandbox_is_sealed_in_the_bucket_and_comes_back(moto: Moto, srv: Server) -> None:
    marker = "SPACE-BYOK-" + secrets.token_hex(16)
    with srv.client() as admin:
        tenant, api = _tenant(admin, admin, srv)
        with api:
            sid = create_sandbox(api, env={"BYOK_MARKER": marker})
            try:
                sh(api, sid, f"printf '%s\\n' {marker} > /home/user/marker.txt")
                # The marker in a process's memory only (built at run time: not in its command line).
                r = api.post(f"/v1/sandboxes/{sid}/commands", json={"shell": (
                    "python3 -c \"import os,time; m=os.environ['BYOK_MARKER']; held=[m * 4096]; "
                    "print('holding', flush=True); time.sleep(100000)\"")})
                assert r.status_code == 201, r.text
                holder = r.json()["id"]
                act(api, sid, "suspend")
                snap_id = api.get(f"/v1/sandboxes/{sid}").json()["snapshot_id"]
                where = _snapshot_prefix(tenant, sid, snap_id)
                keys = moto.keys(where)
                manifest = json.loads(moto.read(where + "manifest.json"))
                assert manifest["kind"] == "snapshot-encrypted", manifest["kind"]
                enc = manifest["body"]["encryption"]
                assert enc["key"]["provider"] == LOCAL and enc["key"]["key_id"] == tenant, enc
                assert set(manifest["body"]["meta"]["private"]) == {"sealed"}, "the environment is sealed"
                artifacts = [k for k in keys if not k.endswith("/manifest.json")]
                assert any("/checkpoint/" in k for k in artifacts) and artifacts, keys
                for key in artifacts:
                    assert moto.read(key)[:len(objcrypt.MAGIC)] == objcrypt.MAGIC, key
                # Nothing the sandbox held is readable in what was stored, anywhere under the tenant.
                needle = marker.encode()
                for key in moto.keys(f"{PREFIX}/tenants/{tenant}/"):
                    assert needle not in moto.read(key), key

                act(api, sid, "restore")
                assert state(api, sid) == "running"
                assert sh(api, sid, "cat /home/user/marker.txt").strip() == marker
                assert sh(api, sid, "printenv BYOK_MARKER").strip() == marker
                cmds = api.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]
                assert any(c["id"] == holder and c["state"] == "running" for c in cmds), cmds
            finally:
                _delete(api, sid)


def test_a_disabled_kms_key_refuses_the_restore_and_an_enabled_one_restores(moto: Moto, srv: Server) -> None:
    with srv.client() as admin:
        tenant, api = _tenant(admin, admin, srv)
        arn = moto.new_key()
        with api:
            view = _set_key(api, tenant, "aws-kms", arn)
            assert view["result"]["total"] == 0
            assert api.get(f"/v1/tenants/{tenant}/key").json()["key_id"] == arn
            sid = create_sandbox(api)
            key_id = arn.rsplit("/", 1)[-1]  # moto disables by id, not by ARN
            try:
                sh(api, sid, "echo kept > /home/user/kept.txt")
                # A suspend under a refused key fails, and the sandbox runs on as it was.
                moto.kms.disable_key(KeyId=key_id)
                r = api.post(f"/v1/sandboxes/{sid}/suspend")
                assert r.status_code == 202, r.text
                op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
                assert op["status"] == "failed" and op["error"]["code"] == "key_unavailable", op
                assert state(api, sid) == "running"
                assert sh(api, sid, "cat /home/user/kept.txt").strip() == "kept"
                moto.kms.enable_key(KeyId=key_id)
                act(api, sid, "suspend")
                snap_id = api.get(f"/v1/sandboxes/{sid}").json()["snapshot_id"]
                manifest = json.loads(moto.read(_snapshot_prefix(tenant, sid, snap_id) + "manifest.json"))
                assert manifest["body"]["encryption"]["key"] == {"provider": "aws-kms", "key_id": arn,
                                                                "wrapped": manifest["body"]["encryption"]["key"]
                                                                ["wrapped"]}

                moto.kms.disable_key(KeyId=arn.rsplit("/", 1)[-1])  # moto: the id, not the ARN
                r = api.post(f"/v1/sandboxes/{sid}/restore")
                assert r.status_code == 202, r.text
                op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
                assert op["status"] == "failed" and op["error"]["code"] == "key_unavailable", op
                assert arn in op["error"]["message"]
                sb = api.get(f"/v1/sandboxes/{sid}").json()
                assert sb["state"] == "suspended" and sb["node_id"] is None, sb
                events = api.get(f"/v1/sandboxes/{sid}/events").json()["events"]
                refused = [e for e in events if e["kind"] == "key_unavailable"]
                assert refused and refused[-1]["data"]["key"] == arn, events

                moto.kms.enable_key(KeyId=arn.rsplit("/", 1)[-1])
                act(api, sid, "restore")
                assert state(api, sid) == "running"
                assert sh(api, sid, "cat /home/user/kept.txt").strip() == "kept"
            finally:
                _delete(api, sid)


def test_a_rotation_rewraps_what_was_stored_and_every_old_snapshot_stays_readable(moto: Moto, srv: Server) -> None:
    with srv.client() as admin:
        tenant, api = _tenant(admin, admin, srv)
        with api:
            sid = create_sandbox(api)
            fork = None
            try:
                sh(api, sid, "echo retained > /home/user/r.txt")
                retained = take(api, sid, kind="disk", retain=True)["id"]
                sh(api, sid, "echo suspended > /home/user/s.txt")
                act(api, sid, "suspend")
                suspended = api.get(f"/v1/sandboxes/{sid}").json()["snapshot_id"]
                manifests = [f"{PREFIX}/tenants/{tenant}/snapshots/{retained}/manifest.json",
                             _snapshot_prefix(tenant, sid, suspended) + "manifest.json"]
                before = {m: moto.read(m) for m in manifests}
                artifacts = {k: moto.read(k) for m in manifests for k in moto.keys(m.rsplit("/", 1)[0] + "/")
                             if not k.endswith("manifest.json")}
                for m in manifests:
                    assert json.loads(before[m])["body"]["encryption"]["key"]["provider"] == LOCAL

                arn = moto.new_key()
                op = _set_key(api, tenant, "aws-kms", arn)
                assert op["result"]["total"] >= 2 and op["result"]["rewrapped"] >= 2, op
                assert op["progress"]["done"] == op["progress"]["total"], op
                for m in manifests:
                    assert json.loads(moto.read(m))["body"]["encryption"]["key"]["key_id"] == arn, m
                # Nothing was re-encrypted: the artifacts are the same bytes.
                assert {k: moto.read(k) for k in artifacts} == artifacts
                # Again: nothing left to re-wrap.
                assert _set_key(api, tenant, "aws-kms", arn)["result"]["rewrapped"] == 0

                # Both old snapshots open under the new key: the suspended one restores, the
                # retained one forks.
                act(api, sid, "restore")
                assert sh(api, sid, "cat /home/user/s.txt").strip() == "suspended"
                fork = create_sandbox(api, snapshot=retained)
                assert sh(api, fork, "cat /home/user/r.txt").strip() == "retained"
            finally:
                for s in (fork, sid):
                    if s is not None:
                        _delete(api, s)


def test_deleting_a_sandbox_destroys_its_keys(moto: Moto, srv: Server) -> None:
    with srv.client() as admin:
        tenant, api = _tenant(admin, admin, srv)
        with api:
            sid = create_sandbox(api)
            deleted = False
            try:
                sh(api, sid, "echo gone > /home/user/g.txt")
                act(api, sid, "suspend", {"memory": False})
                snap_id = api.get(f"/v1/sandboxes/{sid}").json()["snapshot_id"]
                where = _snapshot_prefix(tenant, sid, snap_id)
                # A copy of the bucket, taken while the sandbox lived.
                copy = {k[len(PREFIX) + 1:]: moto.read(k) for k in moto.keys(where)}
                _delete(api, sid)
                deleted = True
                assert moto.keys(where) == []
            finally:
                if not deleted:
                    _delete(api, sid)
    # Everything the deployment still holds: its key-encryption root, its manifest key, and every
    # shred secret in its database. None of them opens the copy.
    db = sqlite3.connect(srv.data_dir / "control" / "space.db")
    try:
        row = db.execute("SELECT shred FROM sandboxes WHERE id = ?", (sid,)).fetchone()
        held = [base64.b64decode(s) for (s,) in db.execute(
            "SELECT shred FROM sandboxes WHERE shred IS NOT NULL AND shred != '' "
            "UNION SELECT shred FROM snapshots WHERE shred IS NOT NULL AND shred != ''")]
    finally:
        db.close()
    assert row == ("",), row

    async def attempt() -> list[str]:
        with tempfile.TemporaryDirectory() as d:
            store = ObjectStore.from_url(f"file://{d}/objects")
            for key, data in copy.items():
                await store.put_bytes(key, data)
            keys = ManifestKeys.require(env={}, key_file=srv.data_dir / "manifest.key")
            data_keys = DataKeys({LOCAL: LocalKeyring.from_file(srv.data_dir / "kek.key")})
            prefix = where[len(PREFIX) + 1:].rstrip("/")
            binding = {"tenant": tenant, "sandbox_id": sid, "snapshot_id": snap_id, "prefix": prefix}
            manifest = Manifest.open(copy[prefix + "/manifest.json"], keys=keys, prefix=prefix, binding=binding)
            assert manifest.wrapped_key is not None
            outcomes = []
            for shred in [*held, bytes(32)]:
                sealing = SealingSpec(KeyRef(LOCAL, tenant), shred).bind(data_keys)
                try:
                    await download_snapshot(store, prefix, Path(d) / "out", keys=keys, binding=binding,
                                            manifest=manifest, sealing=sealing)
                    outcomes.append("opened")
                except (ObjectTampered, KeyUnavailable) as exc:
                    outcomes.append(type(exc).__name__)
            return outcomes

    outcomes = asyncio.run(attempt())
    assert outcomes and "opened" not in outcomes, outcomes


def test_a_tenant_key_is_checked_set_by_its_admin_only_and_audited(srv: Server) -> None:
    with srv.client() as admin:
        tenant, api = _tenant(admin, admin, srv)
        r = admin.post("/v1/apikeys", json={"tenant": tenant, "role": "member", "name": "member"})
        assert r.status_code == 201, r.text
        with srv.client(key=r.json()["key"]) as member, api:
            r = member.put(f"/v1/tenants/{tenant}/key", json={"provider": "local", "key_id": "x"})
            assert r.status_code == 403, r.text
            r = api.put(f"/v1/tenants/{tenant}/key", json={"provider": "aws-kms"})
            assert r.status_code == 400 and r.json()["error"]["field"] == "key_id", r.text
            r = api.put(f"/v1/tenants/{tenant}/key", json={"provider": "vault", "key_id": "k"})
            assert r.status_code in (400, 422), r.text
            # A key its KMS does not know is refused before it is stored.
            unknown = "arn:aws:kms:us-east-1:123456789012:key/00000000-0000-0000-0000-000000000000"
            r = api.put(f"/v1/tenants/{tenant}/key", json={"provider": "aws-kms", "key_id": unknown})
            assert r.status_code == 409 and r.json()["error"]["code"] == "key_unavailable", r.text
            assert api.get(f"/v1/tenants/{tenant}/key").json()["source"] == "default"
            _set_key(api, tenant, None, None)
            view = api.get(f"/v1/tenants/{tenant}/key").json()
            assert view == {"tenant": tenant, "provider": "local", "key_id": tenant, "source": "default",
                            "encryption": True}
            def audited() -> list[Any]:
                records = admin.get("/v1/audit", params={"tenant": tenant, "action": "key.set"}).json()["records"]
                return [a for a in records if a["action"] == "key.set" and a["status"] == 202]
            # The refused attempt is audited too; the accepted one once per setting.
            assert len(wait_for(audited, 30, "the key's change in the audit log")) == 1


def test_a_lost_nodes_sandbox_comes_back_from_its_backup_sealed_under_aws_kms(
        moto: Moto, srv: Server, tmp_path: Path) -> None:
    """Backup recovery, encrypted: the sandbox's backup links are sealed under its tenant's AWS KMS
    key on the node it runs on; that node is killed, and another node opens the chain under the
    same key (its own credentials for it) and runs the sandbox from it."""
    with srv.client() as admin:
        tenant, api = _tenant(admin, admin, srv)
        arn = moto.new_key()
        scratch = node_scratch("byok-b-")
        node = NodeAgent(node_id="byok-b", data_dir=scratch / "data", cache_dir=scratch / "cache",
                         log_path=tmp_path / "byok-b.log",
                         object_store_url=f"s3://{moto.bucket}/{PREFIX}?endpoint={moto.endpoint}",
                         env={**CREDENTIALS, "SPACE_KMS_ENDPOINT": moto.endpoint, "SPACE_FENCE_AFTER": "6"})
        sid = None
        with api:
            try:
                _set_key(api, tenant, "aws-kms", arn)
                node.start(srv)
                sid = create_sandbox(api, snapshot_policy={"backup_every": 1, "disk_every": None, "full_every": None})
                act(api, sid, "suspend")
                # Restored onto the further node: the only one not cordoned (placing is the operator's).
                others = [n["id"] for n in admin.get("/v1/nodes").json()["nodes"] if n["id"] != node.node_id]
                for other in others:
                    assert admin.post(f"/v1/nodes/{other}/cordon").status_code == 200
                try:
                    act(api, sid, "restore")
                finally:
                    for other in others:
                        admin.post(f"/v1/nodes/{other}/uncordon")
                assert api.get(f"/v1/sandboxes/{sid}").json()["node_id"] == node.node_id
                digest = sh(api, sid, "head -c 300000 /dev/urandom > /home/user/b.bin && sync && "
                                      "sha256sum /home/user/b.bin").split()[0]
                written = dt.datetime.now(dt.UTC)

                def durable() -> dict[str, Any] | None:
                    b = api.get(f"/v1/sandboxes/{sid}").json().get("backup") or {}
                    return b if b.get("disk_at") and dt.datetime.fromisoformat(b["disk_at"]) > written else None
                backup = wait_for(durable, 90, "the write to be backed up")
                link = f"{PREFIX}/tenants/{tenant}/sandboxes/{sid}/backup/{backup['chain']}/000000/manifest.json"
                sealed = json.loads(moto.read(link))
                assert sealed["kind"] == "snapshot-encrypted"
                assert sealed["body"]["encryption"]["key"]["key_id"] == arn, sealed["body"]["encryption"]

                for pid in node_processes(node.data_dir):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                assert node.proc is not None
                node.proc.wait(timeout=30)

                def elsewhere() -> bool:
                    sb = api.get(f"/v1/sandboxes/{sid}").json()
                    return bool(sb["state"] == "running" and sb["node_id"] not in (None, node.node_id))
                wait_for(elsewhere, 180, "the sandbox to run on another node")
                assert sh(api, sid, "sha256sum /home/user/b.bin").split()[0] == digest
                relocated = [e for e in api.get(f"/v1/sandboxes/{sid}/events").json()["events"]
                             if e["kind"] == "relocated"]
                assert relocated and "disk backup" in relocated[-1]["message"], relocated
            finally:
                if sid is not None:
                    _delete(api, sid)
                node.teardown()
        assert loop_devices(node.data_dir / "pool.img") == ""
        shutil.rmtree(scratch, ignore_errors=True)



def test_the_cli_shows_and_sets_a_tenants_key_with_the_rewraps_progress(moto: Moto, srv: Server) -> None:
    with srv.client() as admin:
        tenant, api = _tenant(admin, admin, srv)
        api.close()
        arn = moto.new_key()
        shown = cli(srv, "tenant", "key", "show", "--tenant", tenant, "--json")
        assert json.loads(shown.stdout)["source"] == "default"
        done = cli(srv, "tenant", "key", "set", "--tenant", tenant, "--kms", "aws", "--key-id", arn)
        assert "re-wrapped 0 of 0" in done.stderr.decode(), done.stderr
        assert f"aws-kms {arn}" in cli(srv, "tenant", "key", "show", "--tenant", tenant).stdout.decode()
        refused = cli(srv, "tenant", "key", "set", "--tenant", tenant, "--kms", "aws", check=False)
        assert refused.returncode != 0 and "--key-id" in refused.stderr.decode()
        cli(srv, "tenant", "key", "set", "--tenant", tenant, "--kms", "default")
        assert json.loads(cli(srv, "tenant", "key", "show", "--tenant", tenant, "--json").stdout)["key_id"] == tenant
