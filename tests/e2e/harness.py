"""A real ``space serve`` in a subprocess, for end-to-end tests and benchmarks."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.waiting import wait_for as wait_for  # re-exported: tests import it from here

REPO = Path(__file__).resolve().parents[2]
#: Where :func:`own_server` keeps data dirs (``/tmp/space-e2e``): reachable by the service user.
SCRATCH = Path(tempfile.gettempdir()) / "space-e2e"
SPACE = str(Path(sys.executable).parent / "space")


#: What a server (and its node agent) of the tests inherits from the test process: nothing else of
#: the caller's environment reaches it (a SPACE_* or AWS_* of the caller's shell would configure it).
_INHERITED = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ")


def server_environment(extra: dict[str, str]) -> dict[str, str]:
    """The explicit environment of a server process of the tests: a few basics, keepalives every
    second (so that every stream in the tests carries some) and what the test asks for."""
    base = {k: os.environ[k] for k in _INHERITED if k in os.environ}
    return {**base, "SPACE_SSE_KEEPALIVE": "1", **extra}


def runtime_available() -> str | None:
    """None when real sandboxes can run here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (btrfs, loop devices, runsc)"
    for tool in ("runsc", "mkfs.btrfs", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make setup)"
    return None


def loop_devices(image: Path) -> str:
    """The loop devices attached to ``image`` (empty when none)."""
    return subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Server:
    data_dir: Path
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    admin_key: str = ""
    extra_args: list[str] = dataclasses.field(default_factory=list)
    #: Extra environment of the server (and so of its node agent), e.g. object store credentials.
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str | None = None, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout,
                            headers={"authorization": f"Bearer {key or self.admin_key}"})

    def start(self, *, wait_template: bool = True) -> None:
        _open_to_service_user(self.data_dir.parent)
        log = open(self.log_path, "ab")  # noqa: SIM115 -- owned by the child
        self.proc = subprocess.Popen(
            [SPACE, "serve", "--data-dir", str(self.data_dir), "--listen", f"127.0.0.1:{self.port}",
             # No warm pool unless a test asks for one (--warm-pool N later wins).
             "--pool-size-gb", "16", "--max-upload-mb", "64", "--warm-pool", "0", *self.extra_args],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO, env=server_environment(self.env),
        )
        log.close()
        wait_for(self._healthy, 300, "the server to answer /healthz")
        self.admin_key = (self.data_dir / "admin.key").read_text().strip()
        if wait_template:
            self.wait_template("base")

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"space serve exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_template(self, name: str, timeout: float = 1800) -> None:
        with self.client() as c:
            def ready() -> bool:
                r = c.get(f"/v1/templates/{name}")
                if r.status_code == 200 and r.json()["status"] == "failed":
                    raise AssertionError(f"template {name} failed: {r.json()}\n{self.log_tail()}")
                return r.status_code == 200 and r.json()["status"] == "ready"
            wait_for(ready, timeout, f"template {name}", interval=0.5)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (its node agent dies with it)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        # The node agent follows through PR_SET_PDEATHSIG; wait until its socket is released.
        wait_for(lambda: not _node_agent_running(self.data_dir), 30, "the node agent to exit")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        with contextlib.suppress(Exception):
            wait_for(lambda: not _node_agent_running(self.data_dir), 30, "the node agent to exit")

    def teardown(self) -> None:
        """Stop the server and release every sandbox, mount and loop device it made."""
        self.stop()
        node_teardown(self.data_dir, log_tail=self.log_tail())


_INSTANCE_IN_LOG = re.compile(rb'"instance": "([A-Za-z0-9][A-Za-z0-9._-]*-[a-z0-9]{5})"')


def leaked_cgroups(log_path: Path) -> list[str]:
    """The cgroups still there of the runtime instances a server's log names (runsc makes one per
    controller, ``/sys/fs/cgroup/<controller>/space/<instance>``, and deleting the instance removes
    them)."""
    try:
        instances = set(_INSTANCE_IN_LOG.findall(log_path.read_bytes()))
    except OSError:
        return []
    root = Path("/sys/fs/cgroup")
    groups = [c / "space" for c in root.iterdir()] if root.is_dir() else []
    return sorted(str(g / i.decode()) for g in groups for i in instances if (g / i.decode()).exists())


