"""``space serve``: the whole platform in one process tree on embedded defaults.

The API and the controller run in this process; the node agent runs as a child process (it would be
a separate host in a cluster) and is reached only through its authenticated node API over a unix
socket. Sandboxes run in their own sessions and outlive both: a restarted server adopts them.

What the operator's environment holds (the master key, the object store's ``AWS_*`` credentials, a
Vault token) is read once at the start (:func:`space.childenv.snapshot`); then this process's own
environment is cut down to the API's allowlist (:func:`space.childenv.confine_self`). The node
agent's supervisor and the node agent get environments built from their own allowlists, and the
object store's credentials reach the node agent on a pipe (:mod:`space.nodesup`), never by env.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import structlog
import uvicorn

from space import childenv, controlplane, objauth, privdrop, serve_state
from space.api.app import create_app
from space.api.state import AppState
from space.cluster.identity import ControlPlaneTLS
from space.cluster.keys import CLUSTER_CA_CERT, CLUSTER_CA_KEY
from space.cluster.pki import ClusterCA, write_private
from space.config import DEFAULT_QUOTA, ServeSettings
from space.controller import Controller, NodeRegistry
from space.controlplane import TEMPLATE_SPECS
from space.credentials import CredentialManager, build_manager
from space.egress_policy import parse_ceiling, parse_sandbox_network
from space.errors import SpaceError, Unavailable
from space.httpserver import BoundedHttp
from space.kms import KMS_ENV
from space.node.api.client import NodeClient
from space.node.main import channel_dir_for
from space.objstore import ObjectStore, s3_env
from space.store import Store, quotas
from space.store.wakeups import LocalWakeups
from space.web import GracefulServer

log = structlog.get_logger("space.serve")

NODE_ID = "node-1"


def manifest_key_file(data: Path, env: Mapping[str, str]) -> Path | None:
    """``<data>/manifest.key``, which the node agent makes (0600 root) on its first start, unless
    ``$SPACE_MANIFEST_KEY`` in the server's environment gives the deployment's key (it then reaches
    the agent on its secrets pipe). This process never reads either: once it drops to the API's
    user it can write the local object store, and must not be able to seal."""
    if env.get(objauth.ENV_VAR, "").strip():
        return None
    return data / objauth.KEY_FILE


def ensure_cluster_ca(data: Path) -> ClusterCA:
    """The deployment's cluster CA, made in the data directory on first start: nodes on other
    machines may join this server (``space node token create``) like a replicated control plane."""
    cert, key = data / CLUSTER_CA_CERT.file, data / CLUSTER_CA_KEY.file
    if not key.exists():
        ca = ClusterCA.create()
        write_private(cert, ca.cert_pem)
        write_private(key, ca.key_pem)
        return ca
    return ClusterCA.load(cert.read_bytes(), key.read_bytes())


def _secret_file(path: Path, nbytes: int = 32) -> str:
    """Read a secret file, creating it (mode 0600) on first start."""
    if path.exists():
        return path.read_text().strip()
    value = secrets.token_urlsafe(nbytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


class NodeProcess:
    """The node agent, run by its root supervisor (:mod:`space.nodesup`), which restarts it when it
    dies and stops it when we close its stdin or die: after the privilege drop this process can
    neither start a root process nor signal one."""

    def __init__(self, settings: ServeSettings, socket: Path, token_file: Path,
                 socket_group: int | None = None, *, env: Mapping[str, str] | None = None,
                 manifest_key_file: Path | None = None) -> None:
        self.settings = settings
        self.socket = socket
        self.token_file = token_file
        self.socket_group = socket_group
        #: The operator's environment as the server started (what the node agent's allowlist and
        #: its object store credentials are taken from).
        self.env: Mapping[str, str] = dict(os.environ) if env is None else env
        #: The deployment's manifest key, root's (None: ``$SPACE_MANIFEST_KEY`` reaches the agent).
        self.manifest_key_file = manifest_key_file
        #: The supervisor.
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        s = self.settings
        argv = [
            sys.executable, "-m", "space.cli.main", "node", "run",
            "--data-dir", str(s.data_dir), "--socket", str(self.socket),
            "--token-file", str(self.token_file), "--node-id", NODE_ID,
            "--cache-dir", str(s.cache_dir), "--pool-size-gb", str(s.pool_size_gb),
            "--sandbox-disk-mb", str(s.sandbox_disk_mb),
            *(["--pool-reserve-mb", str(s.pool_reserve_mb)] if s.pool_reserve_mb is not None else []),
            "--max-upload-bytes", str(s.max_upload_bytes), "--die-with-parent",
            "--object-store-url", s.resolved_object_store_url(),
            # One egress CA per deployment: the all-in-one server's, in its data directory.
            "--egress-ca-dir", str(s.data_dir / "egress-ca"),
            "--network" if s.network else "--no-network",
        ]
        for net in s.egress_ceiling:
            argv += ["--egress-private", net]
        argv += ["--sandbox-network", s.sandbox_network]
        if self.socket_group is not None:
            argv += ["--socket-group", str(self.socket_group)]
        if self.manifest_key_file is not None:
            argv += ["--manifest-key-file", str(self.manifest_key_file), "--create-manifest-key"]
        # The local keyring's root (tenants' keys without a KMS of their own): made on first start.
        argv += ["--kek-file", str(s.data_dir / "kek.key"), "--create-kek"]
        url = s.resolved_object_store_url()
        secrets: dict[str, dict[str, str]] = {"object_store": s3_env(self.env)} if url.startswith("s3://") else {}
        kms = {k: v for k, v in self.env.items() if k in KMS_ENV}
        if kms:
            secrets["kms"] = kms  # tenants' AWS KMS keys: the agent's credentials for them
        if self.env.get(objauth.ENV_VAR, "").strip():
            # The deployment's key, given to this server: it reaches the agent as its S3
            # credentials do, on the secrets pipe, never in an environment.
            secrets["manifest"] = {objauth.ENV_VAR: self.env[objauth.ENV_VAR]}
        doc = {"argv": argv, "env": childenv.build("node", source=self.env), "secrets": secrets}
        # The argv goes on stdin, not the command line: only the node agent itself is "node run".
        self.proc = subprocess.Popen([sys.executable, "-m", "space.nodesup"], stdin=subprocess.PIPE,
                                     env=childenv.build("nodesup", source=self.env))
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(doc).encode() + b"\n")
        self.proc.stdin.flush()
        log.info("node.spawned", supervisor=self.proc.pid)

    def ready(self) -> None:
        """Tell the supervisor the node agent answered: it restarts it from now on."""
        if self.alive() and self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write(b"ready\n")
                self.proc.stdin.flush()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()  # EOF: the supervisor stops the node agent (15 s grace), then exits
        deadline = time.monotonic() + 20
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            try:
                self.proc.kill()
                self.proc.wait()
            except PermissionError:  # root's, and we are not: it follows us through PR_SET_PDEATHSIG
                log.warning("node.supervisor_still_running", pid=self.proc.pid)



async def seed_quotas(store: Store, settings: ServeSettings) -> None:
    """The default limits of tenants whose own were never set: the command line's replace the
    stored ones; without it, a new deployment gets :data:`DEFAULT_QUOTA`. The operator's own
    tenant starts unlimited (an explicit row the operator may change like any other)."""
    if settings.default_quota is not None:
        await store.put_quota(quotas.DEFAULTS, settings.default_quota)
    else:
        await store.seed_quota(quotas.DEFAULTS, DEFAULT_QUOTA)
    await store.seed_quota(settings.operator_tenant, {})

async def wait_node_ready(client: NodeClient, node: NodeProcess, timeout: float = 300.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            info: dict[str, object] = await client.call("GET", "/v1/node", timeout=5)
            return info
        except SpaceError:
            if not node.alive():
                raise Unavailable("the node agent exited during start; see its log above") from None
            if time.monotonic() > deadline:
                raise Unavailable("the node agent did not become ready in time") from None
            await asyncio.sleep(0.05)


async def ensure_admin_key(store: Store, data_dir: Path, tenant: str = "default") -> None:
    key_file = data_dir / "admin.key"
    # Empty: made by root for the unprivileged API to fill (it cannot create files in data_dir).
    if key_file.exists() and key_file.stat().st_size > 0:
        return
    if await store.count_api_keys() > 0:
        log.warning("admin_key.file_missing", path=str(key_file),
                    hint="keys exist already; create a new admin key with an existing one")
        return
    _row, key = await store.create_api_key(tenant, "admin", "bootstrap admin")
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    log.info("admin_key.created", path=str(key_file))


async def heartbeat(client: NodeClient, node: NodeProcess, every: float = 5.0) -> None:
    while True:
        await asyncio.sleep(every)
        if not node.alive():
            # The supervisor restarts a dead node agent; it is gone itself only if killed.
            log.error("node.supervisor_died", returncode=node.proc.returncode if node.proc else None)
            if os.geteuid() != 0:
                raise Unavailable("the node agent's supervisor exited and this process cannot start "
                                  "root processes any more: restart space serve")
            node.start()
            with contextlib.suppress(SpaceError):
                await wait_node_ready(client, node, timeout=120)
                node.ready()
            continue
        # Heartbeats proper (capacity, warm pools) are the controller's check_nodes.


async def seed_warm_pool(st: AppState, data_dir: Path, size: int) -> None:
    """The first start keeps ``size`` warm ``base`` sandboxes; later the pools are the user's."""
    marker = data_dir / "warm-pool.seeded"
    if marker.exists():
        return
    if size > 0 and not await st.store.list_warm_pools():
        await st.store.set_warm_pool("base", cpu=1.0, memory_mb=512, size=size)
        log.info("warm_pool.seeded", template="base", size=size)
    marker.touch()


