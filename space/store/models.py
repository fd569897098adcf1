"""The control plane's tables, as typed SQLAlchemy declarative models.

Rows are plain data: the store returns them detached and fully loaded, and the API layer serializes
them. The migrations (``migrations/versions/``) must create exactly this schema;
``tests/store/test_store_migrations.py`` compares the two.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from space import ids
from space.lifecycle import State

#: Deterministic constraint names, so that migrations can name what they alter or drop.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

API_KEY_ROLES = ("admin", "member", "readonly")
#: ``unreachable``: it missed heartbeats (nothing new is placed there); ``lost``: silent past its
#: fencing lease, so its sandboxes are stopped there and are restored elsewhere.
NODE_STATES = ("joining", "ready", "unreachable", "lost")
TEMPLATE_STATUSES = ("building", "ready", "failed")
OPERATION_STATUSES = ("pending", "running", "succeeded", "failed")
OPERATION_FINAL = ("succeeded", "failed")
SNAPSHOT_KINDS = ("disk", "full")
SNAPSHOT_ORIGINS = ("manual", "schedule", "suspend", "fork", "recovery", "move")
SNAPSHOT_STATUSES = ("creating", "ready", "failed", "deleted")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timezone-aware UTC timestamp on every dialect.

    SQLite has no time zones: it stores the UTC wall time as text (which keeps ``<`` comparisons
    right) and we put ``tzinfo=UTC`` back on the way out. Naive datetimes are refused, because
    guessing their zone is how lease expiries drift by hours.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: store only timezone-aware timestamps")
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)


class StateType(TypeDecorator[State]):
    """A sandbox state: a short string in the database, a :class:`State` in Python."""

    impl = String(16)
    cache_ok = True

    def process_bind_param(self, value: State | str | None, dialect: Dialect) -> str | None:
        return None if value is None else State(value).value

    def process_result_value(self, value: str | None, dialect: Dialect) -> State | None:
        return None if value is None else State(value)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    role: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(256), default="")
    #: The first 8 characters of the key, shown in listings so a user can tell keys apart.
    prefix: Mapped[str] = mapped_column(String(8))
    #: sha256 hex of the key. Keys are high-entropy random tokens, so a slow KDF would add nothing.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    url: Mapped[str] = mapped_column(Text)
    token: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default="ready")
    capacity: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    #: The node certificate the cluster CA issued it when it joined (PEM; None: a node reached by
    #: a bearer token on a unix socket, ``space serve``'s own).
    certificate: Mapped[str | None] = mapped_column(Text)
    #: sha256 hex of the node key's public half (SubjectPublicKeyInfo DER): only the holder of
    #: that key may join again under this node's id (a restart, a new address).
    key_sha256: Mapped[str | None] = mapped_column(String(64))
    #: The node agent's version, as it reported it.
    version: Mapped[str | None] = mapped_column(String(64))
    #: An operator took the node out of placement (``space node cordon``, or a drain): nothing new
    #: is placed on it and its warm pool is let go; what runs there runs on. Independent of
    #: ``state`` (its health): a cordoned node that stops answering is still marked down.
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class JoinToken(Base):
    """A token an operator made for nodes to join with (``space node token create``): it admits
    nodes and does nothing else. The secret half is stored as its sha256 only."""

    __tablename__ = "join_tokens"

    #: The public half (``spj_<id>.<secret>``), shown in listings and used to revoke it.
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    description: Mapped[str] = mapped_column(String(256), default="")
    created_by: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    #: How many nodes joined with it, and the most it may admit (None: any number until it expires).
    uses: Mapped[int] = mapped_column(Integer, default=0)
    max_uses: Mapped[int | None] = mapped_column(Integer)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())


class Lease(Base):
    """A named lease on a singleton job (``leader``: the controller that runs reconcile, heartbeats
    and policy ticks). ``fence`` grows by one whenever the holder changes, so work stamped with an
    older fence can be told from the current holder's."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    fence: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    acquired_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())


