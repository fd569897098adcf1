"""Fixtures: a guest daemon behind the real shim, and a GuestConnection to it."""

from tests.guest.fixtures import anyio_backend, conn, guest

__all__ = ["anyio_backend", "conn", "guest"]
