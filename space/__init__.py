"""SPACE: a self-hostable sandbox platform for AI agents."""

from space.sdk import AsyncClient, Client

__all__ = ["AsyncClient", "Client"]