class WarmPool(Base):
    """How many booted, never-used sandboxes each node keeps ready for one template and size."""

    __tablename__ = "warm_pools"

    template: Mapped[str] = mapped_column(String(128), primary_key=True)
    cpu: Mapped[float] = mapped_column(Float, primary_key=True)
    memory_mb: Mapped[int] = mapped_column(Integer, primary_key=True)
    #: Per node.
    size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Template(Base):
    __tablename__ = "templates"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class TemplateTag(Base):
    """A name for one build of a template (``name:tag``): the digest that build made. A template's
    name follows its newest build; a tag stays on the build it was given to until moved."""

    __tablename__ = "template_tags"

    template: Mapped[str] = mapped_column(String(128), primary_key=True)
    tag: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(String(128))
    #: The build that made the digest (E2B's buildID, else SPACE's operation id).
    build_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Sandbox(Base):
    __tablename__ = "sandboxes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    template: Mapped[str] = mapped_column(String(128))
    template_digest: Mapped[str | None] = mapped_column(String(128))
    state: Mapped[State] = mapped_column(StateType(), default=State.CREATING)
    node_id: Mapped[str | None] = mapped_column(String(128))
    #: A node that still holds a copy of this sandbox to remove (a suspend's, until its removal is
    #: confirmed): whichever controller restores it first makes sure the copy is gone.
    evict_node: Mapped[str | None] = mapped_column(String(128))
    instance_id: Mapped[str | None] = mapped_column(String(64))
    cpu: Mapped[float] = mapped_column(Float)
    memory_mb: Mapped[int] = mapped_column(Integer)
    #: MiB its root may write beyond its template (None: no limit of its own); every root it gets
    #: on any node (rollback, restore, fork) is born with it.
    disk_mb: Mapped[int | None] = mapped_column(Integer)
    env: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    #: ``metadata`` is taken by the declarative base, hence the attribute name.
    meta: Mapped[dict[str, str]] = mapped_column("metadata", JSON, default=dict)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    terminated_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    #: Bumped by every update, so that a reader can tell whether what it saw is still current.
    generation: Mapped[int] = mapped_column(Integer, default=1)
    #: Seconds without activity before the idle policy pauses / suspends it (None: never).
    idle_pause_s: Mapped[int | None] = mapped_column(Integer)
    idle_suspend_s: Mapped[int | None] = mapped_column(Integer)
    #: End of its maximum lifetime (None: unbounded).
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    #: What reaching ``expires_at`` does: ``delete`` it, ``pause`` it (E2B's auto-pause), or
    #: ``suspend`` it (``suspend_disk``: its files only); the deadline is then cleared until a
    #: resume sets a new one.
    expire_action: Mapped[str] = mapped_column(String(16), default="delete", server_default="delete")
    #: Whether a data-plane call (exec, files) on a paused or suspended sandbox wakes it (SPACE's
    #: default); when false such calls fail until it is resumed explicitly (E2B's default).
    auto_resume: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    #: The secret its snapshots' and backups' keys are made with (base64; None: none yet; "": destroyed
    #: with the sandbox, and with it every key its objects were encrypted under). Never in a view.
    shred: Mapped[str | None] = mapped_column(String(64), nullable=True)
    #: Whether E2B-style port traffic (``E2b-Sandbox-Port``, ``<port>-<id>.<domain>``) reaches its
    #: servers without the sandbox's access token (E2B's ``allowPublicTraffic``).
    public_ports: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    #: The ``Host`` its servers see on port traffic, ``${PORT}`` standing for the port (E2B's
    #: ``maskRequestHost``); None: ``localhost:<port>``.
    port_host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    #: Per-sandbox snapshot schedule/retention overrides; interpreted by the scheduler, not here.
    snapshot_policy: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    #: Only moves forward (``Store.touch_sandbox``), so late activity reports cannot rewind it.
    last_active_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    #: Its disk backup as its node last reported it (``Store.record_backup``): ``{"node", "prefix",
    #: "chain", "seq", "disk_at", "bytes"}``; None until a first link is shipped.
    backup: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    #: The sandbox this one was forked from.
    parent_id: Mapped[str | None] = mapped_column(String(64))
    #: The snapshot this one was forked or restored from.
    source_snapshot: Mapped[str | None] = mapped_column(String(64))
    #: While suspended: the snapshot that holds its state (so it must not be deleted).
    snapshot_id: Mapped[str | None] = mapped_column(String(64))
    #: The middle level of secret scopes (tenant → project → sandbox); "" is none.
    project: Mapped[str] = mapped_column(String(128), default="")
    #: Egress policy (``space.egress_policy``): ``{"allow": [...], "deny": [...]}``; empty is the
    #: tenant's default. Follows the sandbox through pause, fork, suspend and restore.
    egress: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    #: Names of the secrets bound to it, resolved by scope when it is placed on a node.
    secrets: Mapped[list[str]] = mapped_column(JSON, default=list)
    #: What its E2B access tokens are made with (``space.e2b.tokens``): random, set when the row is
    #: made and replaced by a rotation and by its delete, so a token never outlives either, nor
    #: passes for another row with the same id.
    token_nonce: Mapped[str | None] = mapped_column(String(64))


