"""API keys → principals. Keys are bearer tokens stored hashed; every principal has one tenant."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac

from fastapi import Request

from space.errors import Forbidden, Unauthorized

ROLES = ("admin", "member", "readonly")


@dataclasses.dataclass(frozen=True)
class Principal:
    key_id: str
    tenant: str
    role: str

    def require_write(self) -> None:
        if self.role == "readonly":
            raise Forbidden("this API key is read-only")

    def require_admin(self) -> None:
        if self.role != "admin":
            raise Forbidden("this action needs an admin API key")


async def principal(request: Request) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    state = request.app.state.space
    row = await state.store.authenticate(key.strip())
    if row is None:
        raise Unauthorized("invalid API key")
    return Principal(key_id=row.id, tenant=row.tenant, role=row.role)


def attach_token(secret: bytes, sandbox_id: str, command_id: str) -> str:
    """A capability for one command's data plane, verifiable without a database lookup."""
    mac = hmac.new(secret, f"{sandbox_id}:{command_id}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac[:24]).decode().rstrip("=")


def check_attach_token(secret: bytes, sandbox_id: str, command_id: str, token: str) -> bool:
    return hmac.compare_digest(attach_token(secret, sandbox_id, command_id), token)
