# Generated from space/sdk/_async/__init__.py by scripts/unasync.py: do not edit.
from ._client import Client
from ._commands import Command
from ._files import Files
from ._pools import Pools
from ._resources import ApiKeys, Operations, Templates
from ._sandboxes import Sandbox, Sandboxes

__all__ = [
    "ApiKeys",
    "Client",
    "Command",
    "Files",
    "Operations",
    "Pools",
    "Sandbox",
    "Sandboxes",
    "Templates",
]
