"""Node membership: the join tokens operators make, and nodes joining with them.

A join token is ``spj_<id>.<secret>``: the id is public (listings, revocation), the secret is
stored as its sha256 only (it is 32 random bytes: a slow KDF would add nothing). A token admits
nodes and can do nothing else; it expires, may be limited to a number of uses, and can be revoked.

A node that joins under an id that exists already must hold the key that node joined with (its
certificate request is signed by it): a restarted node, or one at a new address, joins again; a
token holder cannot take over another node's id.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
from typing import Any

from sqlalchemy import delete, func, select

from space.errors import InvalidRequest, JoinTokenRefused, NodeBusy, NodeExists
from space.store.base import StoreBase
from space.store.models import JoinToken, Node, Sandbox, utcnow

TOKEN_PREFIX = "spj_"
_TOKEN = re.compile(r"spj_([a-z0-9]{8})\.([A-Za-z0-9_-]{32,64})")
#: A token lives a day unless its maker says otherwise, and at most a year.
DEFAULT_TTL = dt.timedelta(hours=24)
MAX_TTL = dt.timedelta(days=365)


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_token(text: str) -> tuple[str, str]:
    """``(id, secret)`` of a join token, or :class:`JoinTokenRefused` (one answer for every way a
    token can be malformed or unknown, so it tells a guesser nothing)."""
    m = _TOKEN.fullmatch(text.strip())
    if m is None:
        raise JoinTokenRefused("invalid join token")
    return m.group(1), m.group(2)


class MembershipStore(StoreBase):
    """Join tokens and joining nodes."""

    async def create_join_token(self, *, ttl: dt.timedelta = DEFAULT_TTL, description: str = "",
                                created_by: str = "", max_uses: int | None = None) -> tuple[JoinToken, str]:
        """A new token and its text (shown once: only its hash is kept)."""
        if not dt.timedelta(seconds=1) <= ttl <= MAX_TTL:
            raise InvalidRequest(f"a join token lives between 1 s and {MAX_TTL.days} days, not {ttl}")
        if max_uses is not None and max_uses < 1:
            raise InvalidRequest("max_uses must be at least 1")
        token_id = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
        secret = secrets.token_urlsafe(32)
        now = utcnow()
        row = JoinToken(id=token_id, secret_hash=_hash(secret), description=description[:256],
                        created_by=created_by[:64], created_at=now, expires_at=now + ttl, uses=0,
                        max_uses=max_uses)
        async with self._tx() as s:
            s.add(row)
        return row, f"{TOKEN_PREFIX}{token_id}.{secret}"

    async def list_join_tokens(self) -> list[JoinToken]:
        async with self._tx(write=False) as s:
            return list(await s.scalars(select(JoinToken).order_by(JoinToken.created_at)))

    async def revoke_join_token(self, token_id: str) -> JoinToken:
        async with self._tx() as s:
            row = await self._get(s, JoinToken, token_id, "join token", lock=True)
            if row.revoked_at is None:
                row.revoked_at = utcnow()
            return row

    async def check_join_token(self, text: str) -> JoinToken:
        """The token ``text`` names if it may admit a node now; :class:`JoinTokenRefused` otherwise."""
        async with self._tx(write=False) as s:
            return self._usable(await self._token_row(s, text), await self._db_now(s))

    async def join_node(self, token_text: str, *, node_id: str, url: str, certificate: str, key_sha256: str,
                        version: str | None, capacity: dict[str, Any]) -> Node:
        """Admit a node with a join token, in one transaction: the token is checked and counted,
        and the node row made (state ``joining`` until the controller's first heartbeat reaches
        it) or, for the holder of the node's key, given its new address and certificate."""
        async with self._tx() as s:
            now = await self._db_now(s)
            token = self._usable(await self._token_row(s, token_text, lock=True), now)
            node = await s.get(Node, node_id, with_for_update=True)
            if node is None:
                node = Node(id=node_id, url=url, token="", state="joining", capacity=capacity,
                            heartbeat_at=now, created_at=now)
                s.add(node)
            elif node.key_sha256 is None or not hmac.compare_digest(node.key_sha256, key_sha256):
                raise NodeExists(f"node {node_id} exists and joined with another key: remove it first "
                                 f"(`space node remove {node_id}`) or join under another id", node=node_id)
            node.url, node.token, node.certificate, node.key_sha256 = url, "", certificate, key_sha256
            node.version = version[:64] if version else None
            if node.state != "ready":
                node.state = "joining"
            token.uses += 1
            token.last_used_at = now
            await s.flush()
            return node

    async def remove_node(self, node_id: str) -> None:
        """Forget a node. Refused while sandboxes live on it (they would be orphaned)."""
        async with self._tx() as s:
            await self._get(s, Node, node_id, "node", lock=True)
            # Any sandbox row still naming the node (live, or stopped with its disk there).
            held = await s.scalar(select(func.count()).select_from(Sandbox).where(Sandbox.node_id == node_id))
            if held:
                raise NodeBusy(f"node {node_id} holds {held} sandboxes: delete or move them first",
                               node=node_id, sandboxes=held)
            await s.execute(delete(Node).where(Node.id == node_id))

    async def _token_row(self, s: Any, text: str, *, lock: bool = False) -> JoinToken:
        token_id, secret = parse_token(text)
        row: JoinToken | None = await s.get(JoinToken, token_id, with_for_update=lock)
        if row is None or not hmac.compare_digest(row.secret_hash, _hash(secret)):
            raise JoinTokenRefused("invalid join token")
        return row

    @staticmethod
    def _usable(row: JoinToken, now: dt.datetime) -> JoinToken:
        # Each refusal says why: the caller proved it holds the secret.
        if row.revoked_at is not None:
            raise JoinTokenRefused(f"join token {row.id} was revoked", token=row.id, reason="revoked")
        if row.expires_at <= now:
            raise JoinTokenRefused(f"join token {row.id} expired at {row.expires_at.isoformat()}",
                                   token=row.id, reason="expired")
        if row.max_uses is not None and row.uses >= row.max_uses:
            raise JoinTokenRefused(f"join token {row.id} was used {row.uses} times, its limit",
                                   token=row.id, reason="used_up")
        return row