async def serve(settings: ServeSettings) -> None:
    # Read once, then gone from this process's environment (and /proc/<pid>/environ): from here on
    # the settings and secrets are passed by name to what needs them.
    env = childenv.snapshot()
    childenv.confine_self("api")
    data = settings.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    os.chmod(data, 0o700)
    user = privdrop.resolve_user(settings.user)
    serve_state.migrate_layout(settings)
    secret = _secret_file(data / "secret.key")
    cluster_ca = ensure_cluster_ca(data)
    token_file = data / "node.token"
    token = _secret_file(token_file)
    socket = channel_dir_for(data) / "node.sock"
    if user is not None:
        serve_state.own_serve_state(settings, user, env=env)
    manifest_key = manifest_key_file(data, env)

    node = NodeProcess(settings, socket, token_file, socket_group=user.gid if user else None, env=env,
                       manifest_key_file=manifest_key)
    node.start()
    if user is not None:
        # Only the node agent holds it: the API's user can write the local object store, and a
        # writer of the bucket must never be able to seal what nodes trust.
        os.environ.pop(objauth.ENV_VAR, None)
    client = NodeClient(NODE_ID, f"unix://{socket}", token)
    store: Store | None = None
    nodes: NodeRegistry | None = None
    credentials: CredentialManager | None = None
    wakeups: LocalWakeups | None = None
    try:
        if user is not None:
            # The node agent runs (as root, under its supervisor); nothing from here on needs root.
            privdrop.drop_privileges(user)
            serve_state.check_access(user, settings)
        info = await wait_node_ready(client, node)
        node.ready()
        log.info("node.ready", node=NODE_ID, templates=info.get("templates"))
        store = await Store.open(settings.resolved_database_url())
        await ensure_admin_key(store, data, settings.operator_tenant)
        await seed_quotas(store, settings)
        await store.upsert_node(NODE_ID, f"unix://{socket}", token, {"pool": info.get("pool")})
        nodes = NodeRegistry(store, tls=ControlPlaneTLS(cluster_ca, "serve"))
        objects = ObjectStore.from_url(settings.resolved_object_store_url(), env=env)
        wakeups = store.wakeups()  # on PostgreSQL, other control-plane processes may share it
        await wakeups.start()
        controller = Controller(store, nodes, lease_seconds=settings.lease_seconds, template_specs=TEMPLATE_SPECS,
                                objects=objects, wakeups=wakeups, operator_tenant=settings.operator_tenant,
                                encrypt_objects=settings.encrypt_objects)
        await controller.sync_templates()
        credentials = build_manager(store, data, env=env)
        controller.lifecycle.credentials = credentials
        state = AppState(store=store, nodes=nodes, controller=controller, secret=secret.encode(),
                         max_upload_bytes=settings.max_upload_bytes, credentials=credentials,
                         sandbox_disk_mb=settings.sandbox_disk_mb,
                         operator_tenant=settings.operator_tenant,
                         egress_ceiling=parse_ceiling(settings.egress_ceiling),
                         sandbox_networks=(parse_sandbox_network(settings.sandbox_network),),
                         e2b_domain=settings.e2b_domain.lower() if settings.e2b_domain else None,
                         cluster_ca=cluster_ca)
        await controlplane.bootstrap_templates(state, settings.bootstrap_templates, "default")
        await seed_warm_pool(state, serve_state.control_dir(settings), settings.warm_pool)
        await controller.push_warm_pools()

        host, _, port = settings.listen.rpartition(":")
        server = GracefulServer(uvicorn.Config(
            create_app(state), host=host or "127.0.0.1", port=int(port), log_level="warning",
            access_log=False, lifespan="off", timeout_graceful_shutdown=5,
            # Request heads bounded in size and time (bodies: space.api.limits).
            http=BoundedHttp,
        ))
        async with asyncio.TaskGroup() as tg:
            ctl = tg.create_task(controller.run())
            hb = tg.create_task(heartbeat(client, node))
            log.info("serve.listening", url=f"http://{settings.listen}", data_dir=str(data))
            await server.serve()
            ctl.cancel()
            hb.cancel()
            await state.audit.aclose()  # the last calls' audit records
    finally:
        await _say_what_keeps_running(client, data)
        await client.aclose()
        if credentials is not None:
            await credentials.aclose()
        if nodes is not None:
            await nodes.aclose()
        if wakeups is not None:
            await wakeups.close()
        if store is not None:
            await store.close()
        await node.stop()
        log.info("serve.stopped")


async def _say_what_keeps_running(client: NodeClient, data: Path) -> None:
    """Sandboxes outlive the server by design (a restart adopts them), warm ones and the egress
    gateway included: say so on the way out, and how to stop them, so nobody thinks they stopped."""
    try:
        info = await client.call("GET", "/v1/node", timeout=5)
    except SpaceError:
        return  # the node agent is gone already: nothing of it to report
    running = int(info.get("sandboxes") or 0)
    warm = sum(int(p.get("ready") or 0) + int(p.get("booting") or 0) for p in info.get("warm") or [])
    if running or warm or info.get("network"):
        message = (f"{running} sandboxes and {warm} warm ones keep running"
                   f"{', and the egress gateway' if info.get('network') else ''}; "
                   f"a restart adopts them, `space node teardown --data-dir {data}` stops them")
        log.info("serve.left_running", sandboxes=running, warm=warm, message=message)


def run(settings: ServeSettings) -> None:
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(settings))
    except (privdrop.PrivilegeError, objauth.ManifestKeyError) as e:
        log.error("serve.refused", error=e.message, **e.details)
        raise SystemExit(2) from None
