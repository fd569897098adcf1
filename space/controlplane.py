"""``space api`` and ``space controller``: the control plane as separate, replicated processes.

Any number of each run against one PostgreSQL database and one object store; none keeps state of
its own beyond caches. They share:

- the database (the one source of truth; operations are claimed in order per target, leased and
  fenced; one controller is the leader and runs the singletons: :mod:`space.controller`);
- wake-ups through the database (``LISTEN``/``NOTIFY``: :mod:`space.store.wakeups`);
- the shared keys (:mod:`space.cluster.keys`), given to every replica alike;
- the nodes, which joined with join tokens and are called over mutual TLS with a client
  certificate each process mints from the cluster CA (:mod:`space.cluster.identity`).

``space serve`` is the same parts in one process tree, with a node of its own, on SQLite.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog
import uvicorn

from space import childenv
from space.cluster.identity import ControlPlaneTLS
from space.cluster.keys import SharedKeyError, SharedKeys
from space.config import DEFAULT_QUOTA
from space.controller import Controller, NodeRegistry
from space.credentials import BackendConfig, Backends, CredentialManager
from space.egress_policy import DEFAULT_SANDBOX_NETWORK
from space.node.templates.store import BASE_SPEC
from space.objstore import ObjectStore
from space.store import Store, quotas
from space.store.db import normalize_url
from space.store.wakeups import LocalWakeups

if TYPE_CHECKING:
    from space.api.state import AppState

log = structlog.get_logger("space.controlplane")

#: Templates the control plane knows how to build from a spec of its own.
TEMPLATE_SPECS: dict[str, dict[str, Any]] = {"base": BASE_SPEC}


class StartupError(Exception):
    """This replica cannot start; the message says what to give it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclasses.dataclass
class ControlPlaneSettings:
    database_url: str
    object_store_url: str
    #: A directory holding the shared keys (a mounted Secret); the environment may give each instead.
    keys_dir: Path | None = None
    #: ``HOST:PORT`` the API listens on (``space api``).
    listen: str = "0.0.0.0:8080"
    #: Serve HTTPS with this certificate chain and key (PEM files); None: plain HTTP, for a load
    #: balancer or ingress that terminates TLS. Nodes join only over https (or loopback http).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    max_upload_bytes: int = 1 << 30
    sandbox_disk_mb: int = 10240
    operator_tenant: str = "default"
    egress_ceiling: tuple[str, ...] = ()
    #: The deployment's sandbox address ranges (every node's --sandbox-network).
    sandbox_networks: tuple[str, ...] = (DEFAULT_SANDBOX_NETWORK,)
    e2b_domain: str | None = None
    default_quota: dict[str, Any] | None = None
    bootstrap_templates: tuple[str, ...] = ("base",)
    lease_seconds: float = 10.0
    #: A file the controller touches every few seconds while its event loop turns (a liveness probe
    #: compares its age: a wedged controller is restarted).
    health_file: Path | None = None
    #: Seconds between continuous-backup looks for sandboxes whose policy does not say (None: off).
    backup_every: float | None = 45.0
    #: Snapshots and backups encrypted under their tenant's key (nodes need --kek-file or a KMS).
    encrypt_objects: bool = True


@dataclasses.dataclass
class ControlPlane:
    """What one replica holds open."""

    store: Store
    wakeups: LocalWakeups
    nodes: NodeRegistry
    controller: Controller
    keys: SharedKeys
    credentials: CredentialManager


def check_database_url(url: str) -> str:
    if normalize_url(url).get_backend_name() != "postgresql":
        raise StartupError("the replicated control plane shares one PostgreSQL database "
                           "(--database-url postgresql+asyncpg://…); on one machine, SQLite is `space serve`'s")
    return url


