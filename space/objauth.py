"""Authenticated manifests: what SPACE trusts in object storage is sealed with the deployment's
manifest key, which the bucket never holds.

Whoever can write the bucket (its credentials, the directory of a local store, the API's user who
shares that directory) can replace any byte there and recompute any checksum. So every manifest a
node restores or materializes from (a snapshot's, a template's) is sealed: HMAC-SHA256 over the
canonical JSON of its body, under the deployment's manifest key, and the body names what it is
bound to (tenant, sandbox, snapshot, template, its own location). A node opens a manifest only
with the binding it expects; everything the manifest lists (artifact sizes and sha256s, template
stream hashes) is then as trustworthy as the key.

A sealed document::

    {"format": 2, "kind": "snapshot",
     "body": {...},
     "mac": {"alg": "hmac-sha256", "key_id": "<16 hex>", "value": "<64 hex>"}}

The MAC covers ``kind`` and the canonical body (sorted keys, no whitespace, ASCII, no NaN): the
value a verifier recomputes is the value it then uses, so a re-encoded or re-ordered document
cannot smuggle anything past it, and a template manifest cannot pass for a snapshot's.

Keys come from ``$SPACE_MANIFEST_KEY``, or a key file (``--manifest-key-file``; ``space serve``'s
node agent makes ``<data dir>/manifest.key``, 0600 root, on first start): base64 of 32 random bytes, several
separated by commas or whitespace, newest first. The first seals; a manifest opens under whichever
key its ``key_id`` names, so a key is rotated by putting a new one in front and re-sealing
(``space objects migrate`` does it) before the old one is dropped. Every node of a deployment
holds the same keys; the API and controller never need them. It is a key of its own, not derived
from the master key: a node never holds the key that decrypts the tenants' secrets.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from space import keytext
from space.errors import Internal, ObjectTampered

KEY_BYTES = keytext.KEY_BYTES
ENV_VAR = "SPACE_MANIFEST_KEY"
KEY_FILE = "manifest.key"
FORMAT = 2
ALG = "hmac-sha256"
#: Sealed documents are small (a snapshot's lists its few artifacts); anything larger is refused
#: unread rather than parsed.
MAX_DOCUMENT_BYTES = 1 << 20
_DOMAIN = b"space-manifest:v2\0"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEY_ID = re.compile(r"[0-9a-f]{16}")

#: Stable reasons a manifest is refused (the ``reason`` detail of :class:`ObjectTampered`).
UNAUTHENTICATED = "unauthenticated"
UNKNOWN_KEY = "unknown_key"
BAD_MAC = "bad_mac"
WRONG_KIND = "wrong_kind"
BOUND_ELSEWHERE = "bound_elsewhere"
CONTENT_MISMATCH = "content_mismatch"

MIGRATE_HINT = ("objects written before manifests were sealed are re-authenticated, after checking, "
                "by `space objects migrate`")


class ManifestKeyError(Internal):
    """The deployment's manifest key is missing or malformed (code ``internal``: an operator fixes it)."""


def key_id(key: bytes) -> str:
    """A fingerprint naming a key (one-way, safe to store beside what it sealed)."""
    return hashlib.sha256(b"space-manifest-key-id:v1\0" + key).hexdigest()[:16]


def generate_key() -> bytes:
    return os.urandom(KEY_BYTES)


def encode_key(key: bytes) -> str:
    return base64.b64encode(key).decode()


def canonical(value: Any) -> bytes:
    """The one encoding a MAC is computed over."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def parse_keys(text: str, where: str) -> list[bytes]:
    return keytext.parse(text, where, what="a manifest key", error=ManifestKeyError)


def create_key_file(path: Path) -> bool:
    """Make ``path`` (0600) holding a new key unless it exists; True when it was made now."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(encode_key(generate_key()) + "\n")
    return True


@dataclass(frozen=True)
class Opened:
    """A verified manifest: its body, and the key that sealed it (not the current one: re-seal)."""

    body: dict[str, Any]
    key_id: str
    #: Which of the kinds the reader accepted it is.
    kind: str = ""


