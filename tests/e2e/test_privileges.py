"""The privilege split of ``space serve``: the API and the controller run as the service user, the
node agent as the node user, only its supervisor and its root helper as root, and the platform
works end to end across those lines."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import httpx
import pytest

from space.node.main import channel_dir_for
from space.serve_state import acl_groups
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


@pytest.fixture(scope="module")
def node_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(os.environ.get("SPACE_NODE_USER", "space-node"))
    except KeyError:
        pytest.fail("the node user is missing: scripts/setup-system.sh creates it")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_the_node_agent_runs_as_the_node_user_and_only_its_helper_as_root(
        server: Server, user: pwd.struct_passwd, node_user: pwd.struct_passwd) -> None:
    assert server.proc is not None
    agent_pid = node_agent_pid(server)
    agent = _status(agent_pid)
    assert agent["Uid"] == [node_user.pw_uid] * 4 and agent["Gid"] == [node_user.pw_gid] * 4
    # Its own group and the deployment's (to pass through the data dir and share the object store).
    assert set(agent["Groups"]) <= {node_user.pw_gid, user.pw_gid} and 0 not in agent["Groups"]
    assert agent["CapPrm"] == [0] and agent["CapEff"] == [0] and agent["NoNewPrivs"] == [1]
    helpers = [c for c in _children(agent_pid) if b"space.node.helper" in _cmdline(c)]
    assert len(helpers) == 1
    assert _status(helpers[0])["Uid"] == [0] * 4
    assert f"--agent-uid\x00{node_user.pw_uid}\x00".encode() in _cmdline(helpers[0])
    supervisor = agent["PPid"][0]
    assert _status(supervisor)["Uid"] == [0] * 4
    assert _status(supervisor)["PPid"] == [server.proc.pid]


def test_the_helper_answers_the_node_user_and_root_only(server: Server, node_user: pwd.struct_passwd) -> None:
    sock = channel_dir_for(server.data_dir) / "helper" / "helper.sock"
    probe = ("import socket,struct,json,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
             "b=json.dumps({'verb':'helper.ping','args':{},'timeout':5,'fds':[]}).encode(); "
             "s.sendall(struct.pack('>I',len(b))+b); print(len(s.recv(65536)))")
    import subprocess
    import sys
    # The API's user cannot even reach the socket (its directory is root:space-node 0750) ...
    api_user = pwd.getpwnam(os.environ.get("SPACE_USER", "space"))
    api = subprocess.run([sys.executable, "-c", probe, str(sock)], user=api_user.pw_uid, group=api_user.pw_gid,
                         extra_groups=[], capture_output=True, text=True, timeout=30)
    assert api.returncode != 0 and "PermissionError" in api.stderr, api
    # ... and the node user gets an answer.
    agent = subprocess.run([sys.executable, "-c", probe, str(sock)], user=node_user.pw_uid,
                           group=node_user.pw_gid, extra_groups=[], capture_output=True, text=True, timeout=30)
    assert agent.returncode == 0 and int(agent.stdout) > 4, agent


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
    assert (data / "pool.img").stat().st_uid == 0
    for p in ("runsc", "bundles", "runsc-build", "build-bundles"):  # the helper's, made at the first sandbox or build
        if (data / p).exists():
            st = (data / p).stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700), p
    # The node socket's directory is the agent's and admits the API's group; nothing else there
    # is open to that group or to anyone else.
    node_uid = pwd.getpwnam(os.environ.get("SPACE_NODE_USER", "space-node")).pw_uid
    chan = channel_dir_for(data)
    cs = chan.stat()
    assert (cs.st_uid, cs.st_gid, stat.S_IMODE(cs.st_mode)) == (node_uid, user.pw_gid, 0o710)
    for entry in chan.iterdir():
        if entry.name != "node.sock":
            st = entry.stat()
            assert st.st_uid in (0, node_uid) and stat.S_IMODE(st.st_mode) & 0o007 == 0, entry
            assert st.st_gid != user.pw_gid or stat.S_IMODE(st.st_mode) & 0o070 == 0, entry
    # The pool is the node's: the API's user cannot list a sandbox's files.
    pool = (data / "pool" / "sandboxes").stat()
    assert (pool.st_uid, stat.S_IMODE(pool.st_mode)) == (node_uid, 0o750) and pool.st_gid != user.pw_gid
    # Build work trees and receive staging: the helper's alone (the agent may look, not write).
    tmp = (data / "pool" / "tmp").stat()
    assert (tmp.st_uid, stat.S_IMODE(tmp.st_mode)) == (0, 0o750)
    objects = data / "objects"
    assert acl_groups(objects) == {user.pw_gid: 7} and acl_groups(objects, default=True) == {user.pw_gid: 7}


def test_the_api_works_end_to_end(api: httpx.Client, server: Server) -> None:
    sid = create_sandbox(api)
    try:
        assert run(api, sid, {"shell": "echo across the line"})[:2] == (0, b"across the line\n")
        r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/f.txt"}, content=b"across")
        assert r.status_code in (200, 201), r.text
        assert api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/f.txt"}).content == b"across"
        # Suspend: the node agent (the node user) writes the snapshot into the object store ...
        r = api.post(f"/v1/sandboxes/{sid}/suspend")
        assert r.status_code == 202, r.text
        assert wait_operation(api, r.json()["operation"]["id"], timeout=300)["status"] == "succeeded"
        shipped = server.data_dir / "objects" / "tenants" / "default" / "sandboxes" / sid
        files = [p for p in shipped.rglob("*") if p.is_file()]
        node_uid = pwd.getpwnam(os.environ.get("SPACE_NODE_USER", "space-node")).pw_uid
        assert files and all(p.stat().st_uid == node_uid for p in files)
    finally:
        d = api.delete(f"/v1/sandboxes/{sid}")
    assert d.status_code == 202, d.text
    assert wait_operation(api, d.json()["operation"]["id"])["status"] == "succeeded"
    # ... and the API (the service user) deletes it with the sandbox.
    wait_for(lambda: not shipped.exists(), 60, "the suspended sandbox's objects to be deleted")


def test_a_node_that_ran_as_root_hands_its_running_sandboxes_over(fresh_server: Server,
                                                                  node_user: pwd.struct_passwd) -> None:
    """An upgrade: the node agent ran as root (before the split); restarted, it drops to the node
    user and keeps serving the sandboxes that root started, their running commands included."""
    srv = fresh_server
    srv.env["SPACE_NODE_USER"] = "root"
    srv.start()
    with srv.client() as api:
        assert _status(node_agent_pid(srv))["Uid"] == [0] * 4
        sid = create_sandbox(api)
        assert run(api, sid, {"shell": "echo kept > /home/user/state.txt"})[0] == 0
        bg = api.post(f"/v1/sandboxes/{sid}/commands", json={"shell": "sleep 1000"}).json()["id"]
    srv.stop()
    del srv.env["SPACE_NODE_USER"]
    srv.start()
    with srv.client() as api:
        assert _status(node_agent_pid(srv))["Uid"] == [node_user.pw_uid] * 4
        assert run(api, sid, {"cmd": ["cat", "/home/user/state.txt"]})[:2] == (0, b"kept\n")
        cmds = {c["id"]: c for c in api.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]}
        assert cmds[bg]["state"] == "running"
        r = api.post(f"/v1/sandboxes/{sid}/snapshots", json={"kind": "full"})
        assert r.status_code == 202, r.text
        assert wait_operation(api, r.json()["operation"]["id"], timeout=300)["status"] == "succeeded"
        d = api.delete(f"/v1/sandboxes/{sid}")
        assert wait_operation(api, d.json()["operation"]["id"])["status"] == "succeeded"
