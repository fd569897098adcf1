"""The files of E2B template COPY steps (space.e2b.template_files), through the real app, a real
store and a directory object store: the operator gets an upload URL that works without a key
(the SDK sends none) and only as signed: another hash, a changed signature, an expired URL or a
missing one are 403 before a byte is stored; the upload lands as the blob of its sha256 and the
hash then reads ``present``; a build's COPY names that blob, and a COPY whose files were never
uploaded is a 400 naming the step, with nothing queued; a damaged record is not trusted."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from space.api.app import create_app
from space.api.state import AppState
from space.cluster.pki import ClusterCA
from space.controller import Controller, NodeRegistry
from space.e2b import template_files
from space.node.templates.spec import blob_key
from space.objstore import ObjectStore
from space.store import Store

pytestmark = pytest.mark.anyio

FILES_HASH = "ab" * 32


def archive() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"hello from the build context\n"
        info = tarfile.TarInfo("folder/test.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue())


class Api:
    def __init__(self, http: httpx.AsyncClient, operator: str, tenant_admin: str, objects: ObjectStore) -> None:
        self.http, self.objects = http, objects
        self.operator = {"x-api-key": operator}
        self.tenant_admin = {"x-api-key": tenant_admin}


@pytest.fixture
async def api(store: Store, tmp_path: Path) -> AsyncIterator[Api]:
    nodes = NodeRegistry(store)
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    state = AppState(store=store, nodes=nodes, controller=Controller(store, nodes, objects=objects),
                     secret=b"k" * 32, cluster_ca=ClusterCA.create())
    _, operator = await store.create_api_key("default", "admin", "operator")
    _, tenant_admin = await store.create_api_key("acme", "admin", "acme admin")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)),
                                     base_url="http://api.test:8080") as c:
            yield Api(c, operator, tenant_admin, objects)
    finally:
        await state.audit.aclose()
        await nodes.aclose()


async def upload_url(api: Api, files_hash: str = FILES_HASH) -> tuple[bool, str]:
    r = await api.http.get(f"/templates/my-env/files/{files_hash}", headers=api.operator)
    assert r.status_code == 201, r.text  # as E2B answers it (the SDK reads only a 201)
    return r.json()["present"], r.json()["url"]


async def test_upload_with_the_signed_url_then_present(api: Api) -> None:
    present, url = await upload_url(api)
    assert not present
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == ("http", "api.test:8080", f"/templates/files/{FILES_HASH}")
    body = archive()
    r = await api.http.put(url, content=body)  # no key: the URL is the authorization
    assert r.status_code == 200, r.text
    sha = hashlib.sha256(body).hexdigest()
    assert await api.objects.get_bytes(blob_key(sha)) == body
    assert await template_files.archive_of(api.objects, FILES_HASH, 1) == sha
    assert (await upload_url(api))[0] is True
    # Another body to the same hash (a leaked URL, or the SDK forcing the upload again): the files a
    # build of that hash copies stay the first ones.
    r = await api.http.put(url, content=b"something else")
    assert r.status_code == 200
    assert await template_files.archive_of(api.objects, FILES_HASH, 1) == sha


async def test_only_the_signed_url_uploads(api: Api) -> None:
    _, url = await upload_url(api)
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    other = "cd" * 32
    expired = int(time.time()) - 1
    attempts = [
        f"/templates/files/{FILES_HASH}",  # no signature
        f"/templates/files/{other}?{parts.query}",  # signed for another hash
        f"/templates/files/{FILES_HASH}?expires={query['expires']}&signature={query['signature'][:-2]}AA",
        f"/templates/files/{FILES_HASH}?expires={int(query['expires']) + 1}&signature={query['signature']}",
        f"/templates/files/{FILES_HASH}?expires={expired}"
        f"&signature={template_files._signature(b'k' * 32, FILES_HASH, expired)}",  # signed, but expired
    ]
    for path in attempts:
        r = await api.http.put(path, content=archive())
        assert r.status_code == 403, (path, r.text)
    assert await api.objects.list("") == []
    r = await api.http.get(f"/templates/my-env/files/{FILES_HASH}", headers=api.tenant_admin)
    assert r.status_code == 403
    r = await api.http.get("/templates/my-env/files/not-a-hash", headers=api.operator)
    assert r.status_code == 400


async def test_a_build_copies_the_uploaded_blob(api: Api, store: Store) -> None:
    steps = [{"type": "WORKDIR", "args": ["/app"]}, {"type": "USER", "args": ["user"]},
             {"type": "COPY", "args": ["folder/*", "folder", "", "0755"], "filesHash": FILES_HASH},
             {"type": "RUN", "args": ["cat folder/test.txt"]}]
    build = {"fromTemplate": "base", "steps": steps}
    r = await api.http.post("/v2/templates/my-env/builds/bld-1", json=build, headers=api.operator)
    assert r.status_code == 400 and "step 3" in r.text and "not uploaded" in r.text, r.text
    assert await store.find_operations(kind="template.build") == []

    _, url = await upload_url(api)
    body = archive()
    assert (await api.http.put(url, content=body)).status_code == 200
    # The base template is unknown to this store: resolving it fails after the COPY was found,
    # which is all this test needs of the build (the node's part is tests/e2e).
    from space.e2b.templates import BuildStart, spec_of

    spec = spec_of(BuildStart.model_validate(build), {FILES_HASH: hashlib.sha256(body).hexdigest()})
    copy = spec["run"][0]
    assert copy == {"archive": hashlib.sha256(body).hexdigest(), "src": "folder/*", "dest": "folder",
                    "owner": "", "mode": "0755", "workdir": "/app", "user": "user"}


async def test_a_damaged_record_is_refused(api: Api) -> None:
    await api.objects.put_bytes(f"e2b-files/{FILES_HASH}", b'{"sha256": "../../etc/passwd"}')
    with pytest.raises(Exception, match="damaged"):
        await template_files.archive_of(api.objects, FILES_HASH, 2)
    await api.objects.put_bytes(f"e2b-files/{FILES_HASH}", b"x" * 5000)
    with pytest.raises(Exception, match="damaged"):
        await template_files.archive_of(api.objects, FILES_HASH, 2)


async def test_a_started_build_is_building_until_it_ends(api: Api, store: Store) -> None:
    """E2B's ``waiting`` is a build named but not started: one started (its operation queued, not yet
    picked up) is ``building`` (E2B's own test of ``build_in_background`` asks right away)."""
    from space import ids
    from space.store import Operation

    op = Operation(id=ids.operation_id(), tenant="default", kind="template.build", target="my-env",
                   status="pending", request={"spec": {}, "e2b_build": "bld-1"})
    await store.create_operation(op)
    r = await api.http.get("/templates/my-env/builds/bld-1/status", headers=api.operator)
    assert r.status_code == 200 and r.json()["status"] == "building", r.text
    r = await api.http.get("/templates/my-env/builds/bld-2/status", headers=api.operator)
    assert r.status_code == 404


async def test_spaces_own_blob_upload_checks_the_name(api: Api) -> None:
    """``PUT /v1/templates/blobs/{sha256}`` spools the same way: stored only under its own sha256."""
    bearer = {"authorization": f"Bearer {api.operator['x-api-key']}"}
    body = b"a template file\n"
    good, bad = hashlib.sha256(body).hexdigest(), "0" * 64
    r = await api.http.put(f"/v1/templates/blobs/{bad}", content=body, headers=bearer)
    assert r.status_code == 400 and good in r.text, r.text
    assert await api.objects.list("") == []
    r = await api.http.put(f"/v1/templates/blobs/{good}", content=body, headers=bearer)
    assert r.status_code == 200 and r.json() == {"sha256": good, "size_bytes": len(body), "stored": True}, r.text
    assert await api.objects.get_bytes(blob_key(good)) == body
