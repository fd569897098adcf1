"""The node agent process: opens the pool, adopts live sandboxes, serves the node API."""

from __future__ import annotations

import asyncio
import compileall
import contextlib
import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
from pathlib import Path

import structlog
import uvicorn

from space import guest as guest_pkg
from space.node.app import create_node_app
from space.node.egress import Egress
from space.node.gateway import GatewayHandle
from space.node.helper.backend import InProcess, Privileged
from space.node.helper.verbs import GatewayConfig, HelperContext
from space.node.network import GatewayPorts, Network
from space.node.pool import Pool
from space.node.sandboxes import SandboxManager
from space.node.templates import TemplateStore
from space.node.warm import WarmPool
from space.objstore import ObjectStore
from space.runtime.gvisor import GVisorDriver

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
    #: Bearer token the control plane must present.
    token: str
    node_id: str = "node-1"
    #: Host-wide cache of debootstrap downloads and exported template streams.
    cache_dir: Path = Path("/var/cache/space")
    pool_size_gb: int = 64
    max_upload_bytes: int = 1 << 30
    #: Die with the parent process (``space serve``); sandboxes survive in their own sessions.
    die_with_parent: bool = False
    #: Object store for suspended sandboxes and shipped templates: a directory or an ``s3://`` URL.
    object_store_url: str | None = None
    #: Control plane to register with on start (multi-node), with an admin API key.
    register_url: str | None = None
    register_key: str | None = None
    #: Seconds of silence after which an event stream gets an SSE comment (``$SPACE_SSE_KEEPALIVE``).
    #: Warm-pool sandboxes booted at the same time (each boot takes most of a core for ~0.4 s).
    warm_concurrency: int = 1
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
    #: TEST ONLY: a JSON file {name: address} the gateway resolves names with instead of DNS.
    gateway_hosts_file: Path | None = dataclasses.field(
        default_factory=lambda: Path(p) if (p := os.environ.get("SPACE_GATEWAY_HOSTS_FILE")) else None)
    #: TEST ONLY: CA certificates (PEM) the gateway trusts for upstream servers, besides the system's.
    gateway_upstream_ca: Path | None = dataclasses.field(
        default_factory=lambda: Path(p) if (p := os.environ.get("SPACE_GATEWAY_UPSTREAM_CA")) else None)


def channel_dir_for(data_dir: Path) -> Path:
    """Shim sockets live in a short path: unix socket paths are limited to 107 bytes."""
    import hashlib

    h = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]
    return Path("/run/space") / h


def guest_dir() -> Path:
    """The guest daemon's directory (bind-mounted read-only into every sandbox), bytecode compiled."""
    d = Path(guest_pkg.__file__).resolve().parent
    # The sandbox cannot write __pycache__ (read-only mount): compile here, once per node start.
    compileall.compile_dir(str(d), quiet=1, maxlevels=0)
    _build_spawn_helper(d)
    return d


def _build_spawn_helper(d: Path) -> None:
    """Build the guest's static exec wrapper (space-spawn) when missing or older than its source.
    Without a compiler the guest falls back to setpriv (slower, same behaviour)."""
    src, out = d / "spawn.c", d / "space-spawn"
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("guest.spawn_helper_unavailable", reason="no C compiler")
        return
    tmp = d / f".space-spawn.{os.getpid()}"
    res = subprocess.run([cc, "-O2", "-static", "-o", str(tmp), str(src)], capture_output=True, text=True)
    if res.returncode != 0:
        log.warning("guest.spawn_helper_build_failed", stderr=res.stderr[-500:])
        tmp.unlink(missing_ok=True)
        return
    os.replace(tmp, out)


async def build_node(settings: NodeSettings) -> tuple[Pool, TemplateStore, SandboxManager, WarmPool]:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    pool = await Pool.open(settings.data_dir, size_gb=settings.pool_size_gb)
    objects = ObjectStore.from_url(settings.object_store_url) if settings.object_store_url else None
    templates = TemplateStore(pool, settings.cache_dir, objects=objects)
    priv = pool.priv = node_privileged(settings, pool.root)
    driver = GVisorDriver(priv, pool.root)
    egress = await start_egress(settings, priv) if settings.network else None
    manager = SandboxManager(
        pool, templates, driver, guest_dir=guest_dir(), channel_dir=channel_dir_for(settings.data_dir),
        objects=objects, egress=egress,
    )
    await manager.recover()
    warm = WarmPool(manager, settings.data_dir / "warm-pool.json", concurrency=settings.warm_concurrency)
    await warm.adopt()
    return pool, templates, manager, warm


