"""The credential tests run on a real store: SQLite always, PostgreSQL where it can run."""

from __future__ import annotations

from tests.store.conftest import anyio_backend, store, store_url

__all__ = ["anyio_backend", "store", "store_url"]
