"""Server-side commands: ``space serve`` and ``space node run|teardown``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

import typer

node_app = typer.Typer(help="Run or clean up a node agent (node-local services).", no_args_is_help=True)

DataDir = Annotated[Path, typer.Option("--data-dir", help="Where SPACE keeps its state.",
                                       envvar="SPACE_DATA_DIR")]
CacheDir = Annotated[Path, typer.Option("--cache-dir", help="Host-wide cache of template builds.",
                                        envvar="SPACE_CACHE_DIR")]


def serve(
    data_dir: DataDir = Path("/var/lib/space"),
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT of the API.", envvar="SPACE_LISTEN")]
    = "127.0.0.1:8080",
    database_url: Annotated[str | None, typer.Option("--database-url", envvar="SPACE_DATABASE_URL",
                                                     help="SQLAlchemy URL (default: SQLite in the data dir).")]
    = None,
    object_store_url: Annotated[str | None, typer.Option("--object-store-url", envvar="SPACE_OBJECT_STORE_URL")]
    = None,
    cache_dir: CacheDir = Path("/var/cache/space"),
    pool_size_gb: Annotated[int, typer.Option("--pool-size-gb", help="btrfs loop file size.")] = 64,
    pool_reserve_mb: Annotated[int | None, typer.Option(
        "--pool-reserve-mb", min=0,
        help="MiB of the pool no sandbox may fill, kept for snapshots and the node's own work "
             "(default: 5 %, at least 1 GiB).")] = None,
    sandbox_disk_mb: Annotated[int, typer.Option(
        "--sandbox-disk-mb", min=16,
        help="Disk limit of a sandbox created without one (MiB; at most its tenant's disk_mb quota).")] = 10240,
    default_quota: Annotated[str | None, typer.Option(
        "--default-quota", envvar="SPACE_DEFAULT_QUOTA",
        help="Limits of every tenant whose own were never set, e.g. 'sandboxes=20,cpu=16,memory_mb=32768,"
             "storage_mb=51200,disk_mb=51200' ('none' for a limit: unlimited); replaces the stored "
             "defaults at start (default: keep them; a new deployment starts with those above).")] = None,
    max_upload_mb: Annotated[int, typer.Option("--max-upload-mb", help="Largest file upload.")] = 1024,
    no_bootstrap: Annotated[bool, typer.Option("--no-bootstrap", help="Don't build 'base' on first start.")]
    = False,
    warm_pool: Annotated[int, typer.Option(
        "--warm-pool", min=0, help="Warm 'base' sandboxes to keep on first start (then: space pool set).")] = 2,
    operator_tenant: Annotated[str, typer.Option(
        "--operator-tenant", envvar="SPACE_OPERATOR_TENANT",
        help="Tenant whose admin keys manage every tenant (the bootstrap admin key's).")] = "default",
    network: Annotated[bool, typer.Option(
        "--network/--no-network",
        help="Sandboxes in their own network namespaces behind the egress gateway (off: loopback only).")]
    = True,
    user: Annotated[str, typer.Option(
        "--user", envvar="SPACE_USER",
        help="Run the API and controller as this user once the node agent (root) is started; "
             "'root' keeps them root.")] = "space",
    egress_private: Annotated[list[str] | None, typer.Option(
        "--egress-private", envvar="SPACE_EGRESS_PRIVATE", metavar="CIDR",
        help="A private range sandbox egress policies may open (repeatable; the deployment's ceiling, "
             "narrowed per tenant by the operator). None by default.")] = None,
    e2b_domain: Annotated[str | None, typer.Option(
        "--e2b-domain", envvar="SPACE_E2B_DOMAIN",
        help="Also route E2B host names <port>-<sandbox id>.<domain> to sandboxes (needs wildcard DNS).")]
    = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
) -> None:
    """Run the whole platform (API, controller, one node) on embedded defaults."""
    from space import logs
    from space.config import ServeSettings
    from space.serve import run

    logs.configure(log_level)
    ceiling = _ceiling(egress_private)
    run(ServeSettings(
        data_dir=data_dir, listen=listen, database_url=database_url, object_store_url=object_store_url,
        cache_dir=cache_dir, pool_size_gb=pool_size_gb, max_upload_bytes=max_upload_mb * 1024 * 1024,
        pool_reserve_mb=pool_reserve_mb, sandbox_disk_mb=sandbox_disk_mb,
        default_quota=parse_quota(default_quota) if default_quota is not None else None,
        bootstrap_templates=() if no_bootstrap else ("base",), warm_pool=warm_pool,
        operator_tenant=operator_tenant, network=network, user=user, e2b_domain=e2b_domain,
        egress_ceiling=ceiling,
    ))


def _ceiling(entries: list[str] | None) -> tuple[str, ...]:
    """The ``--egress-private`` ranges, checked now (a bad one stops the start with its reason)."""
    from space.egress_policy import parse_ceiling
    from space.errors import InvalidRequest

    try:
        return tuple(str(n) for n in parse_ceiling(entries))
    except InvalidRequest as e:
        raise typer.BadParameter(e.message, param_hint="--egress-private") from None


def parse_quota(spec: str) -> dict[str, int | float | None]:
    """``name=value,...`` (value a number or ``none``) into limits; BadParameter names what is wrong."""
    from space.store.quotas import LIMIT_FIELDS

    out: dict[str, int | float | None] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if not sep or name not in LIMIT_FIELDS:
            raise typer.BadParameter(f"{item!r}: expected NAME=VALUE with NAME one of {', '.join(LIMIT_FIELDS)}",
                                     param_hint="--default-quota")
        try:
            number = None if value == "none" else (float(value) if name == "cpu" else int(value))
        except ValueError:
            raise typer.BadParameter(f"{item!r}: the value must be a number or 'none'",
                                     param_hint="--default-quota") from None
        if number is not None and number < 0:
            raise typer.BadParameter(f"{item!r}: a limit cannot be negative", param_hint="--default-quota")
        out[name] = number
    return out


@node_app.command("run")
def node_run(
    data_dir: DataDir,
    token_file: Annotated[Path, typer.Option("--token-file", help="File holding the node API token.")],
    socket: Annotated[Path | None, typer.Option("--socket", help="Serve on this unix socket.")] = None,
    socket_group: Annotated[int | None, typer.Option(
        "--socket-group", help="GID that may connect to --socket (space serve's unprivileged API).")] = None,
    listen: Annotated[str | None, typer.Option("--listen", help="Serve on HOST:PORT instead.")] = None,
    user: Annotated[str, typer.Option(
        "--user", envvar="SPACE_NODE_USER",
        help="Drop to this user once the root helper runs ('root': keep root).")] = "space-node",
    node_id: Annotated[str, typer.Option("--node-id")] = "node-1",
    cache_dir: CacheDir = Path("/var/cache/space"),
    pool_size_gb: Annotated[int, typer.Option("--pool-size-gb")] = 64,
    pool_reserve_mb: Annotated[int | None, typer.Option(
        "--pool-reserve-mb", min=0,
        help="MiB of the pool no sandbox may fill, kept for snapshots and the node's own work "
             "(default: 5 %, at least 1 GiB).")] = None,
    sandbox_disk_mb: Annotated[int, typer.Option(
        "--sandbox-disk-mb", min=16, help="Disk limit of a sandbox created without one (MiB).")] = 10240,
    max_upload_bytes: Annotated[int, typer.Option("--max-upload-bytes")] = 1 << 30,
    die_with_parent: Annotated[bool, typer.Option("--die-with-parent", hidden=True)] = False,
    object_store_url: Annotated[str | None, typer.Option(
        "--object-store-url", envvar="SPACE_OBJECT_STORE_URL",
        help="Directory or s3:// URL shared by the nodes (suspend/restore, templates).")] = None,
    register: Annotated[str | None, typer.Option(
        "--register", help="Control plane URL to register this node with (needs --listen).")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", help="File holding an admin API key, for --register.")] = None,
    network: Annotated[bool, typer.Option(
        "--network/--no-network",
        help="Isolate each sandbox in its own network namespace behind the node's egress gateway "
             "(off: loopback only).")] = True,
    egress_ca_dir: Annotated[Path | None, typer.Option(
        "--egress-ca-dir", envvar="SPACE_EGRESS_CA_DIR",
        help="The deployment's egress CA (the same on every node); default <data-dir>/egress-ca.")] = None,
    egress_private: Annotated[list[str] | None, typer.Option(
        "--egress-private", envvar="SPACE_EGRESS_PRIVATE", metavar="CIDR",
        help="A private range sandbox egress policies may open on this node (repeatable; give every "
             "node the deployment's ceiling). None by default.")] = None,
    manifest_key_file: Annotated[Path | None, typer.Option(
        "--manifest-key-file", envvar="SPACE_MANIFEST_KEY_FILE",
        help="The deployment's manifest key (the same on every node; $SPACE_MANIFEST_KEY wins): object "
             "storage manifests are sealed and checked with it. Required with --object-store-url.")] = None,
    create_manifest_key: Annotated[bool, typer.Option("--create-manifest-key", hidden=True)] = False,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    secrets_fd: Annotated[int | None, typer.Option(
        "--secrets-fd", hidden=True,
        help="An inherited pipe holding the node's secrets as JSON (space serve's supervisor writes it).")] = None,
) -> None:
    """Run a node agent."""
    from space import logs, objauth
    from space.node.main import NodeSettings, run

    if (socket is None) == (listen is None):
        raise typer.BadParameter("give exactly one of --socket or --listen")
    if register is not None and (listen is None or api_key_file is None):
        raise typer.BadParameter("--register needs --listen and --api-key-file")
    secrets = read_secrets(secrets_fd) if secrets_fd is not None else None
    # The deployment's manifest key: from space serve's secrets pipe, else this process's env.
    key_env = {**os.environ, **(secrets or {}).get("manifest", {})}
    keys = None
    if create_manifest_key and manifest_key_file is not None and not key_env.get(objauth.ENV_VAR):
        objauth.create_key_file(manifest_key_file)  # space serve's first start: made here, as root
    if object_store_url:
        try:
            keys = objauth.ManifestKeys.require(env=key_env, key_file=manifest_key_file)
        except objauth.ManifestKeyError as e:
            raise typer.BadParameter(e.message) from None
    # Held in memory only: no child (helper, gateway, shims, runsc) inherits it.
    os.environ.pop(objauth.ENV_VAR, None)
    logs.configure(log_level)
    run(NodeSettings(
        data_dir=data_dir, socket=socket, listen=listen, token=token_file.read_text().strip(),
        node_id=node_id, cache_dir=cache_dir, pool_size_gb=pool_size_gb, max_upload_bytes=max_upload_bytes,
        pool_reserve_mb=pool_reserve_mb, sandbox_disk_mb=sandbox_disk_mb,
        die_with_parent=die_with_parent, object_store_url=object_store_url,
        register_url=register, register_key=api_key_file.read_text().strip() if api_key_file else None,
        network=network, egress_ca_dir=egress_ca_dir, socket_group=socket_group, user=user,
        egress_ceiling=_ceiling(egress_private),
        object_store_env=secrets.get("object_store", {}) if secrets is not None else None,
        manifest_keys=keys,
    ))


#: The largest secrets document a node agent reads (its supervisor's limit is lower).
MAX_SECRETS = 64 * 1024


def read_secrets(fd: int) -> dict[str, dict[str, str]]:
    """The JSON document ``{group: {name: value}}`` on an inherited pipe, which is then closed."""
    import json

    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
            if len(data) > MAX_SECRETS:
                raise typer.BadParameter(f"--secrets-fd: more than {MAX_SECRETS} bytes")
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
    except ValueError:
        raise typer.BadParameter("--secrets-fd: not JSON") from None
    if not (isinstance(doc, dict) and all(
            isinstance(g, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in g.items())
            for g in doc.values())):
        raise typer.BadParameter("--secrets-fd: want {group: {name: string}}")
    return doc


@node_app.command("teardown")
def node_teardown(data_dir: DataDir, cache_dir: CacheDir = Path("/var/cache/space")) -> None:
    """Delete every sandbox of a node and release its pool (unmount, detach the loop device)."""
    from space import logs
    from space.node.main import teardown_node

    logs.configure("warning")
    if os.geteuid() != 0:
        raise typer.BadParameter("node teardown needs root")
    n = asyncio.run(teardown_node(data_dir, cache_dir))
    typer.echo(f"removed {n} sandbox(es); pool released")


objects_app = typer.Typer(help="Object storage maintenance (run by the operator, as root).", no_args_is_help=True)


@objects_app.command("migrate")
def objects_migrate(
    data_dir: DataDir = Path("/var/lib/space"),
    database_url: Annotated[str | None, typer.Option("--database-url", envvar="SPACE_DATABASE_URL",
                                                     help="SQLAlchemy URL (default: SQLite in the data dir).")]
    = None,
    object_store_url: Annotated[str | None, typer.Option("--object-store-url", envvar="SPACE_OBJECT_STORE_URL")]
    = None,
    manifest_key_file: Annotated[Path | None, typer.Option(
        "--manifest-key-file", envvar="SPACE_MANIFEST_KEY_FILE",
        help="The deployment's manifest key ($SPACE_MANIFEST_KEY wins); default <data-dir>/manifest.key.")] = None,
    cache_dir: CacheDir = Path("/var/cache/space"),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check and report; write nothing.")] = False,
) -> None:
    """Seal, after checking them against the database, the manifests and template streams object
    storage holds from before manifests were sealed; re-seal what an older manifest key sealed.
    Exits 1 if anything was refused (it stays refused by every node)."""
    from space import logs, objauth, objmigrate
    from space.config import ServeSettings

    logs.configure("warning")
    settings = ServeSettings(data_dir=data_dir, database_url=database_url, object_store_url=object_store_url)
    key_file = manifest_key_file or data_dir / objauth.KEY_FILE
    if manifest_key_file is None and not os.environ.get(objauth.ENV_VAR) and data_dir.is_dir():
        objauth.create_key_file(key_file)  # what space serve makes on its first start after the upgrade
    try:
        keys = objauth.ManifestKeys.require(key_file=key_file)
    except objauth.ManifestKeyError as e:
        raise typer.BadParameter(e.message) from None
    report = asyncio.run(objmigrate.run(database_url=settings.resolved_database_url(),
                                        object_store_url=settings.resolved_object_store_url(), keys=keys,
                                        cache_dir=cache_dir, dry_run=dry_run, say=typer.echo))
    raise typer.Exit(0 if report.ok else 1)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.add_typer(node_app, name="node")
    app.add_typer(objects_app, name="objects")
