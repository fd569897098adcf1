"""The node agent process: opens the pool, adopts live sandboxes, serves the node API."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import pwd
import shutil
import signal
import stat
from pathlib import Path

import structlog
import uvicorn

from space.egress_policy import DEFAULT_SANDBOX_NETWORK, parse_sandbox_network
from space.kms import DataKeys
from space.node import leaving, membership
from space.node.api.app import create_node_app
from space.node.helper.backend import InProcess, Privileged
from space.node.helper.launch import HelperProcess
from space.node.helper.verbs import DEFAULT_BUILD_MAX_BYTES, GatewayConfig, HelperContext
from space.node.membership import JoinSettings, NodeTLSFiles
from space.node.network import build_net
from space.node.network.egress import Egress
from space.node.network.gateway import GatewayHandle
from space.node.network.namespaces import GatewayPorts, Network
from space.node.sandboxes.fencing import Fence
from space.node.sandboxes.guest_files import guest_dir
from space.node.sandboxes.manager import SandboxManager
from space.node.sandboxes.warm import WarmPool
from space.node.storage.ownership import AGENT_AREAS, AGENT_CACHE, give_node_state, node_state_dir
from space.node.storage.pool import Pool, default_reserve
from space.node.templates.store import TemplateStore
from space.objauth import ManifestKeys
from space.objstore import ObjectStore
from space.privdrop import PrivilegeError, ServiceUser, drop_privileges, require_access, require_code_access
from space.runtime import cgroups
from space.runtime.gvisor import GVisorDriver
from space.web import GracefulServer

#: The node agent's own system user (scripts/setup-system.sh creates it, in group ``space``).
NODE_USER = "space-node"

log = structlog.get_logger("space.node")

PR_SET_PDEATHSIG = 1


@dataclasses.dataclass
class NodeSettings:
    """How one node agent runs."""

    #: Where the node keeps its pool (``pool.img`` + mount), runsc state and logs.
    data_dir: Path
    #: Unix socket to serve the node API on (all-in-one mode), or None with ``listen``.
    socket: Path | None
    #: ``HOST:PORT`` to serve on instead of a socket (multi-node).
    listen: str | None
    #: Bearer token the control plane must present on ``socket`` (a joined node: mutual TLS instead).
    token: str
    node_id: str = "node-1"
    #: Host-wide cache of debootstrap downloads and exported template streams.
    cache_dir: Path = Path("/var/cache/space")
    pool_size_gb: int = 64
    #: MiB of the pool no sandbox may take, kept for the node's own work (snapshots, receives,
    #: templates); None: 5 % of the pool, at least 1 GiB (:func:`space.node.storage.pool.default_reserve`).
    pool_reserve_mb: int | None = None
    #: Disk limit of a sandbox whose creator names none (warm sandboxes until claimed), in MiB.
    sandbox_disk_mb: int | None = 10240
    max_upload_bytes: int = 1 << 30
    #: Die with the parent process (``space serve``); sandboxes survive in their own sessions.
    die_with_parent: bool = False
    #: Object store for suspended sandboxes and shipped templates: a directory or an ``s3://`` URL.
    object_store_url: str | None = None
    #: The ``AWS_*`` settings of an S3 object store, when given explicitly (``space serve``'s node
    #: agent reads them from ``--secrets-fd``); None: from this process's environment.
    object_store_env: dict[str, str] | None = dataclasses.field(default=None, repr=False)
    #: The deployment's manifest keys (:mod:`space.objauth`): required with an object store.
    manifest_keys: ManifestKeys | None = None
    #: The key providers snapshots' data keys are wrapped and opened with (:mod:`space.kms`).
    data_keys: DataKeys | None = dataclasses.field(default=None, repr=False)
    #: Join the cluster on start and serve ``listen`` over mutual TLS (space.node.membership).
    join: JoinSettings | None = None
    #: Seconds of silence after which an event stream gets an SSE comment (``$SPACE_SSE_KEEPALIVE``).
    #: Warm-pool sandboxes booted at the same time (each boot takes most of a core for ~0.4 s).
    warm_concurrency: int = 1
    #: Self-fencing lease (:mod:`space.node.sandboxes.fencing`): seconds without an acknowledged
    #: heartbeat after which this node freezes its sandboxes. None: never (space serve's own node).
    fence_after: float | None = None
    sse_keepalive: float = dataclasses.field(
        default_factory=lambda: float(os.environ.get("SPACE_SSE_KEEPALIVE", "15")))
    #: Each sandbox in its own network namespace whose only way out is the node's egress gateway.
    #: Off: sandboxes have loopback only (no gateway process).
    network: bool = True
    #: The deployment's egress CA (mitmproxy confdir layout); made on first use when missing.
    #: Every node of a deployment must be given the same one. Default ``<data_dir>/egress-ca``.
    egress_ca_dir: Path | None = None
    #: A group that may connect to ``socket`` (its directory becomes 0710 root:group instead of
    #: 0700): the unprivileged API of ``space serve``. The other sockets there stay root's, 0600.
    socket_group: int | None = None
    #: The user the agent drops to once its root helper runs (``$SPACE_NODE_USER``; "root": keep
    #: root, with a warning). A missing user also keeps root, with a warning naming the fix.
    user: str = dataclasses.field(default_factory=lambda: os.environ.get("SPACE_NODE_USER", NODE_USER))
    #: The Debian mirrors template builds may debootstrap from (``$SPACE_BUILD_MIRRORS``,
    #: comma-separated; default http://deb.debian.org/debian): the root helper refuses any other.
    build_mirrors: tuple[str, ...] = dataclasses.field(default_factory=build_net.build_mirrors)
    #: The container registries templates may come from (``$SPACE_BUILD_REGISTRIES``,
    #: comma-separated ``https://host[:port]``, ``http://`` for one without TLS; default none): the
    #: root helper pulls from no other.
    build_registries: tuple[str, ...] = dataclasses.field(
        default_factory=lambda: build_net.env_list("SPACE_BUILD_REGISTRIES"))
    #: What one template build may write (``$SPACE_BUILD_MAX_BYTES``, bytes; default 32 GiB): the
    #: root helper holds each build tree to it with the pool's quota.
    build_max_bytes: int = dataclasses.field(
        default_factory=lambda: int(os.environ.get("SPACE_BUILD_MAX_BYTES") or DEFAULT_BUILD_MAX_BYTES))
    #: Which images template builds may pull (``$SPACE_BUILD_IMAGE_POLICY``: a containers-policy.json(5),
    #: e.g. a registry's images signed by a key; None: any image of a listed registry), and where
    #: their signatures are (``$SPACE_BUILD_SIGNATURES``: a containers-registries.d(5) directory).
    build_image_policy: Path | None = dataclasses.field(
        default_factory=lambda: Path(p) if (p := os.environ.get("SPACE_BUILD_IMAGE_POLICY")) else None)
    build_signatures: Path | None = dataclasses.field(
        default_factory=lambda: Path(p) if (p := os.environ.get("SPACE_BUILD_SIGNATURES")) else None)
    #: The deployment's sandbox address range (``--sandbox-network``); this node takes a /20 of it.
    sandbox_network: str = DEFAULT_SANDBOX_NETWORK
    #: Egress rules build steps get beyond the mirrors and PyPI (``$SPACE_BUILD_EGRESS``,
    #: comma-separated; see space/node/network/build_net.py).
    build_egress: tuple[str, ...] = dataclasses.field(
        default_factory=lambda: build_net.env_list("SPACE_BUILD_EGRESS"))
    #: TEST ONLY: a JSON file {name: address} the gateway resolves names with instead of DNS.
    gateway_hosts_file: Path | None = dataclasses.field(
        default_factory=lambda: Path(p) if (p := os.environ.get("SPACE_GATEWAY_HOSTS_FILE")) else None)
    #: The private ranges (CIDRs) egress policies may open on this node: the deployment's ceiling
    #: (a tenant's, set by the operator, only narrows it). Empty: none.
    egress_ceiling: tuple[str, ...] = ()
    #: The resolver the gateway asks for names (``IP[:PORT]``, ``$SPACE_GATEWAY_UPSTREAM_DNS``);
    #: default: the system's.
    gateway_upstream_dns: str | None = dataclasses.field(
        default_factory=lambda: os.environ.get("SPACE_GATEWAY_UPSTREAM_DNS") or None)
    #: TEST ONLY: CA certificates (PEM) the gateway trusts for upstream servers, besides the system's.
    gateway_upstream_ca: Path | None = dataclasses.field(
        default_factory=lambda: Path(p) if (p := os.environ.get("SPACE_GATEWAY_UPSTREAM_CA")) else None)


def channel_dir_for(data_dir: Path) -> Path:
    """Shim sockets live in a short path: unix socket paths are limited to 107 bytes."""
    import hashlib

    h = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]
    return Path("/run/space") / h


@dataclasses.dataclass
class Node:
    pool: Pool
    templates: TemplateStore
    manager: SandboxManager
    warm: WarmPool
    #: The root helper this agent started before dropping root (None: the agent stayed root).
    helper: HelperProcess | None = None


def node_user(settings: NodeSettings) -> ServiceUser | None:
    """Who the agent becomes once its helper runs; None: it stays root (logged)."""
    if os.geteuid() != 0:
        raise PrivilegeError("the node agent must start as root: it starts the root helper, then drops")
    try:
        pw = pwd.getpwnam(settings.user)
    except KeyError:
        log.warning("node.runs_as_root", user=settings.user, reason="no such user",
                    fix="scripts/setup-system.sh creates it (`make setup`)")
        return None
    if pw.pw_uid == 0:
        log.warning("node.runs_as_root", user=settings.user,
                    hint="every node operation then runs with root privileges; use --user space-node")
        return None
    return ServiceUser(name=pw.pw_name, uid=pw.pw_uid, gid=pw.pw_gid, home=pw.pw_dir)


def prepare_channel_dir(settings: NodeSettings, owner: ServiceUser | None) -> None:
    """The short-path directory of the node's sockets (node API, shims, gateway control, helper),
    the agent's own: 0710 with the API's group when one may use the node socket, else 0700."""
    d = channel_dir_for(settings.data_dir)
    d.mkdir(parents=True, exist_ok=True)
    uid = owner.uid if owner is not None else 0
    os.chown(d, uid, settings.socket_group if settings.socket_group is not None else (owner.gid if owner else 0))
    os.chmod(d, 0o700 if settings.socket_group is None else 0o710)
    if owner is not None:
        # Shims started by an agent that ran as root (before an upgrade) keep serving their
        # sandboxes' channels: their sockets become the agent's, or it could not reach them.
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for name in os.listdir(fd):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISSOCK(st.st_mode) and name not in ("node.sock", "gateway.sock") and st.st_uid == 0:
                    os.chown(name, owner.uid, owner.gid, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)


async def build_node(settings: NodeSettings) -> Node:
    """Open the pool and start the root helper (as root), hand the agent its state and drop to the
    node user, then bring up the node's parts through the helper."""
    # First: a host whose cgroups cannot hold sandboxes (CgroupsUnsupported says what is missing)
    # stops the node before it touches anything; the helper detects the same at its own start.
    cg = cgroups.host()
    log.info("node.cgroups", version=cg.version, root=str(cg.root))
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    pool = await Pool.open(settings.data_dir, size_gb=settings.pool_size_gb)
    user = node_user(settings)
    ctx = helper_context(settings, pool.root, agent=user)
    helper = None
    priv: Privileged
    if user is not None:
        helper = HelperProcess(ctx, channel_dir_for(settings.data_dir) / "helper" / "helper.sock",
                               agent_uid=user.uid, socket_gid=user.gid)
        priv = await helper.start()
        try:
            give_node_state(settings.data_dir, pool.root, settings.cache_dir, user.uid, user.gid)
            prepare_channel_dir(settings, user)
            drop_privileges(user, groups=os.getgrouplist(user.name, user.gid))
            if settings.die_with_parent:
                _die_with_parent()  # a change of credentials clears the parent-death signal
            require_code_access(user)
            require_access(user, [settings.data_dir], os.X_OK, "its data directory")
            require_access(user, [pool.root / a for a in AGENT_AREAS] + [channel_dir_for(settings.data_dir)]
                           + [settings.cache_dir / c for c in AGENT_CACHE], os.R_OK | os.W_OK | os.X_OK,
                           "its state")
        except BaseException:
            await helper.stop()
            raise
    else:
        prepare_channel_dir(settings, None)
        priv = InProcess(ctx)
    pool.priv = priv
    size = (await pool.usage())["size_bytes"]
    await pool.enable_quotas(settings.pool_reserve_mb << 20 if settings.pool_reserve_mb is not None
                             else default_reserve(size))
    objects = (ObjectStore.from_url(settings.object_store_url, env=settings.object_store_env)
               if settings.object_store_url else None)
    templates = TemplateStore(pool, settings.cache_dir, objects=objects,
                              keys=settings.manifest_keys if objects is not None else None)
    driver = GVisorDriver(priv, pool.root, lease_file=lease_end_file(settings), cgroups=cg)
    egress = await start_egress(settings, priv) if settings.network else None
    if egress is not None:
        templates.build_net = build_net.BuildNetwork(egress, mirrors=settings.build_mirrors,
                                                     extra=settings.build_egress)
    manager = SandboxManager(
        pool, templates, driver, guest_dir=ctx.guest, channel_dir=channel_dir_for(settings.data_dir),
        objects=objects, egress=egress, default_disk_mb=settings.sandbox_disk_mb,
    )
    manager.data_keys = settings.data_keys
    await manager.recover()
    warm = WarmPool(manager, warm_pool_file(settings.data_dir), concurrency=settings.warm_concurrency)
    await warm.adopt()
    return Node(pool, templates, manager, warm, helper)


