"""Every failure surfaces as a space.errors class; no httpx exception leaks.

Aspects: each wire code maps to its class; invalid_state carries state and allowed actions;
a body without our shape falls back by status; connection failures and timeouts are translated.
"""

from __future__ import annotations

import httpx
import pytest

from space import AsyncClient, Client, errors
from tests.sdk.fake_api import API_KEY, URL


def _answering(status: int, body: object) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)

    return httpx.MockTransport(handler)


CODES = sorted(errors.BY_CODE)


@pytest.mark.parametrize("cls", [errors.BY_CODE[code] for code in CODES], ids=CODES)
async def test_each_code_becomes_its_class(cls: type[errors.SpaceError]) -> None:
    details = {"state": "paused", "allowed": ["resume"]} if cls is errors.InvalidState else {"hint": 1}
    body = {"error": {"code": cls.code, "message": "boom", **details}}
    async with AsyncClient(URL, API_KEY, transport=_answering(cls.status, body)) as c:
        with pytest.raises(errors.SpaceError) as info:
            await c.sandboxes.get("sb-1")
    assert type(info.value) is cls
    assert info.value.message == "boom" and str(info.value) == f"{cls.code}: boom"


async def test_invalid_state_names_the_state_and_allowed_actions(aclient: AsyncClient) -> None:
    sandbox = await aclient.sandboxes.create(wait=False)
    with pytest.raises(errors.InvalidState) as info:
        await sandbox.exec("true")
    assert info.value.status == 409
    assert info.value.state == "creating" and info.value.allowed == ["delete"]


@pytest.mark.parametrize(("status", "cls"), [(404, errors.NotFound), (502, errors.Internal),
                                             (503, errors.Unavailable), (413, errors.PayloadTooLarge)])
def test_unshaped_error_bodies_fall_back_by_status(status: int, cls: type[errors.SpaceError]) -> None:
    transport = _answering(status, b"<html>bad gateway</html>")
    with Client(URL, API_KEY, transport=transport) as c, pytest.raises(cls, match="bad gateway"):
        c.templates.list()


def test_wrong_key_is_unauthorized(fake_transport: httpx.BaseTransport) -> None:
    with Client(URL, "sk-wrong", transport=fake_transport) as c, pytest.raises(errors.Unauthorized):
        c.sandboxes.list()


@pytest.mark.parametrize(("exc", "cls"), [
    (httpx.ConnectError("connection refused"), errors.Unavailable),
    (httpx.RemoteProtocolError("server disconnected"), errors.Unavailable),
    (httpx.ReadTimeout("timed out"), errors.Timeout),
    (httpx.ConnectTimeout("timed out"), errors.Timeout),
])
async def test_transport_failures_are_translated(exc: Exception, cls: type[errors.SpaceError]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    async with AsyncClient(URL, API_KEY, transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(cls) as info:
            await c.health()
    assert info.value.__cause__ is exc
    assert info.value.retryable


def test_a_bad_url_is_an_invalid_request() -> None:
    with Client("ftp://nowhere", API_KEY) as c, pytest.raises(errors.InvalidRequest):
        c.health()