# A tenant's live sandboxes (quota usage, listings) without a scan of its whole history.
Index("ix_sandboxes_tenant_state", Sandbox.tenant, Sandbox.state)


class Operation(Base):
    __tablename__ = "operations"
    __table_args__ = (UniqueConstraint("tenant", "idempotency_key"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(128), index=True)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    idempotency_key: Mapped[str | None] = mapped_column(String(256))
    request: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())


# The claim query scans for work by status in creation order.
Index("ix_operations_status_created_at", Operation.status, Operation.created_at)


class OperationLog(Base):
    __tablename__ = "operation_logs"

    op_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("operations.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    line: Mapped[str] = mapped_column(Text)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Snapshot(Base):
    """A disk snapshot or a full checkpoint of a sandbox.

    Rows are never deleted (status ``deleted`` keeps the audit trail). ``node_id`` names the node
    with a local copy (None once evicted); ``object_key`` is set once the upload completed, and
    only then may ``restorable`` become true.
    """

    __tablename__ = "snapshots"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    sandbox_id: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(8))
    origin: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="creating")
    node_id: Mapped[str | None] = mapped_column(String(128))
    object_key: Mapped[str | None] = mapped_column(String(512))
    restorable: Mapped[bool] = mapped_column(Boolean, default=False)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    template: Mapped[str] = mapped_column(String(128))
    template_digest: Mapped[str | None] = mapped_column(String(128))
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    #: A name its owner gave it (not unique: listings filter on it).
    name: Mapped[str | None] = mapped_column(String(128))
    #: Kept when its sandbox is deleted: uploaded under the tenant's own prefix as it is taken,
    #: and only an explicit delete removes it.
    retain: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    #: A retained snapshot's own shred secret (it outlives its sandbox; see Sandbox.shred). Never in a view.
    shred: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


# A sandbox's snapshots newest first (latest_snapshot, listings); also serves lookups by sandbox.
Index("ix_snapshots_sandbox_id_created_at", Snapshot.sandbox_id, Snapshot.created_at)


