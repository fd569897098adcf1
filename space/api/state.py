"""What the API handlers share: the store, the controller, the node registry, the server secret."""

from __future__ import annotations

import dataclasses
import ipaddress

from starlette.requests import HTTPConnection

from space.api.auditing import AuditWriter
from space.api.auth import KeyCache
from space.api.quota_cache import QuotaCache
from space.cluster.pki import ClusterCA
from space.controller import Controller, NodeRegistry
from space.credentials import CredentialManager
from space.egress_policy import DEFAULT_SANDBOX_NETWORK, IPNetwork
from space.store import Store


@dataclasses.dataclass
class AppState:
    store: Store
    nodes: NodeRegistry
    controller: Controller
    #: Key for attach tokens (HMAC); shared by every API replica.
    secret: bytes
    max_upload_bytes: int = 1 << 30
    #: Disk limit of a sandbox whose create names none (MiB), clamped to its tenant's ceiling.
    sandbox_disk_mb: int = 10240
    keys: KeyCache = dataclasses.field(default_factory=KeyCache)
    #: Admin keys of this tenant manage every tenant (space.api.auth.Principal.is_operator).
    operator_tenant: str = "default"
    #: Tenants' limits, for refusing a create before a warm sandbox is claimed for it.
    quotas: QuotaCache = dataclasses.field(default_factory=QuotaCache)
    #: Secrets (space.credentials); None where no master key is configured (/v1/secrets answers 503).
    credentials: CredentialManager | None = None
    #: The deployment's egress ceiling (ServeSettings.egress_ceiling): what a tenant's ceiling narrows.
    egress_ceiling: tuple[IPNetwork, ...] = ()
    #: Where the deployment's nodes give sandboxes addresses: never an egress destination (the
    #: gateways refuse them too).
    sandbox_networks: tuple[IPNetwork, ...] = (ipaddress.IPv4Network(DEFAULT_SANDBOX_NETWORK),)
    #: E2B's host form ``<port>-<sandbox id>.<domain>`` is routed to sandboxes when set.
    e2b_domain: str | None = None
    #: Signs the certificates of nodes that join (space.api.nodes); None: no node can join.
    cluster_ca: ClusterCA | None = None
    #: Where the audit middleware's records go (space.api.auditing); closed by the server on exit.
    audit: AuditWriter = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.audit = AuditWriter(self.store)


async def app_state(request: HTTPConnection) -> AppState:
    # A coroutine, not a plain function: FastAPI runs a plain dependency in its thread pool, a
    # thread hop on every request (a tenth of the API's time per create in a burst, measured).
    st: AppState = request.app.state.space
    return st
