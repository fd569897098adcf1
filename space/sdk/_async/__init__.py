from ._client import AsyncClient
from ._commands import AsyncCommand
from ._files import AsyncFiles
from ._pools import AsyncPools
from ._resources import AsyncApiKeys, AsyncOperations, AsyncTemplates
from ._sandboxes import AsyncSandbox, AsyncSandboxes
from ._secrets import AsyncSecrets
from ._tenancy import AsyncAudit, AsyncQuotas

__all__ = [
    "AsyncApiKeys",
    "AsyncAudit",
    "AsyncClient",
    "AsyncCommand",
    "AsyncFiles",
    "AsyncOperations",
    "AsyncPools",
    "AsyncQuotas",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSecrets",
    "AsyncTemplates",
]
