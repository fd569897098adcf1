"""What the API handlers share: the store, the controller, the node registry, the server secret."""

from __future__ import annotations

import dataclasses

from fastapi import Request

from space.api.auth import KeyCache
from space.controller import Controller, NodeRegistry
from space.store import Store


@dataclasses.dataclass
class AppState:
    store: Store
    nodes: NodeRegistry
    controller: Controller
    #: Key for attach tokens (HMAC); shared by every API replica.
    secret: bytes
    max_upload_bytes: int = 1 << 30
    keys: KeyCache = dataclasses.field(default_factory=KeyCache)


def app_state(request: Request) -> AppState:
    st: AppState = request.app.state.space
    return st