def node_privileged(settings: NodeSettings, pool_root: Path) -> Privileged:
    """How this agent runs privileged verbs: in this (root) process until the agent drops root."""
    return InProcess(helper_context(settings, pool_root))


def helper_context(settings: NodeSettings, pool_root: Path) -> HelperContext:
    gateway = None
    if settings.network:
        gateway = GatewayConfig(control=channel_dir_for(settings.data_dir) / "gateway.sock",
                                ca_dir=settings.egress_ca_dir or settings.data_dir / "egress-ca",
                                hosts_file=settings.gateway_hosts_file, upstream_ca=settings.gateway_upstream_ca)
    return HelperContext(data_dir=settings.data_dir, cache_dir=settings.cache_dir, pool_root=pool_root,
                         guest_dir=guest_dir(), gateway_ports=GatewayPorts().as_tuple(), gateway=gateway)


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
    _pool, templates, manager, warm = await build_node(settings)
    app = create_node_app(
        node_id=settings.node_id,
        token=settings.token,
        manager=manager,
        templates=templates,
        max_upload_bytes=settings.max_upload_bytes,
        sse_keepalive=settings.sse_keepalive,
        warm=warm,
    )
    if settings.socket is not None:
        # uvicorn makes the socket world-writable: the 0700 (0710 with a group) directory guards it.
        settings.socket.parent.mkdir(parents=True, exist_ok=True)
        if settings.socket_group is None:
            os.chmod(settings.socket.parent, 0o700)
        else:
            os.chown(settings.socket.parent, 0, settings.socket_group)
            os.chmod(settings.socket.parent, 0o710)
        with contextlib.suppress(FileNotFoundError):
            settings.socket.unlink()
        config = uvicorn.Config(app, uds=str(settings.socket), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5)
    else:
        assert settings.listen
        host, _, port = settings.listen.rpartition(":")
        config = uvicorn.Config(app, host=host or "127.0.0.1", port=int(port), log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    log.info("node.serving", node=settings.node_id, socket=str(settings.socket), listen=settings.listen)
    monitor = asyncio.create_task(manager.monitor())
    gateway_watch = asyncio.create_task(manager.watch_gateway())
    refill = asyncio.create_task(warm.run())
    serving = asyncio.create_task(server.serve())
    try:
        if settings.register_url:
            while not server.started and not serving.done():
                await asyncio.sleep(0.02)
            await register_node(settings)
        await serving
    finally:
        monitor.cancel()
        refill.cancel()
        gateway_watch.cancel()
        await asyncio.gather(monitor, refill, gateway_watch, return_exceptions=True)
        await warm.close()
        await manager.close()
        if settings.socket is not None:
            settings.socket.unlink(missing_ok=True)


async def register_node(settings: NodeSettings) -> None:
    """Tell the control plane where this node is (idempotent: a restart registers again)."""
    import httpx

    assert settings.listen and settings.register_url
    body = {"id": settings.node_id, "url": f"http://{settings.listen}", "token": settings.token}
    async with httpx.AsyncClient(base_url=settings.register_url, timeout=30) as http:
        resp = await http.post("/v1/nodes", json=body,
                               headers={"authorization": f"Bearer {settings.register_key}"})
    if resp.status_code >= 300:
        raise RuntimeError(f"registering with {settings.register_url} failed: {resp.status_code} {resp.text[:300]}")
    log.info("node.registered", node=settings.node_id, control_plane=settings.register_url)


async def teardown_node(data_dir: Path, cache_dir: Path = Path("/var/cache/space")) -> int:
    """Remove every sandbox of this node and release its pool (unmount, detach the loop device)."""
    pool = await Pool.open(data_dir)
    settings = NodeSettings(data_dir=data_dir, cache_dir=cache_dir, socket=None, listen=None, token="")
    priv = pool.priv = node_privileged(settings, pool.root)
    driver = GVisorDriver(priv, pool.root)
    manager = SandboxManager(
        pool, TemplateStore(pool, cache_dir), driver, guest_dir=guest_dir(),
        channel_dir=channel_dir_for(data_dir),
    )
    await manager.recover()
    n = 0
    for sb in manager.list_all():
        await manager.delete(sb.id)
        n += 1
    await manager.close()
    egress = make_egress(settings, priv)
    await egress.gateway.stop()
    await egress.network.teardown()
    await pool.teardown()
    # The short-path directory of this node's sockets (node API, shims) goes with it.
    shutil.rmtree(channel_dir_for(data_dir), ignore_errors=True)
    return n


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def run(settings: NodeSettings) -> None:
    asyncio.run(serve_node(settings))
