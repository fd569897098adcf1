"""The client: one connection pool and the resource groups that share it."""

from __future__ import annotations

from types import TracebackType

import httpx

from space.sdk._models import JSON

from ._http import AsyncHTTP
from ._nodes import AsyncNodes
from ._pools import AsyncPools
from ._resources import AsyncApiKeys, AsyncOperations, AsyncTemplates
from ._sandboxes import AsyncSandboxes
from ._secrets import AsyncSecrets
from ._tenancy import AsyncAudit, AsyncQuotas


class AsyncClient:
    """A SPACE client. ``url`` and ``api_key`` default to ``$SPACE_URL`` and ``$SPACE_API_KEY``.

    Every failure raises a :class:`space.errors.SpaceError` subclass, whether the server answered
    with an error or could not be reached.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = AsyncHTTP(url, api_key, timeout=timeout, transport=transport)
        self.operations = AsyncOperations(self._http)
        self.sandboxes = AsyncSandboxes(self._http, self.operations)
        self.templates = AsyncTemplates(self._http)
        self.apikeys = AsyncApiKeys(self._http)
        self.pools = AsyncPools(self._http)
        self.nodes = AsyncNodes(self._http)
        self.quotas = AsyncQuotas(self._http)
        self.audit = AsyncAudit(self._http)
        self.secrets = AsyncSecrets(self._http)

    @property
    def url(self) -> str:
        return self._http.url

    def __repr__(self) -> str:
        return f"<Client {self.url}>"

    async def health(self) -> JSON:
        return await self._http.json("GET", "/healthz")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
