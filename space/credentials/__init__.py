"""The credential manager: secrets kept outside sandboxes, sealed at rest, resolved by scope for the
node's egress gateway to inject. See docs/notes/secrets.md for the threat model."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from space.credentials.backends import (
    BUILTIN,
    VAULT,
    BackendConfig,
    Backends,
    BuiltinBackend,
    HashiCorpVaultBackend,
    VaultBackend,
)
from space.credentials.crypto import Keyring, MasterKeyError
from space.credentials.manager import AuditSink, CredentialManager, ResolvedSecret
from space.store import Store


def build_manager(store: Store, data_dir: Path | None, env: Mapping[str, str] | None = None,
                  audit: AuditSink | None = None) -> CredentialManager:
    """The manager ``space serve`` runs: master key from ``$SPACE_MASTER_KEY`` or
    ``<data_dir>/master.key``, backends from the environment (:class:`BackendConfig`)."""
    env = os.environ if env is None else env
    keyring = Keyring.load(data_dir, env)
    return CredentialManager(store, Backends.from_config(BackendConfig.from_env(env), keyring), audit)


__all__ = [
    "BUILTIN",
    "VAULT",
    "AuditSink",
    "BackendConfig",
    "Backends",
    "BuiltinBackend",
    "CredentialManager",
    "HashiCorpVaultBackend",
    "Keyring",
    "MasterKeyError",
    "ResolvedSecret",
    "VaultBackend",
    "build_manager",
]
