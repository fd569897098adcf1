"""Probes from inside a real sandbox of a real ``space serve``: what the root helper's side of the
boundary must hold against a hostile guest root.

- a setuid-root binary (and a device node) made inside gives no host privilege: the pool is mounted
  ``nosuid,nodev`` and a host user running the planted file stays who it is;
- ``/proc`` and the mount table inside show no host path, no host process and no host socket;
- the node agent's socket, the root helper's and the gateway's control socket are out of reach:
  not in the sandbox's filesystem, not under any abstract unix name, and nothing of SPACE's answers
  on any address the sandbox can try.

Every address tried is on this machine (loopback, the node's gateway address, the host's own
addresses); nothing is sent anywhere else.
"""

from __future__ import annotations

import json
import pwd
import shlex
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from space.node.main import channel_dir_for
from tests.e2e.harness import Server, create_sandbox, own_server, run, wait_operation

pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with own_server(tmp_path_factory.mktemp("probes")) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def sandbox(api: httpx.Client) -> Iterator[str]:
    sid = create_sandbox(api)
    yield sid
    api.delete(f"/v1/sandboxes/{sid}")


def as_root(api: httpx.Client, sid: str, script: str) -> tuple[int, str, str]:
    code, out, err = run(api, sid, {"shell": script, "user": "root"})
    return code, out.decode(errors="replace"), err.decode(errors="replace")


def python_in(api: httpx.Client, sid: str, code: str, *args: str) -> str:
    rc, out, err = as_root(api, sid, f"python3 -c {shlex.quote(code)} {' '.join(shlex.quote(a) for a in args)}")
    assert rc == 0, (rc, out, err)
    return out


def host_secrets(server: Server) -> list[str]:
    """Strings that name the host side: if a probe shows one, it saw the host."""
    return [str(server.data_dir), str(server.data_dir.parent), str(channel_dir_for(server.data_dir)),
            "/tmp/space-e2e", "space.node.helper", "space.gateway", "runsc", "node.sock", "helper.sock",
            "gateway.sock", str(Path(__file__).resolve().parents[2])]


def mount_options(path: Path) -> set[str]:
    found = [line.split()[5] for line in Path("/proc/self/mountinfo").read_text().splitlines()
             if line.split()[4] == str(path)]
    assert found, f"{path} is not a mount"
    return set(found[-1].split(","))


# -- setuid and device nodes ----------------------------------------------------------------------


@pytest.mark.probe("a setuid-root binary made inside the sandbox, run on the host by the node's user")
def test_a_setuid_binary_made_inside_gives_no_host_privilege(api: httpx.Client, server: Server,
                                                              sandbox: str) -> None:
    code, _, err = as_root(api, sandbox, "cp /usr/bin/id /usr/local/bin/suid-id && chown 0:0 /usr/local/bin/suid-id"
                                         " && chmod 4755 /usr/local/bin/suid-id")
    assert code == 0, err
    pool = server.data_dir / "pool"
    assert {"nosuid", "nodev"} <= mount_options(pool), mount_options(pool)
    # The running sandbox's gofer keeps the file it wrote open (exec: ETXTBSY): its disk snapshot
    # holds the same file as a new inode.
    r = api.post(f"/v1/sandboxes/{sandbox}/snapshots", json={"kind": "disk"})
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"])
    assert op["status"] == "succeeded", op
    planted = (pool / "sandboxes" / sandbox / "snapshots" / op["result"]["snapshot"] / "rootfs" / "usr" / "local"
               / "bin" / "suid-id")
    st = planted.stat()
    assert st.st_uid == 0 and st.st_mode & 0o4000, "on the host the file is setuid-root (the mount must not honour it)"
    user = pwd.getpwnam("space-node")
    done = subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups",
                           str(planted), "-u"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(user.pw_uid), f"the planted binary ran with euid {done.stdout.strip()}"


@pytest.mark.probe("a block device node made inside the sandbox, opened on the host")
def test_a_device_node_made_inside_opens_nothing_on_the_host(api: httpx.Client, server: Server,
                                                              sandbox: str) -> None:
    # The host's first disk as a node in the sandbox's root: gVisor refuses the mknod; if a node
    # got there anyway (a received stream can carry one), the pool's nodev keeps it inert.
    code, out, err = as_root(api, sandbox, "mknod /usr/local/disk b 8 0 && echo made || echo refused")
    assert code == 0, err
    node = server.data_dir / "pool" / "sandboxes" / sandbox / "rootfs" / "usr" / "local" / "disk"
    if out.strip() == "made" and node.exists():
        with pytest.raises(PermissionError):
            node.open("rb").close()
    else:
        assert out.strip() == "refused" and not node.exists(), (out, err)
    assert "nodev" in mount_options(server.data_dir / "pool")


# -- /proc and the mount table --------------------------------------------------------------------


@pytest.mark.probe("/proc/self/mountinfo and /proc/mounts inside, for host paths and devices")
def test_the_mount_table_inside_shows_no_host_path(api: httpx.Client, server: Server, sandbox: str) -> None:
    code, out, err = as_root(api, sandbox, "cat /proc/self/mountinfo /proc/mounts /proc/1/mountinfo")
    assert code == 0, err
    assert " /opt/space/guest " in out, out  # the control: this is the sandbox's table, guest mount and all
    for needle in [*host_secrets(server), "/dev/loop", "btrfs", "/var/lib", "/run/space"]:
        assert needle not in out, f"the sandbox's mount table names {needle!r}:\n{out}"