class ManifestKeys:
    """The deployment's manifest keys, newest first: the first seals, any opens what it sealed."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ManifestKeyError("a manifest keyring needs at least one key")
        for k in keys:
            if len(k) != KEY_BYTES:
                raise ManifestKeyError(f"a manifest key must be {KEY_BYTES} bytes, got {len(k)}")
        self._keys = {key_id(k): k for k in keys}
        self.current_id = key_id(keys[0])
        self.key_ids = tuple(key_id(k) for k in keys)

    def __repr__(self) -> str:  # never the keys themselves
        return f"ManifestKeys(current={self.current_id}, ids={list(self.key_ids)})"

    @classmethod
    def load(cls, *, env: Mapping[str, str] | None = None, key_file: Path | None = None) -> ManifestKeys | None:
        """From ``$SPACE_MANIFEST_KEY`` if set, else ``key_file`` if given; None when neither is."""
        env = os.environ if env is None else env
        text = env.get(ENV_VAR, "").strip()
        if text:
            return cls(parse_keys(text, ENV_VAR))
        if key_file is None:
            return None
        try:
            return cls(parse_keys(key_file.read_text(), str(key_file)))
        except OSError as e:
            raise ManifestKeyError(f"cannot read the manifest key file {key_file}: {e.strerror}") from None

    @classmethod
    def require(cls, *, env: Mapping[str, str] | None = None, key_file: Path | None = None) -> ManifestKeys:
        """Like :meth:`load`, but a missing key is a clear error naming both ways to give one."""
        keys = cls.load(env=env, key_file=key_file)
        if keys is None:
            raise ManifestKeyError(
                f"an object store needs the deployment's manifest key: set {ENV_VAR} or pass "
                "--manifest-key-file (the same key on every node; `space serve` keeps its own in "
                f"<data dir>/{KEY_FILE})")
        return keys

    # -- sealing -------------------------------------------------------------------------------

    def _mac(self, kid: str, kind: str, body: Mapping[str, Any]) -> str:
        msg = _DOMAIN + kind.encode() + b"\0" + canonical(body)
        return hmac.new(self._keys[kid], msg, hashlib.sha256).hexdigest()

    def seal(self, kind: str, body: Mapping[str, Any]) -> bytes:
        """The sealed document of ``body`` (indented for people; the MAC does not see the layout)."""
        doc = {"format": FORMAT, "kind": kind, "body": dict(body),
               "mac": {"alg": ALG, "key_id": self.current_id, "value": self._mac(self.current_id, kind, body)}}
        return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False).encode() + b"\n"

    def open(self, data: bytes, kind: str | tuple[str, ...], *, key: str, what: str) -> Opened:
        """Verify the document stored at ``key``; its body, else :class:`ObjectTampered`. ``kind``:
        what the document must be (one of them, given several).

        ``what`` names the object in messages ("snapshot snap-1", "template base@1a2b..."). A
        document that is no JSON object at all is refused too: this is the only way in.
        """
        def refused(reason: str, why: str) -> ObjectTampered:
            return tampered(f"{what}: its manifest {key} {why}", key=key, reason=reason)

        if len(data) > MAX_DOCUMENT_BYTES:
            raise refused(BAD_MAC, f"is {len(data)} bytes, more than a manifest ever is")
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise refused(BAD_MAC, "is not JSON") from None
        if not isinstance(doc, dict):
            raise refused(BAD_MAC, "is not a JSON object")
        mac, body = doc.get("mac"), doc.get("body")
        if doc.get("format") != FORMAT or not isinstance(mac, dict):
            raise refused(UNAUTHENTICATED, f"is not sealed with the deployment's key (format "
                                           f"{doc.get('format')!r}); {MIGRATE_HINT}")
        kid, value = mac.get("key_id"), mac.get("value")
        if (mac.get("alg") != ALG or not isinstance(kid, str) or not _KEY_ID.fullmatch(kid)
                or not isinstance(value, str) or not _HEX64.fullmatch(value) or not isinstance(body, dict)):
            raise refused(BAD_MAC, "has a malformed seal")
        if kid not in self._keys:
            raise refused(UNKNOWN_KEY, f"is sealed under key {kid}, which this deployment does not hold "
                                       f"(it holds {', '.join(self.key_ids)})")
        doc_kind = doc.get("kind")
        if not isinstance(doc_kind, str):
            raise refused(BAD_MAC, "has no kind")
        try:
            expected = self._mac(kid, doc_kind, body)
        except (TypeError, ValueError):  # a float NaN, a key that is not a string...
            raise refused(BAD_MAC, "has a body that cannot have been sealed") from None
        if not hmac.compare_digest(expected, value):
            raise refused(BAD_MAC, "fails its MAC: it was altered, or not written by this deployment")
        kinds = (kind,) if isinstance(kind, str) else kind
        if doc_kind not in kinds:
            raise refused(WRONG_KIND, f"is a {doc_kind!r} manifest, not a {' or '.join(map(repr, kinds))} one")
        return Opened(body=body, key_id=kid, kind=doc_kind)


def tampered(message: str, *, key: str, reason: str, **details: Any) -> ObjectTampered:
    return ObjectTampered(message, key=key, reason=reason, **details)


def check_binding(body: Mapping[str, Any], expected: Mapping[str, str], *, key: str, what: str) -> None:
    """The manifest's ``binding`` must be exactly ``expected``: a valid manifest of another tenant,
    sandbox, snapshot or place is refused (a replay)."""
    bound = body.get("binding")
    if not isinstance(bound, dict):
        raise tampered(f"{what}: its manifest {key} names nothing it is bound to", key=key,
                       reason=BOUND_ELSEWHERE)
    wrong = sorted(k for k in set(bound) | set(expected) if bound.get(k) != expected.get(k))
    if wrong:
        shown = ", ".join(f"{k} {bound.get(k)!r} (expected {expected.get(k)!r})" for k in wrong)
        raise tampered(f"{what}: its manifest {key} was written for something else: {shown}", key=key,
                       reason=BOUND_ELSEWHERE, fields=wrong)
