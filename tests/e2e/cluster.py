"""A many-machine deployment on one machine: real processes, real PostgreSQL, moto's S3 server on
loopback, ``space api`` replicas, ``space controller`` replicas and ``space node run`` agents, each
node with its own data directory and pool, joined with join tokens and served over mutual TLS.

Each process is what a separate host would run; they share nothing but the database, the bucket
and the shared keys (``space keys generate``), exactly as the README's three-machine example.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

from space.cluster.pki import ClusterCA, client_context
from tests.e2e.harness import (
    REPO,
    SPACE,
    free_port,
    loop_devices,
    node_scratch,
    node_teardown,
    server_environment,
)
from tests.waiting import wait_for

S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "space-test",
    "AWS_SECRET_ACCESS_KEY": "space-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclasses.dataclass
class Proc:
    """One process of the deployment, logging to its own file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 -- owned by the child
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO,
                                     env=server_environment(self.env))
        log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL, as a machine that dies does."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


@dataclasses.dataclass
class ClusterNode:
    proc: Proc
    node_id: str
    port: int
    data_dir: Path
    cache_dir: Path
    scratch: Path | None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


@dataclasses.dataclass
class Cluster:
    work: Path
    keys_dir: Path
    database_url: str
    object_store_url: str
    admin_key: str
    apis: list[Proc] = dataclasses.field(default_factory=list)
    api_ports: list[int] = dataclasses.field(default_factory=list)
    controllers: list[Proc] = dataclasses.field(default_factory=list)
    nodes: list[ClusterNode] = dataclasses.field(default_factory=list)
    #: Extra environment of every node agent (e.g. ``SPACE_FENCE_AFTER``).
    node_env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: While it exists, the controllers' failpoint controller.create.after_node is disarmed;
    #: removed, the first controller to get there stalls (SPACE_FAILPOINTS sleep-once).
    stall_marker: Path = dataclasses.field(init=False)
    #: The same for controller.move.after_switch (a move switched to its new node, the old copy
    #: still there).
    move_stall_marker: Path = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.stall_marker = self.work / "stall-once"
        self.stall_marker.touch()
        self.move_stall_marker = self.work / "move-stall-once"
        self.move_stall_marker.touch()

    def api_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.api_ports[i]}"

    def client(self, i: int, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.api_url(i), timeout=timeout,
                            headers={"authorization": f"Bearer {self.admin_key}"})

    def cluster_ca(self) -> ClusterCA:
        return ClusterCA.load((self.keys_dir / "cluster-ca.pem").read_bytes(),
                              (self.keys_dir / "cluster-ca.key").read_bytes())

    def node_client(self, node: ClusterNode, *, ca: ClusterCA | None = None, cert: tuple[bytes, bytes] | None = None,
                    **kw: object) -> httpx.Client:
        """A client of a node's API presenting a control-plane certificate of ``ca`` (default: the
        cluster's), or ``cert`` (a certificate and key pair)."""
        ca = ca or self.cluster_ca()
        cert_pem, key_pem = cert or ca.issue_client("e2e-test", days=1)
        ctx = client_context(cert_pem, key_pem, self.cluster_ca().cert_pem)
        return httpx.Client(base_url=node.url, verify=ctx, timeout=10, **kw)  # type: ignore[arg-type]

    def _control_argv(self, role: str) -> list[str]:
        return [sys.executable, "-m", "space.cli.main", role, "--database-url", self.database_url,
                "--object-store-url", self.object_store_url, "--keys-dir", str(self.keys_dir)]

    def _control_env(self) -> dict[str, str]:
        return {**S3_CREDENTIALS, "SPACE_BOOTSTRAP_ADMIN_KEY": self.admin_key}

    def start_api(self, replace: int | None = None) -> Proc:
        """A new API replica, or (``replace``) one in the place of replica ``replace``, on its port:
        what a load balancer's target that was restarted looks like."""
        i = len(self.apis) if replace is None else replace
        port = free_port() if replace is None else self.api_ports[replace]
        p = Proc(f"api-{i}", [*self._control_argv("api"), "--listen", f"127.0.0.1:{port}"],
                 self.work / f"api-{i}.log", self._control_env())
        p.start()
        if replace is None:
            self.apis.append(p)
            self.api_ports.append(port)
        else:
            self.apis[replace] = p

        def ready() -> bool:
            p.check_alive()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 120, f"api-{i} to be ready", interval=0.1)
        return p

    def start_controller(self) -> Proc:
        i = len(self.controllers)
        env = {**self._control_env(),
               "SPACE_FAILPOINTS": f"controller.create.after_node=sleep-once:{self.stall_marker}:600,"
                                   f"controller.move.after_switch=sleep-once:{self.move_stall_marker}:600"}
        # Short operation leases: a killed controller's work is taken over 3 s after its last renewal.
        p = Proc(f"controller-{i}", [*self._control_argv("controller"), "--lease-seconds", "3"],
                 self.work / f"controller-{i}.log", env)
        p.start()
        self.controllers.append(p)
        return p

    def wait_template_ready(self, name: str, timeout: float = 900) -> None:
        """The deployment's first build of ``name`` is placed on whichever node is ready first: on
        node-a (the host's template cache) it is an import, elsewhere a debootstrap of minutes.
        Scenarios wait on their own operations with shorter deadlines, so the fixture waits here."""
        def ready() -> bool:
            with self.client(0) as api:
                r = api.get(f"/v1/templates/{name}")
            return r.status_code == 200 and r.json().get("status") == "ready"
        wait_for(ready, timeout, f"template {name} to be built", interval=1)

    def join_token(self, **body: object) -> str:
        with self.client(0) as api:
            r = api.post("/v1/nodes/tokens", json={"ttl_seconds": 600, **body})
            assert r.status_code == 201, r.text
            token: str = r.json()["token"]
            return token

    def start_node(self, node_id: str, *, host_cache: bool = False, control: int = 0,
                   control_url: str | None = None, control_ca: Path | None = None) -> ClusterNode:
        """A node agent joined through API replica ``control`` (or ``control_url``, whose HTTPS
        certificate ``control_ca`` issued). ``host_cache``: it shares the host's template cache (so
        it can import ``base`` without building it); else its own, empty."""
        scratch = node_scratch(f"{node_id}-")
        data, cache = scratch / "data", (Path("/var/cache/space") if host_cache else scratch / "cache")
        data.mkdir(parents=True, exist_ok=True)
        # The node's copy of the deployment's egress CA, as a secret mounted on that machine would
        # be (the keys directory is the control plane's, and private).
        egress_ca = scratch / "egress-ca"
        shutil.copytree(self.keys_dir / "egress-ca", egress_ca)
        token_file = data / "join.token"
        token_file.write_text(self.join_token(description=node_id, max_uses=1) + "\n")
        token_file.chmod(0o600)
        port = free_port()
        proc = Proc(node_id, [
            sys.executable, "-m", "space.cli.main", "node", "run", "--data-dir", str(data),
            "--listen", f"127.0.0.1:{port}", "--join-token-file", str(token_file),
            "--control-url", control_url or self.api_url(control), "--advertise-url", f"https://127.0.0.1:{port}",
            *(["--control-ca-file", str(control_ca)] if control_ca is not None else []),
            "--egress-ca-dir", str(egress_ca),
            "--manifest-key-file", str(self.keys_dir / "manifest.key"),
            "--kek-file", str(self.keys_dir / "kek.key"),
            "--node-id", node_id, "--cache-dir", str(cache), "--pool-size-gb", "16",
            "--object-store-url", self.object_store_url,
        ], self.work / f"{node_id}.log", {**S3_CREDENTIALS, **self.node_env})
        proc.start()
        node = ClusterNode(proc, node_id, port, data, cache, scratch)
        self.nodes.append(node)
        return node

    def wait_nodes_ready(self, timeout: float = 180) -> None:
        want = {n.node_id: n.url for n in self.nodes}

        def ready() -> bool:
            for n in self.nodes:
                n.proc.check_alive()
            with self.client(0) as api:
                rows = {r["id"]: r for r in api.get("/v1/nodes").json()["nodes"]}
            return all(rows.get(k, {}).get("state") == "ready" and rows[k]["url"] == u for k, u in want.items())

        wait_for(ready, timeout, f"nodes {sorted(want)} to join and be ready", interval=0.2)

    def teardown(self) -> None:
        errors = []
        for n in self.nodes:
            n.proc.stop()
        for p in self.controllers + self.apis:
            p.stop()
        for n in self.nodes:
            try:
                if (n.data_dir / "pool.img").exists():
                    node_teardown(n.data_dir, "--cache-dir", str(n.cache_dir), log_tail=n.proc.log_tail())
                assert loop_devices(n.data_dir / "pool.img") == "", f"{n.node_id}'s loop device leaked"
            except AssertionError as e:
                errors.append(str(e))
            if n.scratch is not None:
                shutil.rmtree(n.scratch, ignore_errors=True)
        assert not errors, errors


