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
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Self, TypeVar, cast

import structlog
from sqlalchemy import ColumnElement, Connection, CursorResult, and_, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from space import ids
from space.errors import Conflict, Internal, InvalidRequest, InvalidState, NotFound, Unavailable
from space.lifecycle import State, allowed_actions, transition
from space.store import db, quotas
from space.store.models import (
    API_KEY_ROLES,
    NODE_STATES,
    OPERATION_FINAL,
    SNAPSHOT_KINDS,
    SNAPSHOT_ORIGINS,
    SNAPSHOT_STATUSES,
    TEMPLATE_STATUSES,
    ApiKey,
    AuditRecord,
    Base,
    Node,
    Operation,
    OperationLog,
    Sandbox,
    SandboxEvent,
    Secret,
    Snapshot,
    Template,
    TenantQuota,
    WarmPool,
    utcnow,
)

log = structlog.get_logger(__name__)

_M = TypeVar("_M", bound=Base)
_T = TypeVar("_T")

#: Sandbox columns a caller may change besides the state.
SANDBOX_FIELDS = frozenset(
    {"template", "template_digest", "node_id", "instance_id", "cpu", "memory_mb", "disk_mb", "env", "meta",
     "error_code", "error_message", "idle_pause_s", "idle_suspend_s", "expires_at",
     "expire_action", "auto_resume", "public_ports", "snapshot_policy", "last_active_at", "parent_id",
     "source_snapshot", "snapshot_id", "egress", "secrets", "token_nonce"}
)

#: Snapshot columns ``update_snapshot`` may change (identity, owner and origin are fixed).
SNAPSHOT_FIELDS = frozenset(
    {"status", "node_id", "object_key", "restorable", "size_bytes", "template_digest", "meta",
     "error"}
)

#: Operation statuses in which an operation may still use what its request names.
OPERATION_ACTIVE = ("pending", "running")

#: Secret columns a replace (``put_secret`` on an existing name) takes from the new row.
_SECRET_COPY = ("backend", "ciphertext", "ref", "key_id", "hosts", "header", "format", "expires_at",
                "rate_limit")

API_KEY_PREFIX = "sk_"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _rowcount(result: Any) -> int:
    return cast(CursorResult[Any], result).rowcount