@contextlib.asynccontextmanager
async def open_control_plane(settings: ControlPlaneSettings, role: Literal["api", "controller"],
                             env: Mapping[str, str]) -> AsyncIterator[ControlPlane]:
    """Keys first (a replica missing one stops before it touches anything), then the database."""
    check_database_url(settings.database_url)
    try:
        keys = SharedKeys.load(env, settings.keys_dir)
    except SharedKeyError as e:
        raise StartupError(e.message) from None
    store = await Store.open(settings.database_url)
    wakeups = store.wakeups()
    nodes = NodeRegistry(store, tls=ControlPlaneTLS(keys.cluster_ca, role))
    credentials = CredentialManager(store, Backends.from_config(BackendConfig.from_env(env), keys.keyring))
    try:
        await wakeups.start()
        objects = ObjectStore.from_url(settings.object_store_url, env=env)
        controller = Controller(store, nodes, lease_seconds=settings.lease_seconds, template_specs=TEMPLATE_SPECS,
                                objects=objects, wakeups=wakeups, backup_every=settings.backup_every,
                                operator_tenant=settings.operator_tenant, encrypt_objects=settings.encrypt_objects)
        controller.lifecycle.credentials = credentials
        yield ControlPlane(store, wakeups, nodes, controller, keys, credentials)
    finally:
        await credentials.aclose()
        await nodes.aclose()
        await wakeups.close()
        await store.close()


async def seed_quotas(store: Store, settings: ControlPlaneSettings) -> None:
    """As ``space serve`` does: the command line's defaults replace the stored ones; without it, a
    new deployment gets :data:`DEFAULT_QUOTA`; the operator's tenant starts unlimited."""
    if settings.default_quota is not None:
        await store.put_quota(quotas.DEFAULTS, settings.default_quota)
    else:
        await store.seed_quota(quotas.DEFAULTS, DEFAULT_QUOTA)
    await store.seed_quota(settings.operator_tenant, {})


async def serve_api(settings: ControlPlaneSettings) -> None:
    """One API replica: stateless, no node of its own; readiness at ``/readyz``."""
    from space.api.app import create_app
    from space.api.state import AppState
    from space.egress_policy import parse_ceiling, parse_sandbox_network
    from space.httpserver import BoundedHttp
    from space.web import GracefulServer

    env = childenv.snapshot()
    childenv.confine_self("api")
    async with open_control_plane(settings, "api", env) as cp:
        await seed_quotas(cp.store, settings)
        await seed_admin_key(cp.store, settings.operator_tenant, env)
        state = AppState(store=cp.store, nodes=cp.nodes, controller=cp.controller, secret=cp.keys.signing,
                         max_upload_bytes=settings.max_upload_bytes, credentials=cp.credentials,
                         sandbox_disk_mb=settings.sandbox_disk_mb, operator_tenant=settings.operator_tenant,
                         egress_ceiling=parse_ceiling(settings.egress_ceiling),
                         sandbox_networks=tuple(parse_sandbox_network(n) for n in settings.sandbox_networks),
                         e2b_domain=settings.e2b_domain.lower() if settings.e2b_domain else None,
                         cluster_ca=cp.keys.cluster_ca)
        await bootstrap_templates(state, settings.bootstrap_templates, settings.operator_tenant)
        host, _, port = settings.listen.rpartition(":")
        tls = settings.tls_cert_file is not None
        server = GracefulServer(uvicorn.Config(
            create_app(state), host=host or "0.0.0.0", port=int(port), log_level="warning", access_log=False,
            lifespan="off", timeout_graceful_shutdown=5, http=BoundedHttp,
            ssl_certfile=str(settings.tls_cert_file) if tls else None,
            ssl_keyfile=str(settings.tls_key_file) if tls else None))
        log.info("api.listening", url=f"{'https' if tls else 'http'}://{settings.listen}")
        try:
            await server.serve()
        finally:
            await state.audit.aclose()


async def bootstrap_templates(state: AppState, names: Iterable[str], tenant: str) -> None:
    """Build the configured templates (``base``) that are missing, failed, or ready from another spec
    than this version's (an upgrade that changed the spec, e.g. base's sudo: the template's digest
    names its spec, so the old build is not this one)."""
    from space.api.templates import queue_build
    from space.errors import NotFound
    from space.node.templates.store import spec_digest

    for name in names:
        spec = TEMPLATE_SPECS.get(name)
        if spec is None:
            continue
        try:
            current = await state.store.get_template(name)
            if current.status == "ready" and current.digest == spec_digest(spec):
                continue
            why = f"{current.status}, {current.digest[:16]}"
        except NotFound:
            why = "missing"
        op, _ = await queue_build(state, name, spec, tenant=tenant)
        log.info("template.bootstrap_build", template=name, operation=op.id, was=why)


