# Generated from space/sdk/_async/__init__.py by scripts/unasync.py: do not edit.
from ._client import Client
from ._commands import Command
from ._files import Files
from ._pools import Pools
from ._resources import ApiKeys, Operations, Templates
from ._sandboxes import Sandbox, Sandboxes
from ._secrets import Secrets
from ._tenancy import Audit, Quotas

__all__ = [
    "ApiKeys",
    "Audit",
    "Client",
    "Command",
    "Files",
    "Operations",
    "Pools",
    "Quotas",
    "Sandbox",
    "Sandboxes",
    "Secrets",
    "Templates",
]
