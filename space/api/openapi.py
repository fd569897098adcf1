"""The OpenAPI document, true to what the server sends.

FastAPI documents each operation's success and a 422 with its own ``{"detail": [...]}`` schema; the
server answers every error as ``{"error": {"code", "message", ...}}`` (:mod:`space.web`) with the
status of its class (:mod:`space.errors`). :func:`install` makes the document say so: the error
schema is ``Error``, and each operation lists the error statuses it can answer, decided by what the
operation is (the rules of :func:`error_statuses`, the one place they are written down; the
schemathesis run in ``tests/security/test_api_fuzz.py`` fails on any status it meets undocumented).
Authentication is a bearer scheme on every ``/v1`` operation.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from space import errors
from space.api import fields

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
            # The details of each error class (space.errors): state, allowed, limit, field, ...
            "additionalProperties": True,
        },
    },
}
_ERROR_REF = {"$ref": "#/components/schemas/Error"}

#: ``openapi_extra`` of a route that reads its body raw (streamed, not parsed).
RAW_BODY: dict[str, Any] = {"requestBody": {"content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}

_MUTATING = frozenset({"post", "put", "patch", "delete"})
#: Reads that check the key's role or tenant (403): the operator's views, and every read of a named
#: tenant (a key reads only its own), whatever is added under /v1/tenants/{tenant}/ next.
_ROLE_CHECKED_READS = re.compile(r"^/v1/(audit|apikeys)$|^/v1/nodes(/|$)|^/v1/tenants/\{tenant\}/")
#: Operations that talk to a sandbox's guest through its node: whatever the node answers comes
#: back (a 502 from a server in the sandbox, 503 without a node, 504 when a wake takes too long,
#: 507 when the sandbox's disk is full), and the sandbox's state may refuse them (409).
_DATA_PLANE = re.compile(r"^/v1/sandboxes/\{sandbox_id\}/(commands|files)")
#: Operations that place a demand on the tenant's quota (429).
_QUOTA_CHECKED = frozenset({
    ("post", "/v1/sandboxes"), ("post", "/v1/sandboxes/{sandbox_id}/fork"),
    ("post", "/v1/sandboxes/{sandbox_id}/snapshots"), ("post", "/v1/sandboxes/{sandbox_id}/suspend"),
    ("post", "/v1/templates"),
})
#: Operations that need a part of the deployment that may not be configured, or a node (503): a
#: tenant's key is checked by a node, at its KMS.
_MAY_BE_UNAVAILABLE = re.compile(
    r"^/v1/(secrets|templates/blobs|pools|nodes/(tokens|join)|tenants/\{tenant\}/key$)"
    r"|^/v1/sandboxes(/\{sandbox_id\}/(snapshots|policy|restore|fork))?$")

_DESCRIPTIONS = {
    400: "Invalid request (`invalid_request`, `invalid_path`)",
    401: "Missing or unknown API key (`unauthorized`), or a join token that admits no node (`join_token_refused`)",
    403: "The key's role or tenant does not allow it (`forbidden`)",
    404: "Not found, or another tenant's (`not_found`)",
    408: "The request's body stopped arriving (`request_timeout`)",
    409: "Conflicts with the current state (`conflict`, `invalid_state`, `snapshot_corrupt`, `node_exists`, "
         "`node_busy`)",
    413: "The request's body is larger than its route allows (`too_large`)",
    422: "A parameter or the body fails validation (`validation_failed`)",
    429: "Over the tenant's quota (`quota_exceeded`)",
    500: "Internal error, or the sandbox runtime failed (`internal`, `runtime_error`)",
    502: "A server in the sandbox failed the request (`bad_gateway`, `port_not_open`)",
    503: "Not available now, or not configured (`unavailable`); retryable",
    504: "Timed out (`timeout`); retryable",
    507: "No room on the node or in object storage (`insufficient_storage`)",
}


def error_statuses(method: str, path: str, operation: dict[str, Any]) -> set[int]:
    """The error statuses ``method path`` can answer."""
    params = operation.get("parameters") or []
    body = "requestBody" in operation
    out = {errors.Internal.status}
    if not path.startswith("/v1/"):
        return out
    out.add(errors.Unauthorized.status)
    if params or body:
        out |= {errors.InvalidRequest.status, errors.ValidationFailed.status}
    if body or any(p.get("in") == "path" for p in params):
        out.add(errors.NotFound.status)  # what the path, or the body, names (a template, a snapshot)
    if body:
        out |= {errors.RequestTimeout.status, errors.PayloadTooLarge.status}
    if method in _MUTATING or _ROLE_CHECKED_READS.search(path):
        out.add(errors.Forbidden.status)
    if method in _MUTATING or path.startswith("/v1/sandboxes/{sandbox_id}/"):
        out.add(errors.Conflict.status)
    if _DATA_PLANE.match(path):
        out |= {errors.BadGateway.status, errors.Unavailable.status, errors.Timeout.status,
                errors.InsufficientStorage.status, errors.PayloadTooLarge.status}
    if (method, path) in _QUOTA_CHECKED:
        out.add(errors.QuotaExceeded.status)
    if _MAY_BE_UNAVAILABLE.match(path) or path.startswith("/v1/sandboxes/{sandbox_id}/"):
        out.add(errors.Unavailable.status)
    return out


def _integer_bounds(node: Any) -> None:
    """FastAPI passes nested schemas (an ``anyOf``'s) through its OpenAPI model, whose bounds are
    floats: ``2**63 - 1`` came out as ``9.223372036854776e18``, i.e. 2**63, one more than the
    server takes. An integer's bounds are integers again, within the store's range."""
    if isinstance(node, list):
        for v in node:
            _integer_bounds(v)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "integer":
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            v = node.get(key)
            if isinstance(v, float):
                node[key] = max(fields.INT64_MIN, min(fields.INT64_MAX, int(v)))
    for v in node.values():
        _integer_bounds(v)


def document_errors(doc: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a FastAPI document in place: the error schema, every operation's error statuses, the
    bearer scheme, integer bounds that are integers."""
    _integer_bounds(doc)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for fastapi_own in ("HTTPValidationError", "ValidationError"):
        schemas.pop(fastapi_own, None)
    schemas["Error"] = ERROR_SCHEMA
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                "description": "An API key: `Authorization: Bearer <key>`"}}
    for path, item in doc.get("paths", {}).items():
        for method, operation in item.items():
            if method not in ("get", "put", "post", "patch", "delete", "head", "options"):
                continue
            responses = operation.setdefault("responses", {})
            for status in sorted(error_statuses(method, path, operation)):
                responses[str(status)] = {"description": _DESCRIPTIONS[status],
                                          "content": {"application/json": {"schema": _ERROR_REF}}}
            if path.startswith("/v1/"):
                # An attach token (``?token=``) stands in for the key on a command's events.
                token = any(p.get("name") == "token" and p.get("in") == "query"
                            for p in operation.get("parameters") or [])
                operation["security"] = [{"bearer": []}, {}] if token else [{"bearer": []}]
    return doc


def install(app: FastAPI) -> None:
    """Serve the rewritten document at ``/openapi.json`` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description,
                              routes=app.routes)
            app.openapi_schema = document_errors(doc)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
