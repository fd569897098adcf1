"""The files of E2B template builds' COPY steps: where the SDK uploads them, and which blob a build uses.

For each COPY the SDK asks ``GET /templates/{id}/files/{hash}`` (``hash``: its own sha256 over the
step and the files' paths, modes, sizes and bytes) and, unless the answer says ``present``, PUTs a
tar of the files (gzipped) to the ``url`` answered -- without its API key, as to a presigned S3 URL.
So the URL carries its own authorization: a MAC under the deployment's secret of the hash and an
expiry an hour away, checked before a byte of the body is read. The body is bounded
(:data:`~space.node.templates.spec.MAX_BLOB_BYTES`), hashed as it streams to a temporary file, and
stored as the template blob ``blobs/<sha256>``; the object ``e2b-files/<hash>`` then records which
blob that is, once: a later upload to the same hash changes nothing (the SDK's forced upload sends
the same files; anyone else holding the URL cannot swap what a build copies). A build turns the
COPY into a ``run`` copy naming the blob by its sha256 (:data:`~space.node.templates.spec.COPY_KEYS`),
so the template's digest covers the bytes and the node checks them against it when it fetches it.

Templates are the operator's (global): only an operator's key gets an upload URL.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from typing import Annotated, Final

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from space.api.templates import _objects, spooled
from space.e2b.control import Auth, E2BError, St
from space.e2b.edge import json_body
from space.errors import NotFound
from space.node.templates import spec as template_spec
from space.objstore import ObjectStore

router = APIRouter()

#: How long an upload URL is good for (the SDK uploads right after asking).
URL_TTL: Final = 3600
_HASH: Final = re.compile(r"[0-9a-f]{64}")
#: An ``e2b-files/<hash>`` record is a few dozen bytes; anything longer is not one of ours.
_MAX_RECORD: Final = 1024


def _check_hash(files_hash: str) -> str:
    if not _HASH.fullmatch(files_hash):
        raise E2BError(400, "the files hash must be 64 lowercase hex digits")
    return files_hash


def _record_key(files_hash: str) -> str:
    return f"e2b-files/{files_hash}"


def _signature(secret: bytes, files_hash: str, expires: int) -> str:
    msg = f"e2b-template-files\n{files_hash}\n{expires}".encode()
    return base64.urlsafe_b64encode(hmac.new(secret, msg, hashlib.sha256).digest()).decode().rstrip("=")


@router.get("/templates/{template_id}/files/{files_hash}")
async def upload_link(template_id: str, files_hash: str, request: Request, who: Auth, st: St) -> Response:
    """Whether the files of a COPY are stored, and the URL to PUT them to (always: the SDK uploads
    again when the step forces it)."""
    who.require_operator()
    _check_hash(files_hash)
    present = await _objects(st).exists(_record_key(files_hash))
    expires = int(time.time()) + URL_TTL
    url = (f"{str(request.base_url).rstrip('/')}/templates/files/{files_hash}"
           f"?expires={expires}&signature={_signature(st.secret, files_hash, expires)}")
    return json_body({"present": present, "url": url}, 201)


@router.put("/templates/files/{files_hash}")
async def upload(files_hash: str, request: Request, st: St, expires: Annotated[int, Query()] = 0,
                 signature: Annotated[str, Query(max_length=64)] = "") -> Response:
    """The tar of a COPY's files, to the URL :func:`upload_link` signed (no API key: the URL is it)."""
    _check_hash(files_hash)
    if not hmac.compare_digest(_signature(st.secret, files_hash, expires).encode(), signature.encode()):
        raise E2BError(403, "this upload URL's signature does not match: ask for a new one")
    if expires < time.time():
        raise E2BError(403, "this upload URL has expired: ask for a new one")
    objects = _objects(st)
    limit = template_spec.MAX_BLOB_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise E2BError(413, f"a COPY's files are limited to {limit} bytes (archived)")
    too_large = E2BError(413, f"a COPY's files are limited to {limit} bytes (archived)")
    async with spooled(request, limit, too_large) as (tmp, sha256, size):
        if await objects.exists(_record_key(files_hash)):
            # Written once: the hash names the files (the SDK's upload again of the same files is a
            # no-op), and a URL seen by someone else cannot swap what a build copies.
            return Response(status_code=200)
        key = template_spec.blob_key(sha256)
        if await objects.size(key) is None:
            await objects.put_file(key, tmp)
        # The record last: a build that finds it finds the blob.
        await objects.put_bytes(_record_key(files_hash), json.dumps({"sha256": sha256, "size": size}).encode())
    return Response(status_code=200)


async def archive_of(objects: ObjectStore, files_hash: str, step: int) -> str:
    """The sha256 of the blob uploaded for a COPY's ``files_hash`` (400 naming the step if none)."""
    _check_hash(files_hash)
    try:
        raw = await objects.get_bytes(_record_key(files_hash))
    except NotFound:
        raise E2BError(400, f"step {step}: the files of this COPY were not uploaded (files hash "
                            f"{files_hash[:16]}…)") from None
    # Object storage is outside this process: the record is checked before it names a blob.
    try:
        sha256 = json.loads(raw)["sha256"] if len(raw) <= _MAX_RECORD else None
    except (ValueError, KeyError, TypeError):
        sha256 = None
    if not isinstance(sha256, str) or not _HASH.fullmatch(sha256):
        raise E2BError(500, f"step {step}: the record of this COPY's files is damaged: upload them again")
    return sha256