class Store:
    """The control plane's SQL store (SQLite embedded, PostgreSQL for several replicas)."""

    url: str
    dialect: str

    def __init__(self, url: str, engine: AsyncEngine) -> None:
        self.url = url
        self.dialect = engine.dialect.name
        self._engine = engine
        writer = engine.execution_options(**{db.WRITE_OPTION: True})
        self._sessionmaker = async_sessionmaker(writer, expire_on_commit=False)
        self._reader = async_sessionmaker(engine, expire_on_commit=False)
        self._write_lock = asyncio.Lock() if self.dialect == "sqlite" else None
        self._fast = db.create_sqlite_fast_writer(engine)
        self._fast_sessions = (
            sessionmaker(self._fast.execution_options(**{db.WRITE_OPTION: True}), expire_on_commit=False)
            if self._fast is not None else None
        )

    @classmethod
    async def open(cls, url: str) -> Store:
        """Connect and bring the schema to the newest migration."""
        with _translate_errors():
            engine = db.create_engine(url)
        try:
            await _translated(db.migrate(engine))
        except BaseException:
            await engine.dispose()
            raise
        log.debug("store opened", dialect=engine.dialect.name)
        return cls(url, engine)

    async def close(self) -> None:
        await self._engine.dispose()
        if self._fast is not None:
            self._fast.dispose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @contextlib.asynccontextmanager
    async def _tx(self, *, write: bool = True) -> AsyncIterator[AsyncSession]:
        if write and self._write_lock is not None:
            # SQLite has one writer at a time anyway: queueing our own writers here is much
            # cheaper than letting them poll the file lock in SQLite's busy handler.
            async with self._write_lock, self._session(write) as s:
                yield s
        else:
            async with self._session(write) as s:
                yield s

    @contextlib.asynccontextmanager
    async def _session(self, write: bool) -> AsyncIterator[AsyncSession]:
        maker = self._sessionmaker if write else self._reader
        with _translate_errors():
            async with maker() as s, s.begin():
                yield s

    def _insert(self, model: type[Base]) -> postgresql.Insert | sqlite.Insert:
        if self.dialect == "postgresql":
            return postgresql.insert(model)
        return sqlite.insert(model)

    async def _get(
        self, s: AsyncSession, model: type[_M], key: Any, what: str, *, lock: bool = False
    ) -> _M:
        row = await s.get(model, key, with_for_update=lock or None)
        if row is None:
            raise NotFound(f"{what} {key} not found")
        return row

    # ---- api keys -------------------------------------------------------------------------------

    async def create_api_key(self, tenant: str, role: str, name: str = "") -> tuple[ApiKey, str]:
        """Create a key; returns the row and the plaintext key, which is never stored."""
        if role not in API_KEY_ROLES:
            raise InvalidRequest(f"invalid role {role!r}: must be one of {', '.join(API_KEY_ROLES)}")
        if not tenant:
            raise InvalidRequest("tenant must not be empty")
        key = API_KEY_PREFIX + secrets.token_urlsafe(30)  # 30 bytes -> 40 urlsafe characters
        row = ApiKey(
            id=ids.apikey_id(), tenant=tenant, role=role, name=name, prefix=key[:8],
            key_hash=hash_key(key), created_at=utcnow(), revoked_at=None,
        )
        async with self._tx() as s:
            s.add(row)
        return row, key

    async def authenticate(self, key: str) -> ApiKey | None:
        """The active key with this plaintext, or None (unknown or revoked)."""
        async with self._tx(write=False) as s:
            row = await s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
        if row is None or row.revoked_at is not None:
            return None
        return row

    async def list_api_keys(
        self, tenant: str | None = None, *, include_revoked: bool = False
    ) -> list[ApiKey]:
        q = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
        if tenant is not None:
            q = q.where(ApiKey.tenant == tenant)
        if not include_revoked:
            q = q.where(ApiKey.revoked_at.is_(None))
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def revoke_api_key(self, key_id: str) -> None:
        """Revoke a key (idempotent: a revoked key keeps its first revocation time)."""
        async with self._tx() as s:
            row = await self._get(s, ApiKey, key_id, "api key", lock=True)
            if row.revoked_at is None:
                row.revoked_at = utcnow()

    async def count_api_keys(self) -> int:
        """Active (unrevoked) keys: zero means the server must bootstrap an admin key."""
        async with self._tx(write=False) as s:
            n = await s.scalar(select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None)))
        return int(n or 0)

    # ---- nodes ----------------------------------------------------------------------------------

    async def upsert_node(self, node_id: str, url: str, token: str, capacity: dict[str, Any]) -> Node:
        """Register a node, or refresh its address, token and capacity; either way it is ready."""
        now = utcnow()
        stmt = self._insert(Node).values(
            id=node_id, url=url, token=token, state="ready", capacity=capacity,
            heartbeat_at=now, created_at=now,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[Node.id],
            set_={"url": url, "token": token, "state": "ready", "capacity": capacity, "heartbeat_at": now},
        )
        async with self._tx() as s:
            await s.execute(stmt)
            return await self._get(s, Node, node_id, "node")

    async def heartbeat_node(self, node_id: str, capacity: dict[str, Any]) -> None:
        """Record that the node is alive (a down node comes back ready)."""
        async with self._tx() as s:
            res = await s.execute(
                update(Node).where(Node.id == node_id)
                .values(capacity=capacity, heartbeat_at=utcnow(), state="ready")
                .execution_options(synchronize_session=False)
            )
            if _rowcount(res) == 0:
                raise NotFound(f"node {node_id} not found")

    async def set_node_state(self, node_id: str, state: str) -> Node:
        if state not in NODE_STATES:
            raise InvalidRequest(f"invalid node state {state!r}: must be one of {', '.join(NODE_STATES)}")
        async with self._tx() as s:
            node = await self._get(s, Node, node_id, "node", lock=True)
            node.state = state
            return node

    async def mark_stale_nodes_down(self, stale_after: float) -> list[str]:
        """Mark ready nodes whose last heartbeat is older than ``stale_after`` seconds down."""
        cutoff = utcnow() - dt.timedelta(seconds=stale_after)
        stale = and_(Node.state == "ready", Node.heartbeat_at < cutoff)
        async with self._tx() as s:
            node_ids = list(await s.scalars(select(Node.id).where(stale).with_for_update()))
            if node_ids:
                await s.execute(
                    update(Node).where(Node.id.in_(node_ids), stale).values(state="down")
                    .execution_options(synchronize_session=False)
                )
        return node_ids

    async def list_nodes(self, state: str | None = "ready") -> list[Node]:
        q = select(Node).order_by(Node.id)
        if state is not None:
            q = q.where(Node.state == state)
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def get_node(self, node_id: str) -> Node:
        async with self._tx(write=False) as s:
            return await self._get(s, Node, node_id, "node")

    # ---- templates ------------------------------------------------------------------------------

    async def upsert_template(
        self,
        name: str,
        *,
        digest: str,
        status: str,
        spec: dict[str, Any],
        size_bytes: int | None = None,
        error: str | None = None,
    ) -> Template:
        if status not in TEMPLATE_STATUSES:
            raise InvalidRequest(
                f"invalid template status {status!r}: must be one of {', '.join(TEMPLATE_STATUSES)}"
            )
        now = utcnow()
        values = {"digest": digest, "status": status, "spec": spec, "size_bytes": size_bytes,
                  "error": error, "updated_at": now}
        stmt = self._insert(Template).values(name=name, created_at=now, **values)
        stmt = stmt.on_conflict_do_update(
            index_elements=[Template.name], set_=values
        )
        async with self._tx() as s:
            await s.execute(stmt)
            return await self._get(s, Template, name, "template")

    # ---- warm pools -----------------------------------------------------------------------------

    async def set_warm_pool(self, template: str, *, cpu: float, memory_mb: int, size: int) -> WarmPool:
        """Set how many ready sandboxes each node keeps for ``template`` at this size; 0 removes it."""
        if size < 0:
            raise InvalidRequest("a warm pool size cannot be negative")
        now = utcnow()
        async with self._tx() as s:
            row = await s.get(WarmPool, (template, cpu, memory_mb))
            if size == 0:
                if row is not None:
                    await s.delete(row)
                return WarmPool(template=template, cpu=cpu, memory_mb=memory_mb, size=0,
                                created_at=now, updated_at=now)
            if row is None:
                row = WarmPool(template=template, cpu=cpu, memory_mb=memory_mb, size=size,
                               created_at=now, updated_at=now)
                s.add(row)
            else:
                row.size = size
                row.updated_at = now
            await s.flush()
            return row

    async def list_warm_pools(self) -> list[WarmPool]:
        async with self._tx(write=False) as s:
            return list(await s.scalars(
                select(WarmPool).order_by(WarmPool.template, WarmPool.cpu, WarmPool.memory_mb)
            ))

    async def get_template(self, name: str) -> Template:
        async with self._tx(write=False) as s:
            return await self._get(s, Template, name, "template")

    async def list_templates(self) -> list[Template]:
        async with self._tx(write=False) as s:
            return list(await s.scalars(select(Template).order_by(Template.name)))

    # ---- sandboxes ------------------------------------------------------------------------------

    async def create_sandbox(self, sandbox: Sandbox, op: Operation) -> tuple[Sandbox, Operation, bool]:
        """Insert a sandbox and the operation that creates it, atomically.

        With ``op.idempotency_key`` set and already used by the tenant, nothing is written and the
        existing pair comes back with ``False``.
        """
        _same_tenant(op, sandbox, "sandbox")
        if op.target is None:
            op.target = sandbox.id
        now = utcnow()
        _prepare_sandbox(sandbox, now)
        if self._fast_sessions is not None and op.idempotency_key is None:
            # SQLite, nothing to look up first: the two-row insert synchronously, under the same
            # single-writer lock as every other write (~0.6 ms of the loop instead of ~3 ms of
            # trips to aiosqlite's thread, on every create's critical path).
            _prepare_operation(op, now)
            assert self._write_lock is not None
            async with self._write_lock:
                with _translate_errors(), self._fast_sessions() as fs, fs.begin():
                    self._enforce_quota_sync(fs, sandbox.tenant, quotas.QuotaDemand.of([sandbox]))
                    fs.add_all([sandbox, op])
            return sandbox, op, True

        async def replay(s: AsyncSession, prior: Operation) -> tuple[Sandbox, Operation, bool]:
            sb = await s.get(Sandbox, prior.target)
            if sb is None:
                raise Conflict(
                    f"idempotency key {op.idempotency_key!r} was used for a request without a sandbox"
                )
            return sb, prior, False

        async def check(s: AsyncSession) -> None:
            await self._enforce_quota(s, sandbox.tenant, quotas.QuotaDemand.of([sandbox]))

        return await self._create_with_op(op, [sandbox], replay, (sandbox, op, True), now, check)

    async def create_sandboxes(
        self, sandboxes: list[Sandbox], op: Operation, snapshot: Snapshot | None = None
    ) -> tuple[list[Sandbox], Operation, bool]:
        """Insert several sandboxes (a fork), the snapshot they start from if it is new, and the
        operation, atomically.

        The sandbox ids go into ``op.request["sandbox_ids"]`` (in order); a replay with the same
        idempotency key returns those sandboxes, the existing operation and ``False``. The
        operation's ``target`` defaults to the first sandbox's parent (or the sandbox itself).
        """
        if not sandboxes:
            raise InvalidRequest("create_sandboxes needs at least one sandbox")
        for sb in sandboxes:
            _same_tenant(op, sb, "sandbox")
        sandbox_ids = [sb.id for sb in sandboxes]
        if len(set(sandbox_ids)) != len(sandbox_ids):
            raise InvalidRequest("create_sandboxes got the same sandbox id twice")
        _link_request(op, "sandbox_ids", sandbox_ids)
        if op.target is None:
            op.target = sandboxes[0].parent_id or sandboxes[0].id
        now = utcnow()
        for sb in sandboxes:
            _prepare_sandbox(sb, now)
        rows: list[Base] = list(sandboxes)
        if snapshot is not None:
            _same_tenant(op, snapshot, "snapshot")
            _prepare_snapshot(snapshot, now)
            rows.append(snapshot)

        async def replay(s: AsyncSession, prior: Operation) -> tuple[list[Sandbox], Operation, bool]:
            wanted = prior.request.get("sandbox_ids")
            if not isinstance(wanted, list) or not wanted:
                raise Conflict(
                    f"idempotency key {op.idempotency_key!r} was used for a request without sandboxes"
                )
            found = {sb.id: sb for sb in await s.scalars(select(Sandbox).where(Sandbox.id.in_(wanted)))}
            missing = [sid for sid in wanted if sid not in found]
            if missing:
                raise Conflict(f"operation {prior.id} names sandboxes that do not exist: {missing}")
            return [found[sid] for sid in wanted], prior, False

        demand = quotas.QuotaDemand.of(
            sandboxes, storage=snapshot is not None and snapshot.origin in quotas.STORAGE_CHECKED_ORIGINS)

        async def check(s: AsyncSession) -> None:
            await self._enforce_quota(s, op.tenant, demand)

        return await self._create_with_op(op, rows, replay, (list(sandboxes), op, True), now, check)

    async def get_sandbox(self, sandbox_id: str, tenant: str | None = None) -> Sandbox:
        """A sandbox; another tenant's is NotFound, exactly like a missing one."""
        async with self._tx(write=False) as s:
            sb = await s.get(Sandbox, sandbox_id)
        if sb is None or (tenant is not None and sb.tenant != tenant):
            raise NotFound(f"sandbox {sandbox_id} not found")
        return sb

    async def list_sandboxes(
        self,
        tenant: str | None = None,
        states: Sequence[str] | None = None,
        node_id: str | None = None,
    ) -> list[Sandbox]:
        q = select(Sandbox).order_by(Sandbox.created_at, Sandbox.id)
        if tenant is not None:
            q = q.where(Sandbox.tenant == tenant)
        if states is not None:
            q = q.where(Sandbox.state.in_([State(st) for st in states]))
        if node_id is not None:
            q = q.where(Sandbox.node_id == node_id)
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def set_sandbox_state(
        self,
        sandbox_id: str,
        state: State | str,
        *,
        expect: State | str | Sequence[State | str] | None = None,
        **fields: Any,
    ) -> Sandbox:
        """Move a sandbox to ``state`` (checked by :func:`space.lifecycle.transition`).

        ``expect`` makes it a compare-and-set: unless the current state is one of those given,
        InvalidState is raised and nothing changes. ``fields`` are set in the same write.
        """
        _check_sandbox_fields(fields)
        expected = None if expect is None else _states(expect)
        async with self._tx() as s:
            sb = await self._get(s, Sandbox, sandbox_id, "sandbox", lock=True)
            current = State(sb.state)
            if expected is not None and current not in expected:
                raise InvalidState(
                    f"sandbox {sandbox_id} is {current.value}, expected "
                    + " or ".join(sorted(st.value for st in expected)),
                    state=current.value,
                    allowed=allowed_actions(current),
                )
            new = transition(current, state)
            now = utcnow()
            for name, value in fields.items():
                setattr(sb, name, value)
            sb.state = new
            sb.generation += 1
            sb.updated_at = now
            if new in _GONE and current not in _GONE:
                # Whatever deletes it: its E2B tokens (and URLs signed with them) die with it.
                sb.token_nonce = ids.token_nonce()
            if new == State.TERMINATED and sb.terminated_at is None:
                sb.terminated_at = now
            return sb

    async def update_sandbox(self, sandbox_id: str, **fields: Any) -> Sandbox:
        """Change non-state columns (see ``SANDBOX_FIELDS``)."""
        _check_sandbox_fields(fields)
        async with self._tx() as s:
            sb = await self._get(s, Sandbox, sandbox_id, "sandbox", lock=True)
            for name, value in fields.items():
                setattr(sb, name, value)
            sb.generation += 1
            sb.updated_at = utcnow()
            return sb

    async def touch_sandbox(self, sandbox_id: str, at: dt.datetime) -> None:
        """Record activity at ``at``; an older report than the one stored changes nothing.

        Neither the generation nor ``updated_at`` moves: activity is not a change of the sandbox,
        and bumping would make every watcher re-read it. An unknown id is silently ignored.
        """
        _require_aware(at, "at")
        async with self._tx() as s:
            await s.execute(
                update(Sandbox)
                .where(
                    Sandbox.id == sandbox_id,
                    or_(Sandbox.last_active_at.is_(None), Sandbox.last_active_at < at),
                )
                .values(last_active_at=at)
                .execution_options(synchronize_session=False)
            )

    # ---- snapshots ------------------------------------------------------------------------------

    async def create_snapshot(
        self, snap: Snapshot, op: Operation | None = None
    ) -> tuple[Snapshot, Operation | None, bool]:
        """Insert a snapshot row and, if given, the operation that takes it, atomically.

        The operation's ``request["snapshot"]`` names the snapshot (set here when absent), which
        also makes :meth:`snapshot_in_use` true while it is pending or running; its ``target``
        defaults to the sandbox. A replayed idempotency key returns the existing pair and False.
        """
        now = utcnow()
        _prepare_snapshot(snap, now)
        if op is None:
            async with self._tx() as s:
                s.add(snap)
            return snap, None, True
        _same_tenant(op, snap, "snapshot")
        _link_request(op, "snapshot", snap.id)
        if op.target is None:
            op.target = snap.sandbox_id

        async def replay(s: AsyncSession, prior: Operation) -> tuple[Snapshot, Operation | None, bool]:
            found = None
            snapshot_id = prior.request.get("snapshot")
            if isinstance(snapshot_id, str):
                found = await s.get(Snapshot, snapshot_id)
            if found is None:
                raise Conflict(
                    f"idempotency key {op.idempotency_key!r} was used for a request without a snapshot"
                )
            return found, prior, False

        return await self._create_with_op(op, [snap], replay, (snap, op, True), now)

    async def get_snapshot(self, snapshot_id: str, tenant: str | None = None) -> Snapshot:
        """A snapshot; another tenant's is NotFound, exactly like a missing one."""
        async with self._tx(write=False) as s:
            snap = await s.get(Snapshot, snapshot_id)
        if snap is None or (tenant is not None and snap.tenant != tenant):
            raise NotFound(f"snapshot {snapshot_id} not found")
        return snap

    async def list_snapshots(
        self,
        *,
        sandbox_id: str | None = None,
        tenant: str | None = None,
        kinds: Sequence[str] | None = None,
        statuses: Sequence[str] | None = None,
        node_id: str | None = None,
        restorable: bool | None = None,
        name: str | None = None,
        retain: bool | None = None,
    ) -> list[Snapshot]:
        """Snapshots, oldest first; every filter left None matches everything."""
        q = select(Snapshot).order_by(Snapshot.created_at, Snapshot.id)
        if name is not None:
            q = q.where(Snapshot.name == name)
        if retain is not None:
            q = q.where(Snapshot.retain.is_(retain))
        if sandbox_id is not None:
            q = q.where(Snapshot.sandbox_id == sandbox_id)
        if tenant is not None:
            q = q.where(Snapshot.tenant == tenant)
        if kinds is not None:
            q = q.where(Snapshot.kind.in_(list(kinds)))
        if statuses is not None:
            q = q.where(Snapshot.status.in_(list(statuses)))
        if node_id is not None:
            q = q.where(Snapshot.node_id == node_id)
        if restorable is not None:
            q = q.where(Snapshot.restorable.is_(restorable))
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def update_snapshot(self, snapshot_id: str, **fields: Any) -> Snapshot:
        """Change the columns in ``SNAPSHOT_FIELDS``; ``updated_at`` moves."""
        bad = sorted(set(fields) - SNAPSHOT_FIELDS)
        if bad:
            raise InvalidRequest(f"cannot set snapshot field(s) {', '.join(bad)}")
        if "status" in fields:
            _check_choice("snapshot status", fields["status"], SNAPSHOT_STATUSES)
        async with self._tx() as s:
            snap = await self._get(s, Snapshot, snapshot_id, "snapshot", lock=True)
            for name, value in fields.items():
                setattr(snap, name, value)
            snap.updated_at = utcnow()
            return snap

    async def latest_snapshot(
        self,
        sandbox_id: str,
        *,
        kind: str | None = None,
        restorable: bool | None = True,
        node_id: str | None = None,
    ) -> Snapshot | None:
        """The newest ready snapshot of a sandbox, or None.

        ``restorable`` filters exactly like in :meth:`list_snapshots`: True only uploaded ones,
        False only not-yet-uploaded ones, None either.
        """
        q = (
            select(Snapshot)
            .where(Snapshot.sandbox_id == sandbox_id, Snapshot.status == "ready")
            .order_by(Snapshot.created_at.desc(), Snapshot.id.desc())
            .limit(1)
        )
        if kind is not None:
            q = q.where(Snapshot.kind == kind)
        if restorable is not None:
            q = q.where(Snapshot.restorable.is_(restorable))
        if node_id is not None:
            q = q.where(Snapshot.node_id == node_id)
        async with self._tx(write=False) as s:
            return await s.scalar(q)

    async def delete_snapshot_row(self, snapshot_id: str) -> Snapshot:
        """Mark a snapshot deleted; the row stays, for the audit trail."""
        return await self.update_snapshot(snapshot_id, status="deleted")

    async def snapshot_in_use(self, snapshot_id: str) -> bool:
        """Whether deleting the snapshot now would break something (see :meth:`snapshots_in_use`)."""
        return snapshot_id in await self.snapshots_in_use()

    async def snapshots_in_use(self) -> set[str]:
        """Every snapshot that must not be deleted now: one a pending or running operation names
        (``request["snapshot"]`` or in ``request["snapshots"]``), or one a sandbox that is not
        terminated keeps its suspended state in (``Sandbox.snapshot_id``)."""
        async with self._tx(write=False) as s:
            held = await s.scalars(
                select(Sandbox.snapshot_id)
                .where(Sandbox.snapshot_id.is_not(None), Sandbox.state != State.TERMINATED)
            )
            out = {str(h) for h in held}
            # Active operations are few, and JSON containment differs per dialect: read in Python.
            requests = await s.scalars(
                select(Operation.request).where(Operation.status.in_(OPERATION_ACTIVE))
            )
            for req in requests:
                out.update(_snapshots_named(req))
            return out

    # ---- events ---------------------------------------------------------------------------------

    async def add_event(
        self,
        sandbox_id: str,
        tenant: str,
        kind: str,
        message: str,
        data: dict[str, Any] | None = None,
    ) -> SandboxEvent:
        ev = SandboxEvent(sandbox_id=sandbox_id, tenant=tenant, at=utcnow(), kind=kind,
                          message=message, data=dict(data or {}))
        async with self._tx() as s:
            s.add(ev)
            await s.flush()  # assigns the id
        return ev

    async def list_events(
        self, sandbox_id: str, *, after: int = 0, limit: int = 1000
    ) -> list[SandboxEvent]:
        """Events with ``id > after``, oldest first, at most ``limit``."""
        q = (
            select(SandboxEvent)
            .where(SandboxEvent.sandbox_id == sandbox_id, SandboxEvent.id > after)
            .order_by(SandboxEvent.id)
            .limit(limit)
        )
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    # ---- quotas ---------------------------------------------------------------------------------
    # Limits per tenant (``tenant_quotas``; a tenant whose limits were never set gets the defaults'
    # row, a NULL column is unlimited) and their usage; what counts and when is documented in
    # space/store/quotas.py. Enforcement is inside the write transactions that insert sandboxes and
    # snapshots (create_sandbox, create_sandboxes, start_operation); check_quota is only an early,
    # non-atomic test.

    async def get_quota(self, tenant: str) -> TenantQuota | None:
        async with self._tx(write=False) as s:
            return await s.get(TenantQuota, tenant)

    async def effective_quota(self, tenant: str) -> tuple[quotas.Limits | None, str]:
        """The limits that hold for ``tenant`` and their source (:func:`space.store.quotas.effective`)."""
        async with self._tx(write=False) as s:
            return quotas.effective(await s.execute(quotas.LIMITS, {"tenant": tenant}), tenant)

    async def put_quota(self, tenant: str, limits: Mapping[str, int | float | None]) -> TenantQuota:
        """Set the limits named in ``limits`` (None: unlimited); the others stay as they are. From
        then on the tenant has limits of its own: the defaults no longer apply to it. ``tenant``
        :data:`space.store.quotas.DEFAULTS` sets the defaults."""
        if not tenant:
            raise InvalidRequest("tenant must not be empty")
        bad = sorted(set(limits) - set(quotas.LIMIT_FIELDS))
        if bad:
            raise InvalidRequest(f"unknown quota resource(s) {', '.join(bad)}")
        values: dict[str, Any] = {"quota_set": True}
        for name, value in limits.items():
            if value is not None and (value < 0 or (name != "cpu" and int(value) != value)):
                raise InvalidRequest(f"quota {name} must be a non-negative {'number' if name == 'cpu' else 'integer'}"
                                     " or null (unlimited)", field=name)
            values[name] = None if value is None else (float(value) if name == "cpu" else int(value))
        return await self._upsert_quota(tenant, values)

    async def seed_quota(self, tenant: str, limits: Mapping[str, int | float | None]) -> bool:
        """Set ``tenant``'s limits only if they were never set; whether it did."""
        async with self._tx(write=False) as s:
            row = await s.get(TenantQuota, tenant)
        if row is not None and row.quota_set:
            return False
        await self.put_quota(tenant, limits)
        return True

    async def set_tenant_egress(self, tenant: str, egress: dict[str, Any]) -> TenantQuota:
        """Store the tenant's default egress policy (validated by the caller); limits stay."""
        if not tenant:
            raise InvalidRequest("tenant must not be empty")
        return await self._upsert_quota(tenant, {"egress": dict(egress)})

    async def set_tenant_ceiling(self, tenant: str, ceiling: list[str] | None) -> TenantQuota:
        """Store the private ranges the operator opens to the tenant (validated by the caller;
        None: the deployment's); limits and egress default stay."""
        if not tenant:
            raise InvalidRequest("tenant must not be empty")
        return await self._upsert_quota(tenant, {"egress_ceiling": None if ceiling is None else list(ceiling)})

    async def _upsert_quota(self, tenant: str, values: dict[str, Any]) -> TenantQuota:
        now = utcnow()
        stmt = self._insert(TenantQuota).values({"tenant": tenant, "egress": {}, "updated_at": now, **values})
        stmt = stmt.on_conflict_do_update(index_elements=[TenantQuota.tenant], set_={**values, "updated_at": now})
        async with self._tx() as s:
            await s.execute(stmt)
            return await self._get(s, TenantQuota, tenant, "quota")

    async def quota_usage(self, tenant: str) -> quotas.QuotaUsage:
        async with self._tx(write=False) as s:
            counted = (await s.execute(quotas.SANDBOX_USAGE, {"tenant": tenant})).one_or_none()
            stored = await s.scalar(quotas.STORAGE_USAGE, {"tenant": tenant})
        return quotas.usage_from(counted, stored)

    async def check_quota(self, tenant: str, demand: quotas.QuotaDemand) -> None:
        """QuotaExceeded if ``demand`` would pass a limit now (not atomic with any write: the
        write checks again; this is for refusing early, e.g. before claiming a warm sandbox)."""
        if self._fast is not None:
            # SQLite: a read never waits in WAL mode, so the synchronous driver SQL (~0.1 ms) is
            # cheaper than the trips to aiosqlite's thread (~1.5 ms) on the create path.
            with _translate_errors(), self._fast.connect() as conn, conn.begin():
                self._check_sqlite(conn, tenant, demand)
            return
        args = {"tenant": tenant}
        async with self._tx(write=False) as s:
            limits, _ = quotas.effective(await s.execute(quotas.LIMITS, args), tenant)
            if limits is None or not quotas.relevant(limits, demand):
                return
            counted = (await s.execute(quotas.SANDBOX_USAGE, args)).one_or_none() if demand.sandboxes else None
            stored = await s.scalar(quotas.STORAGE_USAGE, args) if demand.storage else 0
        quotas.enforce(tenant, limits, quotas.usage_from(counted, stored), demand)

    async def _enforce_quota(self, s: AsyncSession, tenant: str, demand: quotas.QuotaDemand) -> None:
        """Inside a write transaction: lock the tenant's row (PostgreSQL) and check ``demand``."""
        if demand.empty:
            return
        args = {"tenant": tenant}
        rows = list(await s.execute(quotas.LIMITS, args))
        limits, _ = quotas.effective(rows, tenant)
        if limits is None or not quotas.relevant(limits, demand):
            return
        if self.dialect == "postgresql":
            if not any(row[0] == tenant for row in rows):
                # A tenant on the defaults has no row to lock yet: make one (its limits stay unset).
                await s.execute(self._insert(TenantQuota).values(tenant=tenant, egress={}, updated_at=utcnow())
                                .on_conflict_do_nothing(index_elements=[TenantQuota.tenant]))
            await s.execute(quotas.OWN_LOCKED, args)
        counted = (await s.execute(quotas.SANDBOX_USAGE, args)).one_or_none() if demand.sandboxes else None
        stored = await s.scalar(quotas.STORAGE_USAGE, args) if demand.storage else 0
        quotas.enforce(tenant, limits, quotas.usage_from(counted, stored), demand)

    @classmethod
    def _enforce_quota_sync(cls, s: Session, tenant: str, demand: quotas.QuotaDemand) -> None:
        """:meth:`_enforce_quota` for the synchronous SQLite fast writer (create_sandbox): it runs
        on the event loop, inside the create's write lock."""
        cls._check_sqlite(s.connection(), tenant, demand)

    @staticmethod
    def _check_sqlite(conn: Connection, tenant: str, demand: quotas.QuotaDemand) -> None:
        """The quota test in driver SQL on a synchronous SQLite connection (~25 µs a lookup
        against ~130 µs through the ORM)."""
        if demand.empty:
            return
        limits, _ = quotas.effective(conn.exec_driver_sql(quotas.SQLITE_LIMITS, (tenant,)).all(), tenant)
        if limits is None or not quotas.relevant(limits, demand):
            return
        counted = (conn.exec_driver_sql(quotas.SQLITE_SANDBOX_USAGE, (tenant,)).first()
                   if demand.sandboxes else None)
        stored = conn.exec_driver_sql(quotas.SQLITE_STORAGE_USAGE, (tenant,)).scalar() if demand.storage else 0
        quotas.enforce(tenant, limits, quotas.usage_from(counted, stored), demand)

    # ---- egress ---------------------------------------------------------------------------------

    async def tenant_egress(self, tenant: str) -> dict[str, Any]:
        """The tenant's default egress policy ({} when it has none)."""
        async with self._tx(write=False) as s:
            row = await s.get(TenantQuota, tenant)
            return dict(row.egress or {}) if row is not None else {}

    async def tenant_egress_limits(self, tenant: str) -> tuple[dict[str, Any], list[str] | None]:
        """The tenant's default egress policy and its ceiling (None: the deployment's), at once."""
        async with self._tx(write=False) as s:
            row = await s.get(TenantQuota, tenant)
            if row is None:
                return {}, None
            return dict(row.egress or {}), (list(row.egress_ceiling) if row.egress_ceiling is not None else None)

    # ---- audit ----------------------------------------------------------------------------------

    async def record_audit(self, records: Sequence[AuditRecord]) -> None:
        """Append audit records in one transaction (a gateway ships its decisions in batches)."""
        if not records:
            return
        now = utcnow()
        for rec in records:
            rec.at = rec.at or now
            rec.target = rec.target or ""
            rec.details = dict(rec.details or {})
        async with self._tx() as s:
            s.add_all(records)

    async def list_audit(
        self,
        tenant: str | None,
        *,
        action: str | None = None,
        target: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[AuditRecord]:
        """Records with ``id > after``, oldest first. ``action`` ending in ``.`` matches a prefix
        (``egress.`` → every egress decision); ``tenant=None`` is every tenant (admins)."""
        q = select(AuditRecord).where(AuditRecord.id > after)
        if tenant is not None:
            q = q.where(AuditRecord.tenant == tenant)
        if action:
            q = q.where(AuditRecord.action.startswith(action) if action.endswith(".")
                        else AuditRecord.action == action)
        if target:
            q = q.where(AuditRecord.target == target)
        async with self._tx(write=False) as s:
            return list(await s.scalars(q.order_by(AuditRecord.id).limit(limit)))

    # ---- secrets --------------------------------------------------------------------------------
    # Rows only: validation, encryption and auditing are space.credentials' business. A row never
    # holds a value in clear (``ciphertext`` or a vault ``ref``).

    async def put_secret(self, row: Secret) -> tuple[Secret, bool]:
        """Create a secret, or replace the tenant's secret of the same scope and name (its id,
        ``created_at`` and ``created_by`` stay). Returns the stored row and whether it is new."""
        for attempt in range(2):
            now = utcnow()
            try:
                async with self._tx() as s:
                    found = await s.scalar(
                        select(Secret).where(Secret.tenant == row.tenant, Secret.scope == row.scope,
                                             Secret.name == row.name).with_for_update()
                    )
                    if found is None:
                        fresh = Secret(**{f: getattr(row, f) for f in _SECRET_COPY},
                                       id=row.id or ids.secret_id(), tenant=row.tenant, scope=row.scope,
                                       name=row.name, created_by=row.created_by or "",
                                       created_at=now, updated_at=now)
                        s.add(fresh)
                        return fresh, True
                    for f in _SECRET_COPY:
                        setattr(found, f, getattr(row, f))
                    found.updated_at = now
                    return found, False
            except Conflict:
                # A concurrent create of the same name committed first: replace that one.
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def get_secret(self, tenant: str, scope: str, name: str) -> Secret:
        async with self._tx(write=False) as s:
            row = await s.scalar(select(Secret).where(Secret.tenant == tenant, Secret.scope == scope,
                                                      Secret.name == name))
        if row is None:
            raise NotFound(f"secret {name} not found in scope {scope}", secret=name, scope=scope)
        return row

    async def list_secrets(
        self,
        tenant: str | None,
        *,
        scopes: Sequence[str] | None = None,
        names: Sequence[str] | None = None,
        backend: str | None = None,
    ) -> list[Secret]:
        """Secrets by name then scope; ``tenant=None`` is every tenant (key rotation)."""
        q = select(Secret).order_by(Secret.name, Secret.scope)
        if tenant is not None:
            q = q.where(Secret.tenant == tenant)
        if scopes is not None:
            q = q.where(Secret.scope.in_(list(scopes)))
        if names is not None:
            q = q.where(Secret.name.in_(list(names)))
        if backend is not None:
            q = q.where(Secret.backend == backend)
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def delete_secret(self, tenant: str, scope: str, name: str) -> Secret:
        """Delete the row and return it (its backend may still hold the value to forget)."""
        async with self._tx() as s:
            row = await s.scalar(select(Secret).where(Secret.tenant == tenant, Secret.scope == scope,
                                                      Secret.name == name).with_for_update())
            if row is None:
                raise NotFound(f"secret {name} not found in scope {scope}", secret=name, scope=scope)
            await s.delete(row)
            return row

    async def reseal_secret(self, secret_id: str, *, old_key_id: str | None, ciphertext: bytes,
                            key_id: str) -> bool:
        """Swap in a value re-encrypted under another key, unless the row changed meanwhile
        (then False: a concurrent set already sealed it anew)."""
        async with self._tx() as s:
            res = await s.execute(
                update(Secret)
                .where(Secret.id == secret_id, Secret.backend == "builtin",
                       Secret.key_id == old_key_id if old_key_id is not None else Secret.key_id.is_(None))
                .values(ciphertext=ciphertext, key_id=key_id)
                .execution_options(synchronize_session=False)
            )
            return _rowcount(res) == 1

    # ---- operations -----------------------------------------------------------------------------

    async def create_operation(self, op: Operation) -> tuple[Operation, bool]:
        """Insert an operation; an idempotency key the tenant already used returns that one."""
        _prepare_operation(op, utcnow())

        async def existing(s: AsyncSession) -> tuple[Operation, bool] | None:
            prior = await self._find_idempotent(s, op)
            return None if prior is None else (prior, False)

        def insert(s: AsyncSession) -> tuple[Operation, bool]:
            s.add(op)
            return op, True

        return await self._idempotent_create(op, existing, insert)

    async def start_operation(
        self,
        op: Operation,
        *,
        move_to: State | None = None,
        expect: State | str | Sequence[State | str] | None = None,
        snapshot: Snapshot | None = None,
    ) -> tuple[Sandbox, Operation, bool]:
        """Record ``op`` on the sandbox ``op.target`` and, in the same transaction, insert the
        ``snapshot`` it makes and move the sandbox to ``move_to`` (a compare-and-set against
        ``expect``): a crash leaves all of it or none, never a state without the operation that
        finishes it. An idempotency key the tenant already used returns the earlier operation."""
        now = utcnow()
        _prepare_operation(op, now)
        if snapshot is not None:
            _same_tenant(op, snapshot, "snapshot")
            _link_request(op, "snapshot", snapshot.id)
            _prepare_snapshot(snapshot, now)
        expected = None if expect is None else _states(expect)

        async def existing(s: AsyncSession) -> tuple[Sandbox, Operation, bool] | None:
            prior = await self._find_idempotent(s, op)
            if prior is None:
                return None
            return await self._get(s, Sandbox, prior.target, "sandbox"), prior, False

        try:
            async with self._tx() as s:
                found = await existing(s)
                if found is not None:
                    return found
                if snapshot is not None and snapshot.origin in quotas.STORAGE_CHECKED_ORIGINS:
                    await self._enforce_quota(s, op.tenant, quotas.QuotaDemand(storage=True))
                sb = await self._get(s, Sandbox, op.target, "sandbox", lock=True)
                if move_to is not None:
                    current = State(sb.state)
                    if expected is not None and current not in expected:
                        raise InvalidState(
                            f"sandbox {sb.id} is {current.value}, expected "
                            + " or ".join(sorted(st.value for st in expected)),
                            state=current.value, allowed=allowed_actions(current))
                    sb.state = transition(current, move_to)
                    sb.generation += 1
                    sb.updated_at = now
                s.add_all([*([snapshot] if snapshot is not None else []), op])
                return sb, op, True
        except InvalidState:
            raise
        except Conflict:
            if op.idempotency_key is None:
                raise
        async with self._tx(write=False) as s:  # a concurrent request with the same key won
            found = await existing(s)
        if found is None:
            raise Conflict(f"operation {op.id} conflicts with an existing row")
        return found

    async def _find_idempotent(self, s: AsyncSession, op: Operation) -> Operation | None:
        if op.idempotency_key is None:
            return None
        prior = await s.scalar(
            select(Operation).where(
                Operation.tenant == op.tenant, Operation.idempotency_key == op.idempotency_key
            )
        )
        if prior is not None and prior.kind != op.kind:
            raise Conflict(
                f"idempotency key {op.idempotency_key!r} was already used for a {prior.kind} operation",
                operation_id=prior.id,
            )
        return prior

    async def _create_with_op(
        self,
        op: Operation,
        rows: Sequence[Base],
        replay: Callable[[AsyncSession, Operation], Awaitable[_T]],
        created: _T,
        now: dt.datetime | None = None,
        check: Callable[[AsyncSession], Awaitable[None]] | None = None,
    ) -> _T:
        """Insert ``rows`` and ``op`` in one transaction, or, when the op's idempotency key was
        used before, return what ``replay`` makes of the earlier operation. ``check`` runs in the
        same transaction before a new insert (the quota), never before a replay."""
        _prepare_operation(op, now or utcnow())

        async def existing(s: AsyncSession) -> _T | None:
            prior = await self._find_idempotent(s, op)
            if prior is None:
                if check is not None:
                    await check(s)
                return None
            return await replay(s, prior)

        def insert(s: AsyncSession) -> _T:
            s.add_all([*rows, op])
            return created

        return await self._idempotent_create(op, existing, insert)

    async def _idempotent_create(
        self,
        op: Operation,
        existing: Callable[[AsyncSession], Any],
        insert: Callable[[AsyncSession], _T],
    ) -> _T:
        try:
            async with self._tx() as s:
                found = await existing(s)
                if found is not None:
                    return cast(_T, found)
                return insert(s)
        except Conflict:
            if op.idempotency_key is None:
                raise
        # A concurrent request with the same key committed first (the unique constraint stopped
        # us): its rows are visible now.
        log.debug("idempotent create lost a race", key=op.idempotency_key, tenant=op.tenant)
        async with self._tx(write=False) as s:
            found = await existing(s)
        if found is None:
            raise Conflict(f"operation {op.id} conflicts with an existing row")
        return cast(_T, found)

    async def get_operation(self, op_id: str, tenant: str | None = None) -> Operation:
        async with self._tx(write=False) as s:
            op = await s.get(Operation, op_id)
        if op is None or (tenant is not None and op.tenant != tenant):
            raise NotFound(f"operation {op_id} not found")
        return op

    async def find_operations(
        self,
        *,
        target: str | None = None,
        status: Sequence[str] | None = None,
        kind: str | None = None,
    ) -> list[Operation]:
        q = select(Operation).order_by(Operation.created_at, Operation.id)
        if target is not None:
            q = q.where(Operation.target == target)
        if status is not None:
            q = q.where(Operation.status.in_(list(status)))
        if kind is not None:
            q = q.where(Operation.kind == kind)
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))

    async def claim_operation(
        self,
        owner: str,
        lease_seconds: float,
        kinds: Sequence[str] | None = None,
        op_id: str | None = None,
    ) -> Operation | None:
        """Take the oldest pending operation, or a running one whose lease expired.

        The claim sets ``running``, the lease and ``attempts += 1``. With ``op_id`` only that
        operation is considered. None when there is nothing to take.
        """
        now = utcnow()
        claimable = or_(
            Operation.status == "pending",
            and_(
                Operation.status == "running",
                or_(Operation.lease_expires_at.is_(None), Operation.lease_expires_at < now),
            ),
        )
        where: list[ColumnElement[bool]] = [claimable]
        if kinds is not None:
            where.append(Operation.kind.in_(list(kinds)))
        if op_id is not None:
            where.append(Operation.id == op_id)
        candidates = select(Operation.id).where(*where).order_by(Operation.created_at, Operation.id)
        if self.dialect == "postgresql":
            # Claimers skip each other's candidates instead of queueing behind them.
            candidates = candidates.with_for_update(skip_locked=True)
        async with self._tx() as s:
            for cand in list(await s.scalars(candidates.limit(8))):
                res = await s.execute(
                    update(Operation)
                    .where(Operation.id == cand, claimable)
                    .values(
                        status="running",
                        lease_owner=owner,
                        lease_expires_at=now + dt.timedelta(seconds=lease_seconds),
                        attempts=Operation.attempts + 1,
                        updated_at=now,
                    )
                    .execution_options(synchronize_session=False)
                )
                if _rowcount(res) == 1:
                    claimed = await self._get(s, Operation, cand, "operation")
                    log.debug("operation claimed", op_id=cand, owner=owner, attempts=claimed.attempts)
                    return claimed
        return None

    async def renew_lease(self, op_id: str, owner: str, lease_seconds: float) -> bool:
        """Extend ``owner``'s lease; False if the operation is no longer running under it."""
        now = utcnow()
        async with self._tx() as s:
            res = await s.execute(
                update(Operation)
                .where(Operation.id == op_id, Operation.status == "running", Operation.lease_owner == owner)
                .values(lease_expires_at=now + dt.timedelta(seconds=lease_seconds), updated_at=now)
                .execution_options(synchronize_session=False)
            )
            return _rowcount(res) == 1

    async def set_operation_progress(self, op_id: str, progress: dict[str, Any]) -> None:
        async with self._tx() as s:
            res = await s.execute(
                update(Operation).where(Operation.id == op_id)
                .values(progress=progress, updated_at=utcnow())
                .execution_options(synchronize_session=False)
            )
            if _rowcount(res) == 0:
                raise NotFound(f"operation {op_id} not found")

    async def finish_operation(
        self,
        op_id: str,
        status: str,
        *,
        result: dict[str, Any] | None = None,
        error_code: str | None = None,
        error_message: str | None = None,
        owner: str | None = None,
    ) -> Operation:
        """Record the outcome and release the lease.

        With ``owner``, only the holder of the lease may finish (Conflict otherwise), so a
        controller that lost its lease cannot overwrite the work of the one that took over.
        """
        if status not in OPERATION_FINAL:
            raise InvalidRequest(f"invalid final status {status!r}: must be succeeded or failed")
        async with self._tx() as s:
            op = await self._get(s, Operation, op_id, "operation", lock=True)
            if owner is not None and op.lease_owner != owner:
                raise Conflict(
                    f"operation {op_id} is leased by {op.lease_owner!r}, not {owner!r}",
                    lease_owner=op.lease_owner,
                )
            now = utcnow()
            op.status = status
            op.result = result
            op.error_code = error_code
            op.error_message = error_message
            op.lease_expires_at = None
            op.finished_at = now
            op.updated_at = now
            return op

    async def append_operation_logs(self, op_id: str, lines: Sequence[str]) -> int:
        """Append lines (numbered from 1 per operation); returns the last sequence number."""
        async with self._tx() as s:
            # Locking the operation row serializes appenders, so sequence numbers never collide.
            found = await s.scalar(select(Operation.id).where(Operation.id == op_id).with_for_update())
            if found is None:
                raise NotFound(f"operation {op_id} not found")
            last = await s.scalar(
                select(func.coalesce(func.max(OperationLog.seq), 0)).where(OperationLog.op_id == op_id)
            )
            seq = int(last or 0)
            if lines:
                now = utcnow()
                s.add_all(
                    OperationLog(op_id=op_id, seq=seq + i, line=line, at=now)
                    for i, line in enumerate(lines, start=1)
                )
            return seq + len(lines)

    async def get_operation_logs(self, op_id: str, after: int = 0, limit: int = 1000) -> list[OperationLog]:
        """Lines with ``seq > after``, oldest first, at most ``limit``."""
        q = (
            select(OperationLog)
            .where(OperationLog.op_id == op_id, OperationLog.seq > after)
            .order_by(OperationLog.seq)
            .limit(limit)
        )
        async with self._tx(write=False) as s:
            return list(await s.scalars(q))