@pytest.mark.probe("/proc inside, for host processes (pids, command lines, the sentry and gofer)")
def test_proc_inside_shows_no_host_process(api: httpx.Client, server: Server, sandbox: str) -> None:
    seen = json.loads(python_in(api, sandbox, (
        "import json, os\n"
        "out = {}\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit():\n"
        "        try: out[p] = open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace')\n"
        "        except OSError: pass\n"
        "print(json.dumps(out))\n")))
    assert "1" in seen and "/opt/space/guest" in seen["1"], seen  # its own init: the guest daemon
    cmdlines = "\n".join(seen.values())
    for needle in host_secrets(server):
        assert needle not in cmdlines, f"a process inside names {needle!r}: {seen}"
    host_pids = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    assert len(seen) < 50 and len(seen) < len(host_pids), seen


@pytest.mark.probe("/proc/net/unix, tcp, tcp6 and udp inside, for the host's sockets")
def test_proc_net_inside_shows_no_host_socket(api: httpx.Client, server: Server, sandbox: str) -> None:
    code, out, err = as_root(api, sandbox, "cat /proc/net/unix /proc/net/tcp /proc/net/tcp6 /proc/net/udp 2>&1")
    assert code == 0, err
    assert out.startswith("Num") and "local_address" in out, out  # the control: the tables were read
    for needle in host_secrets(server):
        assert needle not in out, f"the sandbox's /proc/net names {needle!r}:\n{out}"
    listening_here = f":{server.port:04X} "
    assert listening_here not in out, f"the API's port {server.port} shows in the sandbox's socket tables:\n{out}"


# -- the node's sockets ---------------------------------------------------------------------------

SOCKETS = {"node-agent": "node.sock", "root-helper": "helper/helper.sock", "gateway-control": "gateway.sock"}


@pytest.mark.parametrize("which", sorted(SOCKETS))
@pytest.mark.probe("the node agent's, root helper's or gateway's unix socket in the sandbox's filesystem")
def test_the_nodes_sockets_are_not_in_the_sandbox_filesystem(api: httpx.Client, server: Server, sandbox: str,
                                                              which: str) -> None:
    host_path = channel_dir_for(server.data_dir) / SOCKETS[which]
    assert host_path.exists(), f"{host_path} is where the {which} listens on the host"
    name = host_path.name
    listing = python_in(api, sandbox, (
        "import os, stat, sys, socket\n"
        "found = []\n"
        "for d, dirs, files in os.walk('/', onerror=lambda e: None):\n"
        "    if d.startswith(('/proc', '/sys')):\n"
        "        dirs[:] = []\n"
        "        continue\n"
        "    for f in files + dirs:\n"
        "        p = os.path.join(d, f)\n"
        "        try: st = os.lstat(p)\n"
        "        except OSError: continue\n"
        "        if stat.S_ISSOCK(st.st_mode) or f == sys.argv[2]: found.append(p)\n"
        "for p in (sys.argv[1], '/run/space', '/var/run/space'):\n"
        "    if os.path.lexists(p): found.append(p)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[1]); found.append('connected ' + sys.argv[1])\n"
        "except OSError as e: pass\n"
        "print('\\n'.join(found))\n"), str(host_path), name)
    assert name not in listing and str(host_path) not in listing, f"inside the sandbox: {listing}"
    assert "connected" not in listing, listing


@pytest.mark.probe("every abstract unix socket name the host has, connected to from inside")
def test_no_host_abstract_unix_socket_is_reachable(api: httpx.Client, sandbox: str) -> None:
    names = sorted({line.split()[-1][1:] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
                    if line.split()[-1].startswith("@")})[:300]
    names.append("space-probe-nonexistent")  # the control: an unknown name fails the same way
    results = json.loads(python_in(api, sandbox, (
        "import json, socket, sys\n"
        "out = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):\n"
        "        s = socket.socket(socket.AF_UNIX, kind)\n"
        "        try:\n"
        "            s.connect('\\0' + name); out[name] = 'connected'\n"
        "        except OSError as e:\n"
        "            out.setdefault(name, type(e).__name__)\n"
        "        finally: s.close()\n"
        "print(json.dumps(out))\n"), json.dumps(names)))
    reached = {n: r for n, r in results.items() if r == "connected"}
    assert reached == {}, f"host abstract sockets reachable from inside: {reached}"
    assert set(results) == set(names)


def host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    addrs = []
    for line in out.splitlines():
        parts = line.split()
        if parts[2] == "inet":
            addrs.append(parts[3].split("/")[0])
    return sorted(set(addrs))


@pytest.mark.probe("SPACE's API over TCP from inside: loopback, the gateway address, every host address")
def test_no_node_service_answers_on_any_address_from_inside(api: httpx.Client, server: Server, sandbox: str) -> None:
    targets = sorted({"127.0.0.1", "0.0.0.0", *host_addresses()})
    answers = json.loads(python_in(api, sandbox, (
        "import json, socket, sys\n"
        "port = int(sys.argv[2])\n"
        "out = {}\n"
        "for host in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        s = socket.create_connection((host, port), timeout=5)\n"
        "        s.settimeout(5)\n"
        "        s.sendall(b'GET /healthz HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n')\n"
        "        data = b''\n"
        "        while len(data) < 4096:\n"
        "            chunk = s.recv(4096)\n"
        "            if not chunk: break\n"
        "            data += chunk\n"
        "        out[host] = data.decode(errors='replace')\n"
        "    except OSError as e:\n"
        "        out[host] = 'error ' + type(e).__name__\n"
        "print(json.dumps(out))\n"), json.dumps(targets), str(server.port)))
    assert set(answers) == set(targets)
    for host, answer in answers.items():
        assert '"status":"ok"' not in answer.replace(" ", "") and "HTTP/1.1 200" not in answer, \
            f"SPACE's API answered the sandbox at {host}:{server.port}: {answer[:300]}"
    # The control: the host itself reaches the API on loopback (so the port was the right one).
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):
        pass