def node_teardown(data_dir: Path, *extra: str, log_tail: str = "") -> None:
    """``space node teardown``; a failure names its cause (its stderr) and shows the log's end."""
    done = subprocess.run([SPACE, "node", "teardown", "--data-dir", str(data_dir), *extra],
                          capture_output=True, timeout=300)
    assert done.returncode == 0, (
        f"space node teardown failed ({done.returncode}):\n{done.stderr.decode(errors='replace')[-4000:]}\n"
        f"the log's end:\n{log_tail}")


@dataclasses.dataclass
class NodeAgent:
    """A further node: a ``space node run`` process with its own data dir, pool and cache, joined
    to a :class:`Server` with a join token and serving its node API over mutual TLS on TCP (as a
    separate host would).

    Its cache dir is its own, so a template it lacks comes from object storage, not the host cache.
    """

    node_id: str
    data_dir: Path
    cache_dir: Path
    log_path: Path
    object_store_url: str
    port: int = dataclasses.field(default_factory=free_port)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    #: The cluster CA the node's certificate is checked with, and a control-plane client
    #: certificate minted from it (what an API replica presents), once joined.
    ca_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def client(self, timeout: float = 30.0) -> httpx.Client:
        """A client of this node's own API, as the control plane calls it (mutual TLS)."""
        from space.cluster.pki import ClusterCA, client_context

        assert self.ca_dir is not None, "not started"
        ca = ClusterCA.load((self.ca_dir / "cluster-ca.pem").read_bytes(),
                            (self.ca_dir / "cluster-ca.key").read_bytes())
        cert, key = ca.issue_client("e2e-test", days=1)
        return httpx.Client(base_url=self.url, timeout=timeout, verify=client_context(cert, key, ca.cert_pem))

    def info(self) -> dict[str, Any]:
        """The node's ``GET /v1/node``."""
        with self.client() as c:
            r = c.get("/v1/node")
            r.raise_for_status()
            out: dict[str, Any] = r.json()
            return out

    def start(self, server: Server) -> None:
        """Join ``server`` with a fresh join token and wait until it lists this node as ready."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.ca_dir = server.data_dir
        with server.client() as api:
            r = api.post("/v1/nodes/tokens", json={"ttl_seconds": 600, "description": self.node_id, "max_uses": 1})
            assert r.status_code == 201, r.text
            token_file = _private_file(self.data_dir / "join.token", r.json()["token"])
        # The deployment's manifest key, which every node sharing the object store holds.
        manifest_key = server.data_dir / "manifest.key"
        sealing = ["--manifest-key-file", str(manifest_key)] if manifest_key.exists() else []
        # And the local keyring's root key: a snapshot one node encrypts, another opens.
        kek = server.data_dir / "kek.key"
        sealing += ["--kek-file", str(kek)] if kek.exists() else []
        log = open(self.log_path, "ab")  # noqa: SIM115 -- owned by the child
        # Run as ``-m space.cli.main`` like the all-in-one node, so _node_agent_running finds it.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "space.cli.main", "node", "run",
             "--data-dir", str(self.data_dir), "--listen", f"127.0.0.1:{self.port}",
             "--join-token-file", str(token_file), "--control-url", server.url, "--advertise-url", self.url,
             "--egress-ca-dir", str(server.data_dir / "egress-ca"), "--node-id", self.node_id,
             "--cache-dir", str(self.cache_dir), "--pool-size-gb", "16",
             "--object-store-url", self.object_store_url, *sealing],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO, env=server_environment(self.env),
        )
        log.close()
        with server.client() as api:
            def registered() -> bool:
                if self.proc is not None and self.proc.poll() is not None:
                    raise AssertionError(f"node {self.node_id} exited with {self.proc.returncode}:\n"
                                         f"{self.log_tail()}")
                nodes = api.get("/v1/nodes").json()["nodes"]
                return any(n["id"] == self.node_id and n["url"] == self.url and n["state"] == "ready"
                           for n in nodes)
            wait_for(registered, 120, f"node {self.node_id} to join", interval=0.1)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def teardown(self) -> None:
        """Stop the agent and release every sandbox, mount, loop device and socket it made."""
        self.stop()
        if (self.data_dir / "pool.img").exists():
            node_teardown(self.data_dir, "--cache-dir", str(self.cache_dir), log_tail=self.log_tail())


def node_scratch(prefix: str) -> Path:
    """A scratch directory of its own for a further node's data and cache: its agent drops to the
    node user, which must reach them (pytest's own directories are private)."""
    SCRATCH.mkdir(mode=0o711, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=SCRATCH, prefix=prefix))
    _open_to_service_user(scratch)
    return scratch


