"""The one error hierarchy of SPACE, shared by the API, the node agent and the SDK.

Every error carries a stable machine-readable ``code``, the HTTP ``status`` it maps to and whether a
retry may succeed. On the wire it is ``{"error": {"code", "message", ...details}}``; the SDK turns
that body back into the same class with :func:`from_wire`.

    SpaceError
    ├── InvalidRequest        400 invalid_request
    │   └── InvalidPath       400 invalid_path
    ├── Unauthorized          401 unauthorized
    ├── Forbidden             403 forbidden
    ├── NotFound              404 not_found
    ├── Conflict              409 conflict
    │   ├── InvalidState      409 invalid_state   (names the state and the allowed actions)
    │   ├── PoolEmpty         409 pool_empty
    │   └── LeaseLost         409 lease_lost      (an operation's result from a controller that lost its lease)
    ├── RequestTimeout        408 request_timeout (the request's body stopped arriving)
    ├── PayloadTooLarge       413 too_large
    ├── ValidationFailed      422 validation_failed
    ├── QuotaExceeded         429 quota_exceeded
    ├── SnapshotCorrupt       409 snapshot_corrupt
    │   └── ObjectTampered    409 object_tampered (object storage holds what this deployment did not write)
    ├── RuntimeFailure        500 runtime_error
    │   └── CgroupsUnsupported 500 cgroups_unsupported (at a node's start: the host's cgroups lack what sandboxes need)
    ├── Internal              500 internal
    ├── BadGateway            502 bad_gateway     (a server inside a sandbox failed a proxied request)
    │   └── PortNotOpen       502 port_not_open
    ├── Unavailable           503 unavailable     (retryable)
    └── Timeout               504 timeout         (retryable)
"""

from __future__ import annotations

from typing import Any, ClassVar


class SpaceError(Exception):
    """Root of every error SPACE raises on purpose."""

    code: ClassVar[str] = "error"
    status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        body.update(self.details)
        return {"error": body}

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidRequest(SpaceError):
    code = "invalid_request"
    status = 400


class InvalidPath(InvalidRequest):
    code = "invalid_path"


class Unauthorized(SpaceError):
    code = "unauthorized"
    status = 401


class Forbidden(SpaceError):
    code = "forbidden"
    status = 403


class NotFound(SpaceError):
    code = "not_found"
    status = 404


class Conflict(SpaceError):
    code = "conflict"
    status = 409


class InvalidState(Conflict):
    """An action the sandbox's current state does not allow."""

    code = "invalid_state"

    def __init__(self, message: str, *, state: str, allowed: list[str], **details: Any) -> None:
        super().__init__(message, state=state, allowed=allowed, **details)
        self.state = state
        self.allowed = allowed


class RequestTimeout(SpaceError):
    """The client stopped sending its request's body before it was whole."""

    code = "request_timeout"
    status = 408


class PayloadTooLarge(SpaceError):
    code = "too_large"
    status = 413


class ValidationFailed(SpaceError):
    code = "validation_failed"
    status = 422


class QuotaExceeded(SpaceError):
    code = "quota_exceeded"
    status = 429


class SnapshotCorrupt(SpaceError):
    """A snapshot's artifacts are missing or do not match their manifest: it cannot be restored."""

    code = "snapshot_corrupt"
    status = 409


class ObjectTampered(SnapshotCorrupt):
    """Object storage holds something this deployment did not write: a manifest that is not sealed
    with its manifest key, fails its MAC or is bound to another tenant, sandbox, snapshot or
    template, or a template stream whose bytes do not hash to what its sealed manifest names.
    Nothing of it was used. ``key`` names the object, ``reason`` says which check refused it
    (:mod:`space.objauth`); once the bucket is repaired, the same request succeeds."""

    code = "object_tampered"


class PoolEmpty(Conflict):
    """No warm sandbox of that template and size is ready on the node (the caller boots one cold)."""

    code = "pool_empty"


class LeaseLost(Conflict):
    """The operation is no longer leased to this controller: another one took it over (fencing)."""

    code = "lease_lost"


class JoinTokenRefused(Unauthorized):
    """A join token that does not admit nodes (now): unknown, revoked, expired or used up."""

    code = "join_token_refused"


class NodeExists(Conflict):
    """A node joined under an id another node (with another key) holds."""

    code = "node_exists"


class NodeBusy(Conflict):
    """A node cannot be removed while sandboxes live on it."""

    code = "node_busy"


class InsufficientStorage(SpaceError):
    """The node's pool (or the object store) has no room for what was asked."""

    code = "insufficient_storage"
    status = 507


class RuntimeFailure(SpaceError):
    """The sandbox runtime (runsc, btrfs, the guest) failed to do what it was asked."""

    code = "runtime_error"
    status = 500


class CgroupsUnsupported(RuntimeFailure):
    """The host's cgroups cannot hold sandboxes (:mod:`space.runtime.cgroups`): raised when the node
    agent or its root helper starts; the message says what is missing and what the operator can do."""

    code = "cgroups_unsupported"


class KeyUnavailable(SpaceError):
    """The key-encryption key a tenant's data is sealed under cannot be used: its KMS refuses it
    (disabled, scheduled for deletion, deleted, access revoked) or does not know it. Nothing was
    restored, and no other key is tried; ``key`` names it, ``provider`` its KMS. Once the key is
    usable again, the same request succeeds."""

    code = "key_unavailable"
    status = 409


class Internal(SpaceError):
    code = "internal"
    status = 500


class BadGateway(SpaceError):
    """A request proxied to a server inside a sandbox got no usable answer from it."""

    code = "bad_gateway"
    status = 502


class PortNotOpen(BadGateway):
    """Nothing listens on the sandbox port a request was proxied to (or the sandbox has no network)."""

    code = "port_not_open"


class Unavailable(SpaceError):
    code = "unavailable"
    status = 503
    retryable = True


class Timeout(SpaceError):
    code = "timeout"
    status = 504
    retryable = True


def _all_subclasses(cls: type[SpaceError]) -> list[type[SpaceError]]:
    out: list[type[SpaceError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


BY_CODE: dict[str, type[SpaceError]] = {c.code: c for c in _all_subclasses(SpaceError)}


def from_wire(status: int, body: Any) -> SpaceError:
    """Rebuild the error a server sent; unknown codes fall back by HTTP status."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return _by_status(status)(f"HTTP {status}: {str(body)[:200]}")
    details = {k: v for k, v in err.items() if k not in ("code", "message")}
    message = str(err.get("message", ""))
    cls = BY_CODE.get(str(err.get("code")), _by_status(status))
    if cls is InvalidState:
        return InvalidState(
            message,
            state=str(details.pop("state", "unknown")),
            allowed=list(details.pop("allowed", [])),
            **details,
        )
    exc = cls(message, **details)
    return exc


def _by_status(status: int) -> type[SpaceError]:
    for cls in (InvalidRequest, Unauthorized, Forbidden, NotFound, RequestTimeout, Conflict, PayloadTooLarge,
                ValidationFailed, QuotaExceeded, InsufficientStorage, Unavailable, Timeout):
        if cls.status == status:
            return cls
    return Internal