def lease_end_file(settings: NodeSettings) -> Path | None:
    """Where the agent publishes its lease's end for the shims (None: this node has no lease)."""
    return node_state_dir(settings.data_dir) / "lease-end" if settings.fence_after else None


def warm_pool_file(data_dir: Path) -> Path:
    state = node_state_dir(data_dir)
    state.mkdir(mode=0o700, exist_ok=True)
    old = data_dir / "warm-pool.json"
    if old.exists() and not (state / old.name).exists():
        os.replace(old, state / old.name)  # where it was before the agent dropped root
    return state / old.name


def node_privileged(settings: NodeSettings, pool_root: Path) -> Privileged:
    """Privileged verbs in this (root) process: ``space node teardown``."""
    return InProcess(helper_context(settings, pool_root))


def helper_context(settings: NodeSettings, pool_root: Path, *, agent: ServiceUser | None = None) -> HelperContext:
    gateway = None
    if settings.network:
        gateway = GatewayConfig(control=channel_dir_for(settings.data_dir) / "gateway.sock",
                                ca_dir=settings.egress_ca_dir or settings.data_dir / "egress-ca",
                                control_group=agent.gid if agent is not None else None,
                                hosts_file=settings.gateway_hosts_file, upstream_ca=settings.gateway_upstream_ca,
                                upstream_dns=settings.gateway_upstream_dns,
                                private_ceiling=settings.egress_ceiling)
    return HelperContext(data_dir=settings.data_dir, cache_dir=settings.cache_dir, pool_root=pool_root,
                         guest_dir=guest_dir(settings.data_dir), gateway_ports=GatewayPorts().as_tuple(),
                         gateway=gateway,
                         agent_uid=agent.uid if agent is not None else None, mirrors=settings.build_mirrors,
                         registries=settings.build_registries, build_max_bytes=settings.build_max_bytes,
                         image_policy=settings.build_image_policy, signatures=settings.build_signatures,
                         sandbox_network=parse_sandbox_network(settings.sandbox_network))


