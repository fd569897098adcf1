"""SPACE: a self-hostable sandbox platform for AI agents."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from space.sdk import AsyncClient, Client

__all__ = ["AsyncClient", "Client"]


def __getattr__(name: str) -> Any:
    # Lazy: the SDK pulls in httpx (~170 ms), which server-side processes that only need
    # space.<something> (the runtime shim, the node agent) should not pay for at every start.
    if name in __all__:
        from space import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'space' has no attribute {name!r}")
