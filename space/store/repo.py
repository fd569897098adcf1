"""The store: every read and write the control plane makes, one short transaction each.

Concurrency rules, the same on both dialects:

- A write transaction that reads before it writes locks what it reads: ``SELECT ... FOR UPDATE`` on
  PostgreSQL, ``BEGIN IMMEDIATE`` (the database write lock, taken up front) on SQLite, where the
  dialect leaves FOR UPDATE out. Within one process SQLite writers also queue on an asyncio lock.
- Idempotent creates rely on the unique ``(tenant, idempotency_key)`` constraint: the loser of a
  race gets an IntegrityError, rolls back and reads the winner's rows.
- Claims are conditional UPDATEs whose WHERE repeats the claimability test, so two controllers can
  never both win the same operation; PostgreSQL also skips rows another claimer has locked.

Rows are returned detached and fully loaded. Database failures leave as :mod:`space.errors`
classes: connection trouble and lock timeouts as ``Unavailable`` (retryable), constraint
violations as ``Conflict``, anything else as ``Internal``.

Each aggregate's methods live in a module of their own (base: the engine, sessions and error
translation; keys, nodes, templates, sandboxes, snapshots, operations, events, tenants,
secret_rows, leases, shreds): :class:`Store` combines them.
"""

from __future__ import annotations

from space.store.events import EventStore
from space.store.keys import API_KEY_PREFIX, ApiKeyStore, hash_key
from space.store.leases import LeaseStore
from space.store.membership import MembershipStore
from space.store.nodes import NodeStore
from space.store.operations import OPERATION_ACTIVE, OperationStore
from space.store.sandboxes import SANDBOX_FIELDS, SandboxStore
from space.store.secret_rows import SecretStore
from space.store.shreds import ShredStore
from space.store.snapshots import SNAPSHOT_FIELDS, SnapshotStore
from space.store.templates import TemplateStore
from space.store.tenants import TenantStore

__all__ = ["API_KEY_PREFIX", "OPERATION_ACTIVE", "SANDBOX_FIELDS", "SNAPSHOT_FIELDS", "Store", "hash_key"]


class Store(
    ApiKeyStore,
    NodeStore,
    TemplateStore,
    SandboxStore,
    SnapshotStore,
    OperationStore,
    TenantStore,
    EventStore,
    SecretStore,
    LeaseStore,
    MembershipStore,
    ShredStore,
):
    """The control plane's SQL store (SQLite embedded, PostgreSQL for several replicas)."""