def make_egress(settings: NodeSettings, priv: Privileged) -> Egress:
    network = Network(settings.data_dir, priv)
    gateway = GatewayHandle(priv, channel_dir_for(settings.data_dir) / "gateway.sock",
                            settings.egress_ca_dir or settings.data_dir / "egress-ca")
    return Egress(network, gateway)


async def start_egress(settings: NodeSettings, priv: Privileged) -> Egress:
    egress = make_egress(settings, priv)
    await egress.network.setup()
    await egress.gateway.ensure()
    return egress


async def serve_node(settings: NodeSettings) -> None:
    if settings.die_with_parent:
        _die_with_parent()
    files = None
    if settings.join is not None:
        # First, as root: a node that cannot join starts nothing; its files are the agent's after the
        # drop (give_node_state hands it the node state tree).
        files = await membership.join(settings.join, settings.node_id,
                                      NodeTLSFiles.under(node_state_dir(settings.data_dir)))
    if leaving.clear(settings.data_dir):
        # A node whose agent starts again is here again: its last pod's leaving is over.
        log.info("node.leaving_withdrawn", reason="the agent started again")
    node = await build_node(settings)
    templates, manager, warm = node.templates, node.manager, node.warm
    fence = Fence(manager, lease=settings.fence_after, state_file=node_state_dir(settings.data_dir) / "lease.json",
                  lease_file=lease_end_file(settings) or node_state_dir(settings.data_dir) / "lease-end")
    app = create_node_app(
        node_id=settings.node_id,
        token=settings.token if settings.join is None else None,
        manager=manager,
        templates=templates,
        max_upload_bytes=settings.max_upload_bytes,
        sse_keepalive=settings.sse_keepalive,
        warm=warm,
        fence=fence,
        leaving=leaving.Heartbeats(settings.data_dir),
    )
    if settings.socket is not None:
        # uvicorn makes the socket world-writable: the 0700 (0710 with a group) directory guards it
        # (prepare_channel_dir; the socket normally lives there).
        settings.socket.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            settings.socket.unlink()
        config = uvicorn.Config(app, uds=str(settings.socket), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5)
    else:
        assert settings.listen and files is not None
        host, _, port = settings.listen.rpartition(":")
        config = uvicorn.Config(app, host=host or "127.0.0.1", port=int(port), log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                                ssl_certfile=str(files.cert), ssl_keyfile=str(files.key))
        config.load()
        # The cluster's context (client certificates from the cluster CA required), not the one
        # uvicorn builds from its options, which knows no client authentication policy of ours.
        config.ssl = files.server_context()
    server = GracefulServer(config)
    log.info("node.serving", node=settings.node_id, socket=str(settings.socket), listen=settings.listen)
    monitor = asyncio.create_task(manager.monitor())
    gateway_watch = asyncio.create_task(manager.watch_gateway())
    reserve = asyncio.create_task(manager.keep_reserve())
    backups = asyncio.create_task(manager.backups.run())
    fencing = asyncio.create_task(fence.watch())
    refill = asyncio.create_task(warm.run())
    serving = asyncio.create_task(server.serve())
    helper_watch = asyncio.create_task(_exit_with_helper(node.helper, server))
    try:
        await serving
        if helper_watch.done() and helper_watch.result():
            raise SystemExit(3)  # the supervisor restarts us, and we start a new helper
    finally:
        # Stopping in order from here on: a further SIGTERM (a container runtime signals every
        # process it finds, this one again among them) must not cut that short with its default action.
        loop = asyncio.get_running_loop()
        guarded = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(RuntimeError, ValueError):  # not the main thread: nothing to guard
                loop.add_signal_handler(sig, log.info, "node.signal_ignored")
                guarded.append(sig)
        try:
            for task in (helper_watch, reserve, backups, fencing, monitor, refill, gateway_watch):
                task.cancel()
            await asyncio.gather(monitor, refill, gateway_watch, reserve, backups, fencing, return_exceptions=True)
            await warm.close()
            await manager.close()
            if settings.socket is not None:
                settings.socket.unlink(missing_ok=True)
            if node.helper is not None:
                await node.helper.stop()
        finally:
            # Stopped: the signals are the process's again (a loop that outlives this call, as a
            # test runner's does, must not go on swallowing them).
            for sig in guarded:
                loop.remove_signal_handler(sig)


