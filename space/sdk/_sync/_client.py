# Generated from space/sdk/_async/_client.py by scripts/unasync.py: do not edit.
"""The client: one connection pool and the resource groups that share it."""

from __future__ import annotations

from types import TracebackType

import httpx

from space.sdk._models import JSON

from ._http import SyncHTTP
from ._nodes import Nodes
from ._pools import Pools
from ._resources import ApiKeys, Operations, Templates
from ._sandboxes import Sandboxes
from ._secrets import Secrets
from ._tenancy import Audit, Quotas


class Client:
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
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = SyncHTTP(url, api_key, timeout=timeout, transport=transport)
        self.operations = Operations(self._http)
        self.sandboxes = Sandboxes(self._http, self.operations)
        self.templates = Templates(self._http)
        self.apikeys = ApiKeys(self._http)
        self.pools = Pools(self._http)
        self.nodes = Nodes(self._http)
        self.quotas = Quotas(self._http)
        self.audit = Audit(self._http)
        self.secrets = Secrets(self._http)

    @property
    def url(self) -> str:
        return self._http.url

    def __repr__(self) -> str:
        return f"<Client {self.url}>"

    def health(self) -> JSON:
        return self._http.json("GET", "/healthz")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
