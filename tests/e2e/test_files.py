"""Files through the public API: streamed round trip, listing, stat/mkdir/move/remove, path escapes,
symlinks that point outside, and the upload limit."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import create_sandbox, run

pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def sandbox(api: httpx.Client) -> Iterator[str]:
    sid = create_sandbox(api)
    yield sid
    api.delete(f"/v1/sandboxes/{sid}")


def test_streamed_round_trip(api: httpx.Client, sandbox: str) -> None:
    blob = os.urandom(20 * 1024 * 1024 + 123)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(blob), 1 << 20):
            yield blob[i : i + (1 << 20)]

    r = api.put(f"/v1/sandboxes/{sandbox}/files", params={"path": "/home/user/big.bin"}, content=chunks())
    assert r.status_code == 200, r.text
    assert r.json()["size"] == len(blob) and r.json()["type"] == "file"
    with api.stream("GET", f"/v1/sandboxes/{sandbox}/files", params={"path": "/home/user/big.bin"}) as resp:
        assert resp.status_code == 200
        h = hashlib.sha256()
        for part in resp.iter_bytes():
            h.update(part)
    assert h.hexdigest() == hashlib.sha256(blob).hexdigest()
    _, out, _ = run(api, sandbox, {"shell": "sha256sum /home/user/big.bin | cut -d' ' -f1"})
    assert out.decode().strip() == hashlib.sha256(blob).hexdigest()


def test_list_stat_mkdir_move_remove(api: httpx.Client, sandbox: str) -> None:
    base = f"/v1/sandboxes/{sandbox}/files"
    assert api.post(f"{base}/mkdir", json={"path": "/home/user/proj/src"}).status_code == 200
    api.put(base, params={"path": "/home/user/proj/src/a.txt"}, content=b"alpha")
    listed = api.get(f"{base}/list", params={"path": "/home/user/proj", "depth": 2}).json()["entries"]
    names = {e["name"]: e for e in listed}
    assert names["src"]["type"] == "dir" and names["a.txt"]["size"] == 5
    st = api.get(f"{base}/stat", params={"path": "/home/user/proj/src/a.txt"}).json()
    assert st["type"] == "file" and st["owner"] == "user"
    mv = api.post(f"{base}/move", json={"src": "/home/user/proj/src/a.txt", "dst": "/home/user/proj/b.txt"})
    assert mv.status_code == 200 and mv.json()["name"] == "b.txt"
    assert api.get(base, params={"path": "/home/user/proj/b.txt"}).content == b"alpha"
    assert api.delete(base, params={"path": "/home/user/proj"}).status_code == 409
    assert api.delete(base, params={"path": "/home/user/proj", "recursive": "true"}).status_code == 204
    r = api.get(f"{base}/stat", params={"path": "/home/user/proj"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("path", ["/../etc/passwd", "/home/user/../../../etc/shadow", "relative/path", "/a/\x00b"])
def test_paths_that_escape_are_400(api: httpx.Client, sandbox: str, path: str) -> None:
    for r in (
        api.get(f"/v1/sandboxes/{sandbox}/files", params={"path": path}),
        api.put(f"/v1/sandboxes/{sandbox}/files", params={"path": path}, content=b"x"),
        api.get(f"/v1/sandboxes/{sandbox}/files/list", params={"path": path}),
    ):
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_path"


def test_symlinks_resolve_inside_the_sandbox(api: httpx.Client, sandbox: str, tmp_path: Path) -> None:
    """A link to an absolute or climbing path names the sandbox's file, never the host's."""
    marker = tmp_path / "host-secret.txt"
    marker.write_text("host only")
    run(api, sandbox, {"shell": f"ln -sf {marker} /home/user/l1; ln -sf ../../../../../..{marker} /home/user/l2"})
    for link in ("/home/user/l1", "/home/user/l2"):
        r = api.get(f"/v1/sandboxes/{sandbox}/files", params={"path": link})
        assert r.status_code == 404, r.text
        w = api.put(f"/v1/sandboxes/{sandbox}/files", params={"path": link}, content=b"overwrite")
        assert w.status_code in (200, 400, 404)
    assert marker.read_text() == "host only"


def test_upload_limit_is_413_and_writes_nothing(api: httpx.Client, sandbox: str) -> None:
    too_big = 64 * 1024 * 1024 + 1  # the test server runs with --max-upload-mb 64
    r = api.put(f"/v1/sandboxes/{sandbox}/files", params={"path": "/home/user/huge.bin"},
                content=b"\0" * too_big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"

    def stream() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while streaming
        for _ in range(65):
            yield b"\0" * (1 << 20)

    r = api.put(f"/v1/sandboxes/{sandbox}/files", params={"path": "/home/user/huge2.bin"}, content=stream())
    assert r.status_code == 413
    _, out, _ = run(api, sandbox, {"shell": "ls -a /home/user"})
    assert b"huge" not in out and b".space-tmp" not in out