#: States of a sandbox that is being or has been deleted.
_GONE = frozenset({State.TERMINATING, State.TERMINATED})


def _states(expect: State | str | Sequence[State | str]) -> frozenset[State]:
    if isinstance(expect, str):  # a State is a str too
        return frozenset({State(expect)})
    return frozenset(State(st) for st in expect)


def _check_sandbox_fields(fields: Iterable[str]) -> None:
    bad = sorted(set(fields) - SANDBOX_FIELDS)
    if bad:
        raise InvalidRequest(f"cannot set sandbox field(s) {', '.join(bad)}")


def _check_choice(what: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise InvalidRequest(f"invalid {what} {value!r}: must be one of {', '.join(allowed)}")


def _require_aware(value: dt.datetime, what: str) -> None:
    if value.tzinfo is None:
        raise InvalidRequest(f"{what} must be a timezone-aware datetime, got {value!r}")


def _same_tenant(op: Operation, row: Sandbox | Snapshot, what: str) -> None:
    if row.tenant != op.tenant:
        raise InvalidRequest(f"the {what} and its operation must belong to the same tenant")


def _link_request(op: Operation, key: str, value: Any) -> None:
    """Record in the operation's request what it creates, so that a replay can find it."""
    request = dict(op.request or {})
    if key in request and request[key] != value:
        raise InvalidRequest(f"operation request has {key}={request[key]!r}, expected {value!r}")
    request[key] = value
    op.request = request


def _snapshots_named(request: dict[str, Any] | None) -> set[str]:
    if not isinstance(request, dict):
        return set()
    out = {str(request["snapshot"])} if request.get("snapshot") else set()
    many = request.get("snapshots")
    if isinstance(many, list):
        out.update(str(m) for m in many)
    return out


def _prepare_sandbox(sb: Sandbox, now: dt.datetime) -> None:
    sb.state = State(sb.state or State.CREATING)
    # Always its own: a row never inherits tokens (a fork's copy, an id seen before).
    sb.token_nonce = ids.token_nonce()
    sb.env = dict(sb.env or {})
    sb.meta = dict(sb.meta or {})
    sb.snapshot_policy = dict(sb.snapshot_policy or {})
    sb.generation = sb.generation or 1
    sb.created_at = sb.created_at or now
    sb.updated_at = sb.updated_at or now


def _prepare_snapshot(snap: Snapshot, now: dt.datetime) -> None:
    snap.status = snap.status or "creating"
    _check_choice("snapshot kind", snap.kind, SNAPSHOT_KINDS)
    _check_choice("snapshot origin", snap.origin, SNAPSHOT_ORIGINS)
    _check_choice("snapshot status", snap.status, SNAPSHOT_STATUSES)
    snap.restorable = bool(snap.restorable)
    snap.retain = bool(snap.retain)
    snap.meta = dict(snap.meta or {})
    snap.created_at = snap.created_at or now
    snap.updated_at = snap.updated_at or now


def _prepare_operation(op: Operation, now: dt.datetime) -> None:
    op.status = op.status or "pending"
    op.request = dict(op.request or {})
    op.attempts = op.attempts or 0
    op.created_at = op.created_at or now
    op.updated_at = op.updated_at or now


@contextlib.contextmanager
def _translate_errors() -> Any:
    try:
        yield
    except IntegrityError as e:
        raise Conflict(f"conflicting row: {_orig(e)}") from e
    except (OperationalError, InterfaceError) as e:
        raise Unavailable(f"database unavailable: {_orig(e)}") from e
    except DBAPIError as e:
        raise Internal(f"database error: {_orig(e)}") from e
    except OSError as e:  # asyncpg raises these directly while connecting
        raise Unavailable(f"database unavailable: {e}") from e


async def _translated(aw: Any) -> Any:
    with _translate_errors():
        return await aw


def _orig(e: DBAPIError) -> str:
    return str(e.orig).strip().splitlines()[0] if e.orig is not None else str(e)
