"""The API tests that need a store run on SQLite and on PostgreSQL, like the store's."""

from __future__ import annotations

from tests.store.conftest import anyio_backend, store, store_url

__all__ = ["anyio_backend", "store", "store_url"]