@contextlib.contextmanager
def moto_bucket() -> Iterator[str]:
    """An ``s3://`` object store URL of a fresh bucket on moto's S3 server (loopback)."""
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        bucket = f"space-{uuid.uuid4().hex[:12]}"
        httpx.put(f"{endpoint}/{bucket}", timeout=10).raise_for_status()
        yield f"s3://{bucket}/cluster?endpoint={endpoint}"
    finally:
        moto.stop()


@contextlib.contextmanager
def cluster(work: Path, database_url: str, *, apis: int = 2, controllers: int = 2,
            nodes: int = 3, node_env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """The topology, started in dependency order: keys, API replicas (they migrate the database
    and seed the first admin key), controllers, then node agents joining through the replicas."""
    keys_dir = work / "keys"
    subprocess.run([SPACE, "keys", "generate", str(keys_dir)], check=True, capture_output=True, timeout=60)
    with moto_bucket() as objects:
        c = Cluster(work=work, keys_dir=keys_dir, database_url=database_url, object_store_url=objects,
                    admin_key="sk_" + secrets.token_urlsafe(30), node_env=dict(node_env or {}))
        try:
            for _ in range(apis):
                c.start_api()
            for _ in range(controllers):
                c.start_controller()
            for i in range(nodes):
                c.start_node(f"node-{chr(ord('a') + i)}", host_cache=i == 0, control=i % apis)
            c.wait_nodes_ready()
            c.wait_template_ready("base")
            yield c
        finally:
            c.teardown()
