"""Where secret values live: a pluggable vault backend per secret row (``Secret.backend``).

A backend stores and fetches one secret's value given its row. ``put`` fills in what the row
needs to find the value again (``ciphertext``/``key_id`` for the built-in store, ``ref`` for an
external vault); the caller then writes the row. New secrets go to the configured default backend;
an existing row is always read through the backend that wrote it.

The HashiCorp Vault backend speaks the KV version 2 HTTP API. No Vault server runs in this
project's test environment: it is tested against an ``httpx.MockTransport`` at the HTTP seam
only (see docs/notes/secrets.md).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import quote

import httpx
import structlog

from space.credentials.crypto import Keyring, aad
from space.errors import Internal, InvalidRequest, Unavailable
from space.store.models import Secret

log = structlog.get_logger(__name__)

BUILTIN = "builtin"
VAULT = "vault"


@runtime_checkable
class VaultBackend(Protocol):
    """One place secret values can live. Values are text (they end up in HTTP headers)."""

    name: str

    async def put(self, secret: Secret, value: str) -> None:
        """Store ``value`` for this row and set the row's ``ciphertext``/``key_id`` or ``ref``."""

    async def get(self, secret: Secret) -> str:
        """The value stored for this row."""

    async def delete(self, secret: Secret) -> None:
        """Forget the value (the row itself is the store's business)."""

    async def aclose(self) -> None: ...


class BuiltinBackend:
    """Values sealed with AES-256-GCM under the deployment's master key, kept in the SQL row."""

    name = BUILTIN

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring

    async def put(self, secret: Secret, value: str) -> None:
        secret.ciphertext, secret.key_id = self.keyring.encrypt(
            value.encode(), aad(secret.tenant, secret.scope, secret.name))
        secret.ref = None

    async def get(self, secret: Secret) -> str:
        if secret.ciphertext is None:
            raise Internal(f"secret {secret.name} ({secret.scope}) has no stored value", secret=secret.name)
        plain = self.keyring.decrypt(secret.ciphertext, aad(secret.tenant, secret.scope, secret.name),
                                     secret.key_id)
        return plain.decode()

    async def delete(self, secret: Secret) -> None:
        return None  # the value goes with the row

    def reseal(self, secret: Secret) -> bool:
        """Re-encrypt under the newest key; False if it already is (see CredentialManager.rekey)."""
        if secret.key_id == self.keyring.current_id or secret.ciphertext is None:
            return False
        where = aad(secret.tenant, secret.scope, secret.name)
        plain = self.keyring.decrypt(secret.ciphertext, where, secret.key_id)
        secret.ciphertext, secret.key_id = self.keyring.encrypt(plain, where)
        return True

    async def aclose(self) -> None:
        return None