def _open_to_service_user(scratch: Path) -> None:
    """The server drops to its service user (``$SPACE_USER``, default ``space``) after starting its
    node agent: that user must pass through the (private, 0700) test directories to its data dir,
    and may write in ``scratch``, the test's own directory (failpoint markers of the API go there)."""
    import pwd

    name = os.environ.get("SPACE_USER", "space")
    try:
        gid = pwd.getpwnam(name).pw_gid
    except KeyError:
        return  # the server refuses to start and says why
    if name == "root" or gid == 0:
        return
    scratch.mkdir(parents=True, exist_ok=True)
    for d in reversed(scratch.parents):
        mode = d.stat().st_mode
        if not mode & 0o001:
            os.chmod(d, (mode & 0o7777) | 0o001)
    os.chown(scratch, -1, gid)
    os.chmod(scratch, 0o770)


def _private_file(path: Path, value: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return path


@contextlib.contextmanager
def own_server(tmp: Path, *extra_args: str, env: dict[str, str] | None = None,
               start: bool = True) -> Iterator[Server]:
    """A ``space serve`` of its own, logging to ``tmp`` (skipped where the runtime is missing); on
    exit it is torn down and checked to have left no loop device and no socket directory behind.

    Its data dir is in a scratch directory of its own (``srv.data_dir.parent``, which the service
    user may write to), not under ``tmp``: the server's API runs as the service user, which must
    reach its data dir all along, and pytest makes ``/tmp/pytest-of-<user>`` private again whenever
    a session starts."""
    import pytest

    from space.node.main import channel_dir_for

    reason = runtime_available()
    if reason:
        pytest.skip(reason)
    SCRATCH.mkdir(mode=0o711, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=SCRATCH, prefix=f"{tmp.name}-"))
    srv = Server(data_dir=scratch / "data", port=free_port(), log_path=tmp / "serve.log",
                 extra_args=list(extra_args), env=dict(env or {}))
    try:
        if start:
            srv.start()
        yield srv
    finally:
        srv.teardown()
        assert loop_devices(srv.data_dir / "pool.img") == "", "the pool's loop device leaked"
        assert not channel_dir_for(srv.data_dir).exists(), "the node's socket directory leaked"
        assert leaked_cgroups(srv.log_path) == [], "runtime instances' cgroups leaked"
        shutil.rmtree(scratch)


def base_template(server: Server) -> Path:
    """The read-only subvolume of the server's ``base`` template (its root filesystem)."""
    found = sorted((server.data_dir / "pool" / "templates").glob("base@*"))
    dirs = [p for p in found if p.is_dir()]
    assert dirs, "the server has no base template"
    return dirs[-1]


def node_processes(data_dir: Path) -> list[int]:
    """Every process of the node with ``data_dir``: its agent, helper and gateway, its sandboxes'
    runsc (what a machine's sudden death takes down)."""
    from space.node.main import channel_dir_for

    marks = (str(data_dir).encode(), str(channel_dir_for(data_dir)).encode())
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if any(m in cmdline for m in marks):
            pids.append(int(entry.name))
    return pids


def _node_agent_running(data_dir: Path) -> bool:
    needle = f"--data-dir\x00{data_dir}\x00".encode()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if b"space.cli.main\x00node\x00run" in cmd and needle in cmd:
            return True
    return False


