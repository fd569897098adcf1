"""The control plane's client for a node API: HTTP over a unix socket with a bearer token (``space
serve``'s own node), or HTTPS with mutual TLS (a node that joined: it is known by its certificate,
and knows the caller by the control plane's client certificate; there is no token to steal)."""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx

from space.cluster.pki import identity_name
from space.errors import NotFound, SpaceError, Unavailable, from_wire
from space.errors import Timeout as SpaceTimeout
from space.node.network.port_proxy import UPSTREAM_STATUS
from space.node.network.port_websocket import ClientSocket, HandshakeFailed, Refused

#: Seconds to reach a node for a WebSocket (the TCP and TLS handshakes), then for its answer (the node
#: may first connect into the sandbox: up to its own 10 s).
WS_CONNECT_TIMEOUT = 5.0
WS_HANDSHAKE_TIMEOUT = 30.0

#: A node API path: segments of the characters SPACE's names and ids are made of, none a dot segment.
#: Callers put ids from requests into paths (``/v1/sandboxes/{id}/commands/{cid}``); one that is no
#: such segment (``..``, a ``?`` or ``#``, control characters) would reach another node route, a query
#: the caller did not write, or a URL the client refuses to build. Such an id names nothing: 404.
_NODE_PATH = re.compile(r"(?:/[A-Za-z0-9_~-][A-Za-z0-9._~-]*)+")


def _checked(path: str) -> str:
    if _NODE_PATH.fullmatch(path) is None:
        raise NotFound(f"no such resource: {path[:200]!r} holds a name no resource has")
    return path


class NodeClient:
    def __init__(self, node_id: str, url: str, token: str, *, timeout: float = 120.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.node_id = node_id
        self.url = url
        headers = {}
        #: Why no call can reach this node (its every call is refused with it), or None.
        self.refusal: str | None = None
        self._extensions: dict[str, Any] = {}
        self._token, self._tls = token, tls
        base = url
        if url.startswith("unix://"):
            transport = httpx.AsyncHTTPTransport(uds=url[len("unix://"):])
            base = "http://node"
            headers["authorization"] = f"Bearer {token}"
        elif url.startswith("https://") and tls is not None:
            transport = httpx.AsyncHTTPTransport(verify=tls)
            # The certificate is checked for this node's identity name, not for the address: the
            # address is what a node claimed when it joined, the name is what the CA gave it.
            self._extensions = {"sni_hostname": identity_name(node_id)}
        else:
            transport = httpx.AsyncHTTPTransport()
            base = "http://refused.invalid"
            self.refusal = (f"node {node_id} is at {url}, and this process holds no cluster client certificate "
                            "to reach it with" if url.startswith("https://") else
                            f"node {node_id} is at {url[:100]!r}: a node is reached over a unix socket or over "
                            "mutual TLS (https://), nothing else")
        self._http = httpx.AsyncClient(
            transport=transport,
            base_url=base,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=5.0),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def call(self, method: str, path: str, *, json_body: Any = None,
                   params: dict[str, Any] | None = None, content: Any = None,
                   headers: dict[str, str] | None = None, timeout: float | None = None) -> Any:
        path = _checked(path)
        if self.refusal is not None:
            raise Unavailable(self.refusal)
        try:
            resp = await self._http.request(
                method, path, json=json_body, params=params, content=content, headers=headers,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                extensions=self._extensions,
            )
        except httpx.TimeoutException as exc:
            raise SpaceTimeout(f"node {self.node_id} timed out: {exc!r}") from None
        except httpx.TransportError as exc:
            raise Unavailable(f"node {self.node_id} unreachable: {exc!r}") from None
        if resp.status_code >= 400:
            raise _error(resp.status_code, resp.content)
        if resp.status_code == 204 or not resp.content:
            return None
        return resp.json()

    async def open_stream(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                          content: Any = None, headers: dict[str, str] | None = None,
                          tail: str = "") -> httpx.Response:
        """Start a streaming request; the caller iterates ``aiter_raw()`` and must ``aclose()``.

        ``tail`` follows the checked ``path`` as it is: the opaque rest of a port request
        (``/any/path?query``), which the port proxy has made safe to append (no dot segments, ``?``
        and ``#`` escaped) and the node hands to the sandbox's server."""
        if tail and not tail.startswith(("/", "?")):
            raise ValueError(f"a tail starts with / or ?, got {tail[:40]!r}")
        if self.refusal is not None:
            raise Unavailable(self.refusal)
        req = self._http.build_request(method, _checked(path) + tail, params=params, content=content, headers=headers,
                                       timeout=httpx.Timeout(None, connect=5.0), extensions=self._extensions)
        try:
            resp = await self._http.send(req, stream=True)
        except httpx.TransportError as exc:
            raise Unavailable(f"node {self.node_id} unreachable: {exc!r}") from None
        if resp.status_code >= 400:
            body = await resp.aread()
            await resp.aclose()
            raise _error(resp.status_code, body)
        return resp

    async def open_websocket(self, path: str, *, tail: str = "", headers: Iterable[tuple[str, str]] = (),
                             subprotocols: Iterable[str] = ()) -> ClientSocket:
        """A WebSocket to ``path`` + ``tail`` (as :meth:`open_stream`) on the node. The node's own
        refusal raises its error; a sandbox server's refusal raises :class:`Refused` with its answer
        (marked with :data:`UPSTREAM_STATUS`), for the caller to pass on."""
        if tail and not tail.startswith(("/", "?")):
            raise ValueError(f"a tail starts with / or ?, got {tail[:40]!r}")
        if self.refusal is not None:
            raise Unavailable(self.refusal)
        target = _checked(path) + tail
        extra = list(headers)
        try:
            async with asyncio.timeout(WS_CONNECT_TIMEOUT):
                if self.url.startswith("unix://"):
                    reader, writer = await asyncio.open_unix_connection(self.url[len("unix://"):])
                    extra.append(("authorization", f"Bearer {self._token}"))
                else:
                    where = httpx.URL(self.url)
                    reader, writer = await asyncio.open_connection(
                        where.host, where.port or 443, ssl=self._tls, server_hostname=identity_name(self.node_id))
        except (OSError, TimeoutError) as exc:
            raise Unavailable(f"node {self.node_id} unreachable: {exc!r}") from None
        try:
            return await ClientSocket.open(reader, writer, host="node", target=target, headers=extra,
                                           subprotocols=subprotocols, timeout=WS_HANDSHAKE_TIMEOUT)
        except Refused as refused:
            writer.close()
            if UPSTREAM_STATUS in refused.response.headers:
                raise
            raise _error(refused.response.status_code, bytes(refused.response.body)) from None
        except HandshakeFailed as exc:
            writer.close()
            raise Unavailable(f"node {self.node_id}: {exc}") from None
        except BaseException:
            writer.close()
            raise

    async def ensure_template(self, spec: dict[str, Any], *, force: bool = False,
                              registry_auth: dict[str, dict[str, str]] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Yield the node's NDJSON progress objects ({"log"} lines, then {"template"} or {"error"}).
        ``registry_auth``: logins for the registries the spec's images come from, by registry."""
        body = {"spec": spec, "force": force, "registry_auth": registry_auth or {}}
        resp = await self.open_stream("POST", "/v1/templates/ensure", content=json.dumps(body).encode(),
                                      headers={"content-type": "application/json"})
        try:
            async for line in resp.aiter_lines():
                if line.strip():
                    yield json.loads(line)
        finally:
            await resp.aclose()


def _error(status: int, body: bytes) -> SpaceError:
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = body.decode(errors="replace")
    return from_wire(status, parsed)