class HashiCorpVaultBackend:
    """HashiCorp Vault, KV secrets engine version 2, over its HTTP API.

    A value lives at ``<mount>/data/space/<tenant>/<scope>/<name>`` as ``{"value": ...}``; that path
    is the row's ``ref``. Deleting removes every version (``<mount>/metadata/...``).
    """

    name = VAULT

    def __init__(
        self,
        address: str,
        token: str,
        mount: str = "secret",
        *,
        namespace: str | None = None,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not address:
            raise InvalidRequest("the vault backend needs an address")
        if not token:
            raise InvalidRequest("the vault backend needs a token")
        self.mount = mount.strip("/") or "secret"
        headers = {"X-Vault-Token": token}
        if namespace:
            headers["X-Vault-Namespace"] = namespace
        self._http = httpx.AsyncClient(base_url=address.rstrip("/"), headers=headers, timeout=timeout,
                                       transport=transport)

    def ref_for(self, secret: Secret) -> str:
        parts = ("space", secret.tenant, secret.scope, secret.name)
        # Names, scopes and tenants are restricted to URL-safe characters and ":"; quote anyway.
        return f"{self.mount}/data/" + "/".join(quote(p, safe=":") for p in parts)

    async def put(self, secret: Secret, value: str) -> None:
        ref = self.ref_for(secret)
        await self._call("POST", ref, json={"data": {"value": value}})
        secret.ref = ref
        secret.ciphertext = None
        secret.key_id = None

    async def get(self, secret: Secret) -> str:
        if not secret.ref:
            raise Internal(f"secret {secret.name} ({secret.scope}) has no vault reference", secret=secret.name)
        body = await self._call("GET", secret.ref)
        value = ((body.get("data") or {}).get("data") or {}).get("value")
        if not isinstance(value, str):
            raise Internal(f"vault entry of secret {secret.name} has no string 'value'", secret=secret.name)
        return value

    async def delete(self, secret: Secret) -> None:
        if not secret.ref:
            return
        mount, sep, rest = secret.ref.partition("/data/")
        if not sep:
            raise Internal(f"unexpected vault reference {secret.ref!r}")
        await self._call("DELETE", f"{mount}/metadata/{rest}", missing_ok=True)

    async def _call(self, method: str, path: str, *, json: Any = None, missing_ok: bool = False) -> dict[str, Any]:
        try:
            resp = await self._http.request(method, f"/v1/{path}", json=json)
        except httpx.HTTPError as e:
            raise Unavailable(f"vault unreachable: {type(e).__name__}") from e
        if resp.status_code == 404 and missing_ok:
            return {}
        if resp.status_code >= 500 or resp.status_code == 429:
            raise Unavailable(f"vault answered {resp.status_code} to {method} {path}")
        if resp.is_error:
            # Vault's messages name paths and policies, never values: safe to pass on.
            raise Internal(f"vault answered {resp.status_code} to {method} {path}: {_vault_errors(resp)}")
        if resp.status_code == 204 or not resp.content:
            return {}
        try:
            out = resp.json()
        except ValueError:
            raise Internal(f"vault answered {method} {path} with invalid JSON") from None
        return out if isinstance(out, dict) else {}

    async def aclose(self) -> None:
        await self._http.aclose()


def _vault_errors(resp: httpx.Response) -> str:
    try:
        errs = resp.json().get("errors")
    except (ValueError, AttributeError):
        errs = None
    return "; ".join(str(e) for e in errs)[:300] if isinstance(errs, list) and errs else "no details"


@dataclasses.dataclass(frozen=True)
class BackendConfig:
    """Which backend new secrets go to, and how to reach the external ones.

    From the environment: ``SPACE_SECRET_BACKEND`` (``builtin`` or ``vault``),
    ``SPACE_VAULT_ADDR``, ``SPACE_VAULT_TOKEN`` or ``SPACE_VAULT_TOKEN_FILE``, ``SPACE_VAULT_MOUNT``
    (default ``secret``), ``SPACE_VAULT_NAMESPACE``.
    """

    default: str = BUILTIN
    vault_addr: str | None = None
    vault_token: str | None = None
    vault_mount: str = "secret"
    vault_namespace: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BackendConfig:
        env = os.environ if env is None else env
        token = env.get("SPACE_VAULT_TOKEN") or None
        token_file = env.get("SPACE_VAULT_TOKEN_FILE")
        if token is None and token_file:
            token = Path(token_file).read_text().strip() or None
        return cls(default=env.get("SPACE_SECRET_BACKEND", BUILTIN) or BUILTIN,
                   vault_addr=env.get("SPACE_VAULT_ADDR") or None, vault_token=token,
                   vault_mount=env.get("SPACE_VAULT_MOUNT", "secret") or "secret",
                   vault_namespace=env.get("SPACE_VAULT_NAMESPACE") or None)


class Backends:
    """The registry: backend name → backend, and the one new secrets go to."""

    def __init__(self, backends: Mapping[str, VaultBackend], default: str = BUILTIN) -> None:
        if default not in backends:
            raise InvalidRequest(f"unknown secret backend {default!r}: configured are {', '.join(sorted(backends))}")
        self._by_name = dict(backends)
        self.default = default

    @classmethod
    def from_config(cls, config: BackendConfig, keyring: Keyring,
                    transport: httpx.AsyncBaseTransport | None = None) -> Backends:
        found: dict[str, VaultBackend] = {BUILTIN: BuiltinBackend(keyring)}
        if config.vault_addr or config.default == VAULT:
            found[VAULT] = HashiCorpVaultBackend(config.vault_addr or "", config.vault_token or "",
                                                 config.vault_mount, namespace=config.vault_namespace,
                                                 transport=transport)
        return cls(found, config.default)

    def get(self, name: str) -> VaultBackend:
        backend = self._by_name.get(name)
        if backend is None:
            raise Internal(f"secret backend {name!r} is not configured on this server", backend=name)
        return backend

    def names(self) -> list[str]:
        return sorted(self._by_name)

    async def aclose(self) -> None:
        for backend in self._by_name.values():
            await backend.aclose()