async def run_controller(settings: ControlPlaneSettings) -> None:
    """One controller: claims operations; leads (reconcile, heartbeats, policies) when elected."""
    env = childenv.snapshot()
    childenv.confine_self("api")
    async with open_control_plane(settings, "controller", env) as cp:
        beat = asyncio.create_task(_touch_health(settings.health_file)) if settings.health_file else None
        try:
            await _until_stopped(_controller_work(cp))
        finally:
            if beat is not None:
                beat.cancel()


async def _controller_work(cp: ControlPlane) -> None:
    await cp.controller.sync_templates()
    await cp.controller.run()


async def _until_stopped(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` until it ends or SIGTERM/SIGINT asks this process to stop; then cancel it and
    let it unwind (its operations' leases are released, not left to lapse). Handled here, not by
    the signals' default action: as a container's first process (PID 1) this process gets no
    default action at all, and would ignore a SIGTERM until the runtime's SIGKILL."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            log.info("controller.stopping", reason="signal")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        else:
            task.result()
    finally:
        stopping.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


#: Seconds between touches of the controller's health file.
HEALTH_EVERY = 5.0


async def _touch_health(path: Path) -> None:
    while True:
        try:
            await asyncio.to_thread(path.touch)
        except OSError as e:
            log.warning("controller.health_file_failed", path=str(path), error=e.strerror)
        await asyncio.sleep(HEALTH_EVERY)


#: ``$SPACE_BOOTSTRAP_ADMIN_KEY``: the operator's first admin key, given to the API replicas, which
#: store it (hashed) if the deployment has no key at all. Once any key exists it is ignored.
BOOTSTRAP_KEY_ENV = "SPACE_BOOTSTRAP_ADMIN_KEY"
#: ... or a file holding it (a mounted Secret that may be absent: then there is none).
BOOTSTRAP_KEY_FILE_ENV = "SPACE_BOOTSTRAP_ADMIN_KEY_FILE"


def bootstrap_key(env: Mapping[str, str]) -> str:
    """The first admin key from ``$SPACE_BOOTSTRAP_ADMIN_KEY``, else from the file
    ``$SPACE_BOOTSTRAP_ADMIN_KEY_FILE`` names (missing: no key)."""
    key = env.get(BOOTSTRAP_KEY_ENV, "").strip()
    file = env.get(BOOTSTRAP_KEY_FILE_ENV, "").strip()
    if key or not file:
        return key
    try:
        return read_small_file(Path(file), "the bootstrap admin key").strip()
    except FileNotFoundError:
        return ""


#: The most a file holding one secret value (a key, a database URL) may hold.
MAX_SECRET_FILE = 64 * 1024


def read_small_file(path: Path, what: str) -> str:
    """A secret value mounted as a file (a Kubernetes Secret), bounded; FileNotFoundError if absent."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_FILE + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise StartupError(f"cannot read {what} from {path}: {e.strerror}") from None
    if len(data) > MAX_SECRET_FILE:
        raise StartupError(f"{path} is larger than {MAX_SECRET_FILE} bytes: not {what}")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise StartupError(f"{path} is not UTF-8 text: not {what}") from None


async def seed_admin_key(store: Store, tenant: str, env: Mapping[str, str]) -> None:
    key = bootstrap_key(env)
    if not key:
        if await store.count_api_keys() == 0:
            log.warning("admin_key.none", hint=f"no API key exists: give the replicas ${BOOTSTRAP_KEY_ENV} "
                                                "(sk_ and at least 32 characters) to make the first admin key")
        return
    if not key.startswith("sk_") or len(key) < 35:
        raise StartupError(f"${BOOTSTRAP_KEY_ENV} must be sk_ followed by at least 32 characters")
    if await store.seed_admin_key(tenant, key):
        log.info("admin_key.seeded", tenant=tenant)


def run(role: Literal["api", "controller"], settings: ControlPlaneSettings) -> None:
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_api(settings) if role == "api" else run_controller(settings))
    except StartupError as e:
        log.error(f"{role}.refused", error=e.message)
        raise SystemExit(2) from None
