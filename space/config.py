"""Settings of the all-in-one server (``space serve``). Flags beat environment beat defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from space.egress_policy import DEFAULT_SANDBOX_NETWORK

#: The limits of every tenant whose own were never set, until the operator changes them
#: (``--default-quota``, ``PUT /v1/quota/defaults``): room for a team's agents on one small node.
DEFAULT_QUOTA: dict[str, Any] = {"sandboxes": 20, "cpu": 16.0, "memory_mb": 32768, "storage_mb": 51200,
                                 "disk_mb": 51200}


@dataclasses.dataclass
class ServeSettings:
    #: Everything the server keeps: the SQLite database, admin key, secret, object store, node pool.
    data_dir: Path
    #: ``HOST:PORT`` of the public API.
    listen: str = "127.0.0.1:8080"
    #: SQLAlchemy URL; default ``sqlite+aiosqlite:///<data_dir>/control/space.db`` (a directory the
    #: API's user owns: SQLite creates its -wal/-shm files next to the database).
    database_url: str | None = None
    #: Object store: a local directory (default ``<data_dir>/objects``) or an ``s3://`` URL.
    object_store_url: str | None = None
    #: Host-wide cache of debootstrap downloads and exported template streams.
    cache_dir: Path = Path("/var/cache/space")
    #: Size of the node's btrfs loop file when the data dir is not on btrfs.
    pool_size_gb: int = 64
    #: MiB of the pool no sandbox may fill (None: 5 % of it, at least 1 GiB).
    pool_reserve_mb: int | None = None
    #: Disk limit of a sandbox whose create names none (MiB; at most its tenant's ``disk_mb``).
    sandbox_disk_mb: int = 10240
    #: The default limits given on the command line: they replace the stored defaults at start.
    #: None: the stored ones stay (on a new deployment: :data:`DEFAULT_QUOTA`).
    default_quota: dict[str, Any] | None = None
    #: Largest accepted file upload, in bytes (413 beyond).
    max_upload_bytes: int = 1 << 30
    #: Templates built on first start when missing (``make run`` wants ``base`` ready).
    bootstrap_templates: tuple[str, ...] = ("base",)
    #: Warm sandboxes of ``base`` (1 cpu, 512 MiB) each node keeps, set once on first start; change
    #: it later with ``space pool set``.
    warm_pool: int = 2
    #: Sandboxes isolated in their own network namespaces behind the node's egress gateway.
    network: bool = True
    #: The deployment's egress ceiling: the private ranges (CIDRs) sandbox egress policies may open
    #: at all (the operator narrows it per tenant). Empty: none. Loopback, link-local, metadata, the
    #: node and its sandboxes are never reachable (space.egress_policy).
    egress_ceiling: tuple[str, ...] = ()
    #: Where the node gives sandboxes their addresses (space.egress_policy.parse_sandbox_network):
    #: choose one clear of the host's own networks.
    sandbox_network: str = DEFAULT_SANDBOX_NETWORK
    #: Operation lease: how long a crashed controller's claim blocks a retry.
    lease_seconds: float = 10.0
    #: The tenant whose admin keys manage every tenant (keys, quotas, audit); the bootstrap admin
    #: key is made in it.
    operator_tenant: str = "default"
    #: The user the API and the controller run as once the node agent (root) is started; ``root``
    #: keeps them root (``space.privdrop``).
    user: str = "space"
    #: Route E2B's host form ``<port>-<sandbox id>.<domain>`` to sandboxes (SDKs before 2.7 and
    #: ``Sandbox.get_host``; needs wildcard DNS to this server). None: header routing only.
    e2b_domain: str | None = None
    #: Snapshots and backups encrypted under their tenant's key (issue BYOK); off only for nodes
    #: that have no key providers yet (what was sealed before still needs its key).
    encrypt_objects: bool = True

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.data_dir.resolve() / 'control' / 'space.db'}"

    def resolved_object_store_url(self) -> str:
        return self.object_store_url or str(self.data_dir.resolve() / "objects")
