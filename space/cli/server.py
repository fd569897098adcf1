"""Server-side commands: ``space serve`` and ``space node run|teardown``."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Annotated, Any

import typer

# The agent's own commands join the client-side ``space node`` group (list, get, remove, token).
from space.cli.nodes import app as node_app
from space.egress_policy import DEFAULT_SANDBOX_NETWORK

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
    sandbox_network: SandboxNetwork = DEFAULT_SANDBOX_NETWORK,
    object_encryption: Annotated[bool, typer.Option(
        "--object-encryption/--no-object-encryption", envvar="SPACE_OBJECT_ENCRYPTION",
        help="Encrypt snapshots and backups in object storage under their tenant's key (nodes need "
             "--kek-file or a KMS). Off only while nodes have no key providers.")] = True,
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
        egress_ceiling=ceiling, sandbox_network=_sandbox_network(sandbox_network),
        encrypt_objects=object_encryption,
    ))


SandboxNetwork = Annotated[str, typer.Option(
    "--sandbox-network", envvar="SPACE_SANDBOX_NETWORK", metavar="CIDR",
    help="Where sandboxes get their addresses (each node takes a /20): a private IPv4 range clear of the "
         "host's, VPC's, pods' and services' networks.")]


def _sandbox_network(value: str) -> str:
    from space.egress_policy import parse_sandbox_network
    from space.errors import InvalidRequest

    try:
        return str(parse_sandbox_network(value))
    except InvalidRequest as e:
        raise typer.BadParameter(e.message, param_hint="--sandbox-network") from None


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
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", help="File holding the bearer token the control plane presents on --socket.")] = None,
    socket: Annotated[Path | None, typer.Option("--socket", help="Serve on this unix socket (space serve's node).")]
    = None,
    socket_group: Annotated[int | None, typer.Option(
        "--socket-group", help="GID that may connect to --socket (space serve's unprivileged API).")] = None,
    listen: Annotated[str | None, typer.Option(
        "--listen", help="Serve the node API on HOST:PORT over mutual TLS (needs the --join-* options).")] = None,
    join_token_file: Annotated[Path | None, typer.Option(
        "--join-token-file", envvar="SPACE_JOIN_TOKEN_FILE",
        help="File holding a join token (space node token create).")] = None,
    control_url: Annotated[str | None, typer.Option(
        "--control-url", envvar="SPACE_CONTROL_URL",
        help="The control plane's API to join, https://… (http:// to a loopback address only).")] = None,
    advertise_url: Annotated[str | None, typer.Option(
        "--advertise-url", envvar="SPACE_ADVERTISE_URL",
        help="https://NAME:PORT the control plane reaches this node at (NAME goes in its certificate).")] = None,
    control_ca_file: Annotated[Path | None, typer.Option(
        "--control-ca-file", envvar="SPACE_CONTROL_CA_FILE",
        help="CA certificates (PEM) to check the control plane's HTTPS certificate with (default: the system's).")]
    = None,
    user: Annotated[str, typer.Option(
        "--user", envvar="SPACE_NODE_USER",
        help="Drop to this user once the root helper runs ('root': keep root).")] = "space-node",
    node_id: Annotated[str | None, typer.Option(
        "--node-id", envvar="SPACE_NODE_ID", help="This node's name (default: the host name).")] = None,
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
    network: Annotated[bool, typer.Option(
        "--network/--no-network",
        help="Isolate each sandbox in its own network namespace behind the node's egress gateway "
             "(off: loopback only).")] = True,
    egress_ca_dir: Annotated[Path | None, typer.Option(
        "--egress-ca-dir", envvar="SPACE_EGRESS_CA_DIR",
        help="The deployment's egress CA (the same on every node; required to join a cluster); "
             "default <data-dir>/egress-ca.")] = None,
    egress_private: Annotated[list[str] | None, typer.Option(
        "--egress-private", envvar="SPACE_EGRESS_PRIVATE", metavar="CIDR",
        help="A private range sandbox egress policies may open on this node (repeatable; give every "
             "node the deployment's ceiling). None by default.")] = None,
    manifest_key_file: Annotated[Path | None, typer.Option(
        "--manifest-key-file", envvar="SPACE_MANIFEST_KEY_FILE",
        help="The deployment's manifest key (the same on every node; $SPACE_MANIFEST_KEY wins): object "
             "storage manifests are sealed and checked with it. Required with --object-store-url.")] = None,
    create_manifest_key: Annotated[bool, typer.Option("--create-manifest-key", hidden=True)] = False,
    kek_file: Annotated[Path | None, typer.Option(
        "--kek-file", envvar="SPACE_KEK_FILE",
        help="The deployment's key-encryption root keys (the same on every node): the local keyring that "
             "tenants' keys without a KMS of their own are derived from. Default <data-dir>/kek.key if present.")]
    = None,
    create_kek: Annotated[bool, typer.Option("--create-kek", hidden=True)] = False,
    data_key_ttl: Annotated[float, typer.Option(
        "--data-key-ttl", min=0, max=3600, envvar="SPACE_DATA_KEY_TTL",
        help="Seconds an opened data key stays in memory (0: asked of the KMS every time); a revoked "
             "key stops opening snapshots at most this long after.")] = 60.0,
    fence_after: Annotated[float | None, typer.Option(
        "--fence-after", min=0.0, envvar="SPACE_FENCE_AFTER",
        help="Seconds without the control plane's heartbeat after which this node freezes its own "
             "sandboxes (they may be restored elsewhere); 0: never. Default 30 with --listen, 0 with --socket.")]
    = None,
    sandbox_network: SandboxNetwork = DEFAULT_SANDBOX_NETWORK,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    secrets_fd: Annotated[int | None, typer.Option(
        "--secrets-fd", hidden=True,
        help="An inherited pipe holding the node's secrets as JSON (space serve's supervisor writes it).")] = None,
) -> None:
    """Run a node agent: space serve's own (--socket), or a cluster's (--listen and --join-*)."""
    import socket as socketlib

    from space import logs, objauth
    from space.kms import KEK_FILE
    from space.node.main import NodeSettings, run
    from space.node.membership import JoinError, JoinSettings, check_control_url

    if (socket is None) == (listen is None):
        raise typer.BadParameter("give exactly one of --socket or --listen")
    join = None
    if listen is not None:
        if join_token_file is None or control_url is None or advertise_url is None:
            raise typer.BadParameter("--listen serves over mutual TLS: it needs --join-token-file, --control-url "
                                     "and --advertise-url")
        try:
            check_control_url(control_url)
        except JoinError as e:
            raise typer.BadParameter(e.message, param_hint="--control-url") from None
        if network and (egress_ca_dir is None or not (egress_ca_dir / "mitmproxy-ca.pem").exists()):
            # A CA made up here would be this node's alone: sandboxes moved between nodes would
            # stop trusting their gateway.
            raise typer.BadParameter("a cluster's node is given the deployment's egress CA: --egress-ca-dir DIR "
                                     "holding mitmproxy-ca.pem (or --no-network)", param_hint="--egress-ca-dir")
        join = JoinSettings(control_url=control_url, token_file=join_token_file, advertise_url=advertise_url,
                            control_ca_file=control_ca_file)
    elif token_file is None:
        raise typer.BadParameter("--socket needs --token-file")
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
    data_keys = _data_keys(kek_file or data_dir / KEK_FILE, create=create_kek, ttl=data_key_ttl,
                           env=None if secrets is None else {**secrets.get("object_store", {}),
                                                             **secrets.get("kms", {})})
    logs.configure(log_level)
    try:
        run(NodeSettings(
            data_dir=data_dir, socket=socket, listen=listen,
            token=token_file.read_text().strip() if token_file is not None else "",
            node_id=node_id or socketlib.gethostname().split(".")[0], cache_dir=cache_dir,
            pool_size_gb=pool_size_gb, max_upload_bytes=max_upload_bytes,
            pool_reserve_mb=pool_reserve_mb, sandbox_disk_mb=sandbox_disk_mb,
            die_with_parent=die_with_parent, object_store_url=object_store_url, join=join,
            network=network, egress_ca_dir=egress_ca_dir, socket_group=socket_group, user=user,
            egress_ceiling=_ceiling(egress_private),
            fence_after=(fence_after if fence_after is not None else 30.0 if listen is not None else 0.0) or None,
            object_store_env=secrets.get("object_store", {}) if secrets is not None else None,
            manifest_keys=keys, sandbox_network=_sandbox_network(sandbox_network), data_keys=data_keys,
        ))
    except JoinError as e:
        typer.echo(f"space node run: {e.message}", err=True)
        raise typer.Exit(2) from None


def _data_keys(kek_file: Path, *, create: bool, env: dict[str, str] | None, ttl: float = 60.0) -> Any:
    """The node's key providers: the local keyring from ``kek_file`` (made first with ``create``:
    space serve's first start), and AWS KMS (its credentials from ``env``, else the environment's
    chain) when botocore is installed. Read here, as root: the root keys live in memory only."""
    from space.errors import Unavailable
    from space.kms import AWS_KMS, LOCAL, AwsKms, DataKeys, KeyProvider, LocalKeyring

    providers: dict[str, KeyProvider] = {}
    if create and not kek_file.exists():
        LocalKeyring.create_file(kek_file)
    if kek_file.exists():
        try:
            providers[LOCAL] = LocalKeyring.from_file(kek_file)
        except (OSError, ValueError) as e:
            raise typer.BadParameter(f"the key-encryption key file {kek_file}: {e}", param_hint="--kek-file") from None
    with contextlib.suppress(Unavailable):  # no botocore: tenants' AWS KMS keys are refused, saying so
        providers[AWS_KMS] = AwsKms(env={**os.environ, **(env or {})})
    return DataKeys(providers, ttl=ttl)


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


@node_app.command("prepare-guest")
def node_prepare_guest() -> None:
    """Compile the installed guest daemon and build its exec wrapper, in place (make setup and the node
    image's build run this; a node started on an unprepared package prepares a copy in its data dir)."""
    from space.node.sandboxes.guest_files import package_dir, prepare

    d = package_dir()
    try:
        prepare(d)
    except (OSError, RuntimeError) as e:
        typer.echo(f"space node prepare-guest: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(str(d))


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


@node_app.command("leave")
def node_leave(
    data_dir: DataDir,
    when: Annotated[str, typer.Option(
        "--when", help="kubernetes: only if this machine's Kubernetes Node is cordoned or tainted for removal "
                       "(a rollout is not a leaving: the next agent adopts the sandboxes); always: now.")]
    = "kubernetes",
    node_name: Annotated[str | None, typer.Option(
        "--node-name", envvar="NODE_NAME", help="The Kubernetes Node (--when kubernetes).")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.0, help="Seconds to wait for the node's sandboxes to move away.")] = 840.0,
    cancel: Annotated[bool, typer.Option("--cancel", help="Withdraw a leaving this node announced.")] = False,
) -> None:
    """The node is going away for good: the control plane drains it (every sandbox moves to another
    node with its processes) while this waits until none is left, or its timeout. A node pod's
    preStop hook (as root, in the node's container); exits 0 whatever happens, saying what did."""
    from space.errors import SpaceError
    from space.node import kubernetes, leaving

    if cancel:
        typer.echo("leaving withdrawn" if leaving.clear(data_dir) else "this node was not leaving")
        return
    if when == "always":
        reason = "the operator retires the machine (space node leave --when always)"
    elif when == "kubernetes":
        if not node_name:
            typer.echo("space node leave: --node-name (or NODE_NAME) names the Kubernetes Node", err=True)
            raise typer.Exit(2)
        try:
            found = kubernetes.leaving_reason(kubernetes.read_node(node_name))
        except SpaceError as e:
            # Not knowing is not leaving: the sandboxes stay, and should the machine be gone the
            # control plane restores them from their backups elsewhere.
            typer.echo(f"space node leave: staying: {e.message}", err=True)
            return
        if found is None:
            typer.echo(f"node {node_name} is not leaving (a restart or a rollout): its sandboxes stay", err=True)
            return
        reason = found
    else:
        raise typer.BadParameter("--when is kubernetes or always")
    since = leaving.mark(data_dir, reason)
    typer.echo(f"leaving: {reason}; waiting up to {timeout:g}s for the sandboxes to move", err=True)
    left = leaving.wait_until_empty(data_dir, since, timeout, lambda line: typer.echo(line, err=True))
    if left == 0:
        typer.echo("every sandbox moved away", err=True)
    else:
        typer.echo(f"gave up after {timeout:g}s with {'an unknown number of' if left is None else left} "
                   "sandbox(es) still here" + (" (the node agent did not answer)" if left is None else ""),
                   err=True)


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


# ---- the replicated control plane ----------------------------------------------------------------

DatabaseUrl = Annotated[str | None, typer.Option("--database-url", envvar="SPACE_DATABASE_URL",
                                                 help="The shared PostgreSQL database (postgresql+asyncpg://…).")]
DatabaseUrlFile = Annotated[Path | None, typer.Option(
    "--database-url-file", envvar="SPACE_DATABASE_URL_FILE",
    help="A file holding --database-url (a mounted Secret: the password stays out of the environment).")]


def _database_url(url: str | None, file: Path | None) -> str:
    """The database URL, given as itself or as a file holding it: exactly one of the two."""
    from space.controlplane import StartupError, read_small_file

    if (url is None) == (file is None):
        raise typer.BadParameter("give exactly one of --database-url and --database-url-file")
    if url is not None:
        return url
    assert file is not None
    try:
        text = read_small_file(file, "a database URL").strip()
    except FileNotFoundError:
        raise typer.BadParameter(f"{file} does not exist", param_hint="--database-url-file") from None
    except StartupError as e:
        raise typer.BadParameter(e.message, param_hint="--database-url-file") from None
    if not text or "\n" in text:
        raise typer.BadParameter(f"{file} must hold one database URL", param_hint="--database-url-file")
    return text
ObjectStoreUrl = Annotated[str, typer.Option("--object-store-url", envvar="SPACE_OBJECT_STORE_URL",
                                             help="The shared object store (s3://BUCKET/PREFIX, or a directory).")]
KeysDir = Annotated[Path | None, typer.Option(
    "--keys-dir", envvar="SPACE_KEYS_DIR",
    help="Directory holding the shared keys (space keys generate); each may be given by its variable instead.")]
LogLevel = Annotated[str, typer.Option("--log-level")]


def api(
    object_store_url: ObjectStoreUrl,
    database_url: DatabaseUrl = None,
    database_url_file: DatabaseUrlFile = None,
    keys_dir: KeysDir = None,
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT of the API.", envvar="SPACE_LISTEN")]
    = "0.0.0.0:8080",
    tls_cert_file: Annotated[Path | None, typer.Option(
        "--tls-cert-file", envvar="SPACE_TLS_CERT_FILE",
        help="Serve HTTPS with this certificate chain (PEM), e.g. from space keys api-cert; nodes join "
             "only over https.")] = None,
    tls_key_file: Annotated[Path | None, typer.Option(
        "--tls-key-file", envvar="SPACE_TLS_KEY_FILE", help="The key of --tls-cert-file (PEM).")] = None,
    sandbox_disk_mb: Annotated[int, typer.Option("--sandbox-disk-mb", min=16)] = 10240,
    default_quota: Annotated[str | None, typer.Option("--default-quota", envvar="SPACE_DEFAULT_QUOTA")] = None,
    max_upload_mb: Annotated[int, typer.Option("--max-upload-mb", help="Largest file upload.")] = 1024,
    no_bootstrap: Annotated[bool, typer.Option("--no-bootstrap", help="Don't queue a build of 'base' when missing.")]
    = False,
    operator_tenant: Annotated[str, typer.Option("--operator-tenant", envvar="SPACE_OPERATOR_TENANT")] = "default",
    egress_private: Annotated[list[str] | None, typer.Option(
        "--egress-private", envvar="SPACE_EGRESS_PRIVATE", metavar="CIDR")] = None,
    e2b_domain: Annotated[str | None, typer.Option("--e2b-domain", envvar="SPACE_E2B_DOMAIN")] = None,
    sandbox_network: Annotated[list[str] | None, typer.Option(
        "--sandbox-network", envvar="SPACE_SANDBOX_NETWORK", metavar="CIDR",
        help="The nodes' --sandbox-network (repeatable): never an egress destination. Default 10.208.0.0/12.")]
    = None,
    log_level: LogLevel = "info",
) -> None:
    """Run one API replica (stateless; run any number behind a load balancer)."""
    from space import controlplane, logs

    if (tls_cert_file is None) != (tls_key_file is None):
        raise typer.BadParameter("give both --tls-cert-file and --tls-key-file, or neither")
    for given in (tls_cert_file, tls_key_file):
        if given is not None and not given.is_file():
            raise typer.BadParameter(f"{given} is not a readable file")
    logs.configure(log_level)
    controlplane.run("api", controlplane.ControlPlaneSettings(
        database_url=_database_url(database_url, database_url_file), object_store_url=object_store_url,
        keys_dir=keys_dir, listen=listen,
        tls_cert_file=tls_cert_file, tls_key_file=tls_key_file,
        sandbox_disk_mb=sandbox_disk_mb, max_upload_bytes=max_upload_mb << 20, operator_tenant=operator_tenant,
        default_quota=parse_quota(default_quota) if default_quota is not None else None,
        bootstrap_templates=() if no_bootstrap else ("base",), egress_ceiling=_ceiling(egress_private),
        sandbox_networks=tuple(_sandbox_network(n) for n in (sandbox_network or [DEFAULT_SANDBOX_NETWORK])),
        e2b_domain=e2b_domain))


def controller(
    object_store_url: ObjectStoreUrl,
    database_url: DatabaseUrl = None,
    database_url_file: DatabaseUrlFile = None,
    keys_dir: KeysDir = None,
    lease_seconds: Annotated[float, typer.Option(
        "--lease-seconds", min=1.0,
        help="How long an operation a controller claimed stays its own without renewal: after a crash, "
             "another controller takes it over this long after the last renewal.")] = 10.0,
    backup_every: Annotated[float, typer.Option(
        "--backup-every", min=0.0, envvar="SPACE_BACKUP_EVERY",
        help="Seconds between the continuous disk backup's looks at each sandbox whose snapshot policy "
             "names no backup_every (0: such sandboxes are not backed up).")] = 45.0,
    health_file: Annotated[Path | None, typer.Option(
        "--health-file", envvar="SPACE_HEALTH_FILE",
        help="Touch this file every few seconds while running (a liveness probe checks its age).")] = None,
    object_encryption: Annotated[bool, typer.Option(
        "--object-encryption/--no-object-encryption", envvar="SPACE_OBJECT_ENCRYPTION",
        help="Encrypt snapshots and backups in object storage under their tenant's key (nodes need "
             "--kek-file or a KMS). Off only while nodes have no key providers.")] = True,
    log_level: LogLevel = "info",
) -> None:
    """Run one controller (run several: they share the work, one leads)."""
    from space import controlplane, logs

    logs.configure(log_level)
    controlplane.run("controller", controlplane.ControlPlaneSettings(
        database_url=_database_url(database_url, database_url_file), object_store_url=object_store_url,
        keys_dir=keys_dir, lease_seconds=lease_seconds, backup_every=backup_every or None, health_file=health_file,
        encrypt_objects=object_encryption))


db_app = typer.Typer(help="The shared database.", no_args_is_help=True)


@db_app.command("migrate")
def db_migrate(database_url: DatabaseUrl = None, database_url_file: DatabaseUrlFile = None) -> None:
    """Bring the database's schema to this version's newest migration, then exit (a Kubernetes Job
    before the API rolls; replicas also migrate at start, under the same lock)."""
    import asyncio

    from space import logs
    from space.errors import SpaceError
    from space.store import Store

    url = _database_url(database_url, database_url_file)
    logs.configure("info")

    async def go() -> str | None:
        async with await Store.open(url) as store:
            return await store.schema_revision()

    try:
        revision = asyncio.run(go())
    except SpaceError as e:
        typer.echo(f"space db migrate: {e.message}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"schema at {revision}")


keys_app = typer.Typer(help="The deployment's shared keys.", no_args_is_help=True)


@keys_app.command("generate")
def keys_generate(directory: Annotated[Path, typer.Argument(help="Where to write them (made 0700).")]) -> None:
    """Make a deployment's shared keys once: the control plane's (signing, credential master, cluster
    CA) and the nodes' (egress CA in egress-ca/, manifest key, the local keyring's root key). Refuses
    to replace any."""
    from space import objauth
    from space.cluster import keys
    from space.gateway.ca import ensure_ca
    from space.kms import KEK_FILE, LocalKeyring

    try:
        written = keys.generate(directory)
    except keys.SharedKeyError as e:
        raise typer.BadParameter(e.message) from None
    if not (directory / objauth.KEY_FILE).exists():
        objauth.create_key_file(directory / objauth.KEY_FILE)
        written.append(directory / objauth.KEY_FILE)
    if not (directory / KEK_FILE).exists():
        LocalKeyring.create_file(directory / KEK_FILE)
        written.append(directory / KEK_FILE)
    cert, key = ensure_ca(directory / "egress-ca")
    for path in [*written, cert, key]:
        typer.echo(str(path))
    typer.echo("control plane: give every api and controller replica "
               f"{', '.join(s.file for s in keys.ALL)} (--keys-dir); nodes: egress-ca/ (--egress-ca-dir) and "
               f"{objauth.KEY_FILE} (--manifest-key-file), {KEK_FILE} (--kek-file)", err=True)


@keys_app.command("api-cert")
def keys_api_cert(
    directory: Annotated[Path, typer.Argument(help="The keys directory (space keys generate): its cluster CA signs.")],
    host: Annotated[list[str], typer.Option(
        "--host", help="A name nodes reach the API by (repeatable), e.g. space-api.space.svc.")],
    days: Annotated[int, typer.Option("--days", min=1)] = 365,
) -> None:
    """Issue the API replicas' HTTPS certificate from the cluster CA (api.pem, api.key in DIRECTORY):
    nodes then join over https with --control-ca-file DIRECTORY/cluster-ca.pem."""
    from space.cluster import keys
    from space.cluster.pki import ClusterCA, PKIError, write_private

    try:
        ca = ClusterCA.load((directory / keys.CLUSTER_CA_CERT.file).read_bytes(),
                            (directory / keys.CLUSTER_CA_KEY.file).read_bytes())
        cert, key = ca.issue_api_server(host, days=days)
    except OSError as e:
        raise typer.BadParameter(f"cannot read the cluster CA in {directory}: {e.strerror}") from None
    except PKIError as e:
        raise typer.BadParameter(str(e)) from None
    write_private(directory / "api.key", key)
    write_private(directory / "api.pem", cert)
    typer.echo(str(directory / "api.pem"))
    typer.echo(str(directory / "api.key"))


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("api")(api)
    app.command("controller")(controller)
    app.add_typer(keys_app, name="keys")
    app.add_typer(objects_app, name="objects")
    app.add_typer(db_app, name="db")
