"""The privilege split of ``space serve``: the API and the controller run as the service user, the
node agent (and its supervisor) as root, and the platform works end to end across that line."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import httpx
import pytest

from space.node.main import channel_dir_for
from space.privdrop import acl_groups
from tests.e2e.harness import Server, create_sandbox, node_agent_pid, run, wait_for, wait_operation

pytestmark = pytest.mark.runtime


def _status(pid: int) -> dict[str, list[int]]:
    """``Uid``, ``Gid`` (real, effective, saved, fs), ``Groups`` and ``PPid`` of a process."""
    out: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups", "PPid", "NoNewPrivs"):
            out[key] = [int(v) for v in value.split()]
        elif key in ("CapPrm", "CapEff"):
            out[key] = [int(value.strip(), 16)]
    return out




@pytest.fixture(scope="module")
def user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(os.environ.get("SPACE_USER", "space"))
    except KeyError:
        pytest.fail("the service user is missing: scripts/setup-system.sh creates it")


def test_the_api_runs_as_the_service_user_and_cannot_get_root_back(server: Server,
                                                                   user: pwd.struct_passwd) -> None:
    assert server.proc is not None
    api = _status(server.proc.pid)
    assert api["Uid"] == [user.pw_uid] * 4 and api["Gid"] == [user.pw_gid] * 4
    assert 0 not in api["Groups"] and set(api["Groups"]) <= {user.pw_gid}
    assert api["CapPrm"] == [0] and api["CapEff"] == [0] and api["NoNewPrivs"] == [1]


def test_the_node_agent_and_its_supervisor_run_as_root(server: Server) -> None:
    assert server.proc is not None
    node = _status(node_agent_pid(server))
    assert node["Uid"] == [0] * 4 and node["Gid"] == [0] * 4
    supervisor = node["PPid"][0]
    assert _status(supervisor)["Uid"] == [0] * 4
    assert _status(supervisor)["PPid"] == [server.proc.pid]


def test_what_the_api_writes_is_the_users_and_nothing_more(server: Server, user: pwd.struct_passwd) -> None:
    data = server.data_dir
    st = data.stat()
    # The node's state is root's: the user may pass through the data dir, not create anything in it.
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, user.pw_gid, 0o710)
    ctl = (data / "control").stat()
    assert (ctl.st_uid, stat.S_IMODE(ctl.st_mode)) == (user.pw_uid, 0o700)
    assert (data / "control" / "space.db").stat().st_uid == user.pw_uid
    for name in ("admin.key", "secret.key", "master.key"):
        f = (data / name).stat()
        assert (f.st_uid, stat.S_IMODE(f.st_mode)) == (user.pw_uid, 0o600), name
    token = (data / "node.token").stat()
    assert (token.st_uid, stat.S_IMODE(token.st_mode)) == (0, 0o600)
    for p in ("pool.img", "runsc"):
        assert (data / p).stat().st_uid == 0
    # The node socket's directory admits the user's group; the other sockets there are root's alone.
    chan = channel_dir_for(data)
    cs = chan.stat()
    assert (cs.st_uid, cs.st_gid, stat.S_IMODE(cs.st_mode)) == (0, user.pw_gid, 0o710)
    for sock in chan.iterdir():
        if sock.name != "node.sock":
            assert sock.stat().st_uid == 0 and stat.S_IMODE(sock.stat().st_mode) & 0o077 == 0, sock
    objects = data / "objects"
    assert acl_groups(objects) == {user.pw_gid: 7} and acl_groups(objects, default=True) == {user.pw_gid: 7}


def test_the_api_works_end_to_end(api: httpx.Client, server: Server) -> None:
    sid = create_sandbox(api)
    try:
        assert run(api, sid, {"shell": "echo across the line"})[:2] == (0, b"across the line\n")
        r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/f.txt"}, content=b"across")
        assert r.status_code in (200, 201), r.text
        assert api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/f.txt"}).content == b"across"
        # Suspend: the node agent (root) writes the snapshot into the object store ...
        r = api.post(f"/v1/sandboxes/{sid}/suspend")
        assert r.status_code == 202, r.text
        assert wait_operation(api, r.json()["operation"]["id"], timeout=300)["status"] == "succeeded"
        shipped = server.data_dir / "objects" / "tenants" / "default" / "sandboxes" / sid
        files = [p for p in shipped.rglob("*") if p.is_file()]
        assert files and all(p.stat().st_uid == 0 for p in files)
    finally:
        d = api.delete(f"/v1/sandboxes/{sid}")
    assert d.status_code == 202, d.text
    assert wait_operation(api, d.json()["operation"]["id"])["status"] == "succeeded"
    # ... and the API (the service user) deletes it with the sandbox.
    wait_for(lambda: not shipped.exists(), 60, "the suspended sandbox's objects to be deleted")
