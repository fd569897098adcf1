from ._client import AsyncClient
from ._commands import AsyncCommand
from ._files import AsyncFiles
from ._pools import AsyncPools
from ._resources import AsyncApiKeys, AsyncOperations, AsyncTemplates
from ._sandboxes import AsyncSandbox, AsyncSandboxes

__all__ = [
    "AsyncApiKeys",
    "AsyncClient",
    "AsyncCommand",
    "AsyncFiles",
    "AsyncOperations",
    "AsyncPools",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncTemplates",
]