class SandboxEvent(Base):
    """Something that happened to a sandbox (crash, recovery, idle pause...), for its timeline."""

    __tablename__ = "sandbox_events"
    # AUTOINCREMENT: ids are never reused, so ``after=<last id seen>`` stays a valid cursor.
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sandbox_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant: Mapped[str] = mapped_column(String(128))
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class TenantQuota(Base):
    """Limits on what a tenant may hold at once; a NULL column is unlimited."""

    __tablename__ = "tenant_quotas"

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    sandboxes: Mapped[int | None] = mapped_column(Integer)
    cpu: Mapped[float | None] = mapped_column(Float)
    memory_mb: Mapped[int | None] = mapped_column(Integer)
    storage_mb: Mapped[int | None] = mapped_column(Integer)
    #: The largest disk limit one of its sandboxes may have (MiB).
    disk_mb: Mapped[int | None] = mapped_column(Integer)
    #: Whether its limits were ever set: a tenant whose limits never were gets the defaults (the
    #: row of :data:`space.store.quotas.DEFAULTS`); an egress default alone does not set them.
    quota_set: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    #: The tenant's default egress policy: a layer under every sandbox's own (both must allow).
    egress: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    #: The private ranges (CIDRs) the operator opens to this tenant, inside the deployment's
    #: (``space.egress_policy``); NULL: the deployment's ceiling.
    egress_ceiling: Mapped[list[str] | None] = mapped_column(JSON, nullable=True, default=None)
    #: Seconds between continuous-backup looks for its sandboxes whose own policy does not say:
    #: NULL takes the deployment's default, 0 turns backup off for them.
    backup_every: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    #: The tenant's key-encryption key for what SPACE stores of it (None: the deployment's: the
    #: local keyring's key named after the tenant).
    key_provider: Mapped[str | None] = mapped_column(String(16), nullable=True, default=None)
    key_id: Mapped[str | None] = mapped_column(String(2048), nullable=True, default=None)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Secret(Base):
    """A credential kept outside every sandbox, injected by the egress gateway.

    ``scope`` is ``tenant``, ``project:<name>`` or ``sandbox:<id>``; the most specific scope that
    holds a name wins. The value is never stored in clear: ``ciphertext`` for the built-in backend
    (AES-GCM under the deployment's key ``key_id``), or ``ref`` into an external vault backend.
    """

    __tablename__ = "secrets"
    __table_args__ = (UniqueConstraint("tenant", "scope", "name"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    scope: Mapped[str] = mapped_column(String(200), default="tenant")
    name: Mapped[str] = mapped_column(String(128))
    backend: Mapped[str] = mapped_column(String(32), default="builtin")
    ciphertext: Mapped[bytes | None] = mapped_column(LargeBinary)
    ref: Mapped[str | None] = mapped_column(String(512))
    key_id: Mapped[str | None] = mapped_column(String(64))
    #: Host patterns (``api.example.com``, ``*.example.com``) whose requests get it injected.
    hosts: Mapped[list[str]] = mapped_column(JSON, default=list)
    header: Mapped[str] = mapped_column(String(128), default="Authorization")
    #: How the header's value is made from the secret: ``{}`` is the value; ``basic`` means
    #: ``Basic base64(value)`` for a ``user:password`` value.
    format: Mapped[str] = mapped_column(String(256), default="Bearer {}")
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    #: Injections allowed per minute per node (None: unlimited).
    rate_limit: Mapped[int | None] = mapped_column(Integer)
    created_by: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class AuditRecord(Base):
    """One audited act: a mutating API call, an egress decision, a secret resolved or injected.

    Rows are only ever appended. ``actor`` is an API key id, ``gateway:<node>`` or ``system``;
    ``result`` is ``ok``, ``denied`` or the stable error code of a failed call.
    """

    __tablename__ = "audit_log"
    # AUTOINCREMENT: ids are never reused, so ``after=<last id seen>`` stays a valid cursor.
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(512), default="")
    result: Mapped[str] = mapped_column(String(64))
    status: Mapped[int | None] = mapped_column(Integer)
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    #: Where a shipped record came from, ``<node>:<journal>:<seq>`` (a gateway's): stored once
    #: however often it is shipped. None for the API's own records.
    source: Mapped[str | None] = mapped_column(String(200), unique=True)


def new_snapshot(sb: Sandbox, kind: str, origin: str) -> Snapshot:
    """The row of a snapshot about to be taken of ``sb`` (``creating``, not restorable yet)."""
    return Snapshot(id=ids.snapshot_id(), tenant=sb.tenant, sandbox_id=sb.id, kind=kind, origin=origin,
                    status="creating", node_id=sb.node_id, template=sb.template,
                    template_digest=sb.template_digest, restorable=False)