async def _exit_with_helper(helper: HelperProcess | None, server: uvicorn.Server) -> bool:
    """Stop serving if the root helper dies: without it this agent can do nothing, and an
    unprivileged agent cannot start another one."""
    if helper is None:
        return False
    code = await helper.wait()
    log.error("helper.died", returncode=code)
    server.should_exit = True
    return True


async def teardown_node(data_dir: Path, cache_dir: Path = Path("/var/cache/space")) -> int:
    """Remove every sandbox of this node and release its pool (unmount, detach the loop device)."""
    pool = await Pool.open(data_dir)
    settings = NodeSettings(data_dir=data_dir, cache_dir=cache_dir, socket=None, listen=None, token="")
    priv = pool.priv = node_privileged(settings, pool.root)
    driver = GVisorDriver(priv, pool.root)
    manager = SandboxManager(
        pool, TemplateStore(pool, cache_dir), driver, guest_dir=guest_dir(data_dir),
        channel_dir=channel_dir_for(data_dir),
    )
    await manager.recover()
    n = 0
    for sb in manager.list_all():
        await manager.delete(sb.id)
        n += 1
    await manager.close()
    from space.node.helper import build_sandbox  # root's code: teardown runs the verbs in-process

    await build_sandbox.sweep(helper_context(settings, pool.root))  # a build cut short by the stop
    egress = make_egress(settings, priv)
    await egress.gateway.stop()
    await egress.network.teardown()
    await pool.teardown()
    from space.node.helper import placement

    placement.remove_empty_shim_groups()  # unless another node's shims are in them
    # The short-path directory of this node's sockets (node API, shims) goes with it.
    shutil.rmtree(channel_dir_for(data_dir), ignore_errors=True)
    return n


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def run(settings: NodeSettings) -> None:
    if os.geteuid() == 0:
        from space.node.helper import placement

        if placement.enter_host_cgroup_namespace():
            log.info("node.host_cgroup_namespace", reason="sandboxes are placed in cgroups outside the pod's")
    asyncio.run(serve_node(settings))
