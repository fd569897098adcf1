"""The node boundary and the storage promise: the node API refuses callers without its token, and a
sandbox's root filesystem is a btrfs snapshot of its template's read-only subvolume, not a copy."""

from __future__ import annotations

import re
import subprocess

import httpx
import pytest

from space.node.main import channel_dir_for
from tests.e2e.harness import Server, create_sandbox

pytestmark = pytest.mark.runtime


def _node(server: Server, token: str | None) -> httpx.Client:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    transport = httpx.HTTPTransport(uds=str(channel_dir_for(server.data_dir) / "node.sock"))
    return httpx.Client(transport=transport, base_url="http://node", headers=headers)


def test_node_api_needs_its_token(server: Server) -> None:
    for token in (None, "wrong", server.admin_key):
        with _node(server, token) as node:
            r = node.get("/v1/sandboxes")
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    with _node(server, (server.data_dir / "node.token").read_text().strip()) as node:
        assert node.get("/v1/node").json()["id"] == "node-1"


def _subvolume(path: str) -> dict[str, str]:
    out = subprocess.run(["btrfs", "subvolume", "show", path], capture_output=True, text=True, check=True).stdout
    return {m.group(1).strip(): m.group(2).strip() for m in re.finditer(r"^\s*([^:\n]+):\s*(.*)$", out, re.M)}


def test_rootfs_is_a_snapshot_of_the_read_only_template(api: httpx.Client, server: Server) -> None:
    sid = create_sandbox(api)
    try:
        pool = server.data_dir / "pool"
        digest = api.get(f"/v1/sandboxes/{sid}").json()["template_digest"]
        template = pool / "templates" / f"base@{digest[:16]}"
        tinfo = _subvolume(str(template))
        rinfo = _subvolume(str(pool / "sandboxes" / sid / "rootfs"))
        assert "readonly" in tinfo.get("Flags", "")
        assert rinfo["Parent UUID"] == tinfo["UUID"]
        assert "readonly" not in rinfo.get("Flags", "")
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