def wait_operation(c: httpx.Client, op_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        r = c.get(f"/v1/operations/{op_id}", params={"wait": 10})
        r.raise_for_status()
        op: dict[str, Any] = r.json()
        if op["status"] in ("succeeded", "failed"):
            return op
        if time.monotonic() > deadline:
            raise AssertionError(f"operation {op_id} still {op['status']} after {timeout}s")


def read_events(c: httpx.Client, sandbox_id: str, cid: str, *, after: int | None = None,
                headers: dict[str, str] | None = None, params: dict[str, Any] | None = None,
                limit: int | None = None) -> list[dict[str, Any]]:
    """Read a command's SSE stream into a list of {"id", "event", "data"} (until exit or ``limit``)."""
    import json

    out: list[dict[str, Any]] = []
    q = dict(params or {})
    if after is not None:
        q["after"] = after
    with c.stream("GET", f"/v1/sandboxes/{sandbox_id}/commands/{cid}/events", params=q,
                  headers=headers or {}) as r:
        if r.status_code != 200:
            r.read()
            raise AssertionError(f"events: {r.status_code} {r.text}")
        ev: dict[str, Any] = {}
        for line in r.iter_lines():
            if line.startswith(":"):  # SSE comment (keepalive)
                continue
            if not line:
                if ev:
                    ev["data"] = json.loads(ev.get("data", "null"))
                    out.append(ev)
                    if ev.get("event") == "exit" or (limit is not None and len(out) >= limit):
                        return out
                ev = {}
                continue
            key, _, value = line.partition(":")
            ev[key] = value[1:] if value.startswith(" ") else value
    return out


def run(c: httpx.Client, sandbox_id: str, body: dict[str, Any]) -> tuple[int, bytes, bytes]:
    """Start a command and collect (exit_code, stdout, stderr)."""
    r = c.post(f"/v1/sandboxes/{sandbox_id}/commands", json=body)
    assert r.status_code == 201, r.text
    events = read_events(c, sandbox_id, r.json()["id"])
    out = b"".join(base64.b64decode(e["data"]["data"]) for e in events if e["event"] == "stdout")
    err = b"".join(base64.b64decode(e["data"]["data"]) for e in events if e["event"] == "stderr")
    assert events[-1]["event"] == "exit", events[-3:]
    return int(events[-1]["data"]["exit_code"]), out, err


def create_sandbox(c: httpx.Client, **body: Any) -> str:
    body.setdefault("template", "base")
    r = c.post("/v1/sandboxes", json=body)
    assert r.status_code == 202, r.text
    op = wait_operation(c, r.json()["operation"]["id"])
    assert op["status"] == "succeeded", op
    return str(r.json()["sandbox"]["id"])


def node_agent_pid(server: Server) -> int:
    """The pid of ``server``'s node agent process."""
    needle = f"--data-dir\x00{server.data_dir}\x00".encode()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"space.cli.main\x00node\x00run" in cmd and needle in cmd:
                return int(p.name)
    raise AssertionError("no node agent process")


def node_agent_pid_or_none(server: Server) -> int | None:
    try:
        return node_agent_pid(server)
    except AssertionError:
        return None


#: A process whose state lives only in its memory (a shell variable): it counts, writing the count
#: to a file each tick (a pause, restore or fork either keeps it counting on or starts it over).
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done"


def sh(api: httpx.Client, sid: str, script: str) -> str:
    """Run ``script`` in the sandbox; its stdout (it must succeed)."""
    code, out, err = run(api, sid, {"shell": script})
    assert code == 0, (code, out, err)
    return out.decode()


def count(api: httpx.Client, sid: str) -> int:
    """What :data:`COUNTER` counted so far (0 before it started)."""
    return int(sh(api, sid, "cat /tmp/count 2>/dev/null || echo 0").strip() or 0)


#: A process whose state lives only in its memory: it prints 1, 2, 3... twice a second. A move that
#: kept it prints on from where it was; one that restarted it would start over (or lose it).
LOUD_COUNTER = "i=0; while true; do i=$((i+1)); echo $i; sleep 0.5; done"


def counter_numbers(c: httpx.Client, sid: str, cid: str, at_least: int, timeout: float = 60) -> list[int]:
    """What the counter printed from its start, read until it printed ``at_least``. Like the SDK, it
    reads again when the stream ends early (right after a move, a replica whose node rows are up to a
    second old may still reach the old copy, whose streams end as it is removed) or the API answers
    that the sandbox's node is unavailable (its agent starting again: the API's connection to it is
    made anew)."""
    deadline = time.monotonic() + timeout

    def attempt() -> list[int] | None:
        out = b""
        try:
            with c.stream("GET", f"/v1/sandboxes/{sid}/commands/{cid}/events", params={"after": 0},
                          timeout=httpx.Timeout(timeout, read=10)) as r:
                if r.status_code == 503:
                    return None
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data:") and '"data"' in line:
                        out += base64.b64decode(json.loads(line[5:])["data"])
                        got = [int(x) for x in out.split()]
                        if got and got[-1] >= at_least:
                            return got
                    if time.monotonic() > deadline:
                        return None
        except httpx.TransportError:
            return None  # cut short (the old copy went): read again
        return None

    return wait_for(attempt, timeout, f"{sid}'s counter to reach {at_least}", interval=0.2)
