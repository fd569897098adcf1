"""Operations, templates and API keys through the SDK.

Aspects: operation get with and without long-poll; build returns its operation without waiting;
the log stream yields (seq, line) and ends with the end event; API key calls.
"""

from __future__ import annotations

import pytest

from space import AsyncClient, errors
from tests.sdk.fake_api import FakeAPI


async def test_templates_and_build_logs(fake: FakeAPI, aclient: AsyncClient) -> None:
    assert [t["name"] for t in await aclient.templates.list()] == ["base", "broken"]
    assert (await aclient.templates.get("base"))["status"] == "ready"
    op = await aclient.templates.build("base", force=True)
    assert op.kind == "template.build" and not op.done
    assert fake.seen("POST", "/v1/templates/base/build")[0].json() == {"force": True}
    logs = [entry async for entry in aclient.operations.logs(op.id)]
    assert logs == [(1, "step 1/2: unpacking rootfs"), (2, "step 2/2: snapshotting")]
    done = await aclient.operations.get(op.id)
    assert done.status == "succeeded" and done.result == {"digest": "sha256:base1"}
    with pytest.raises(errors.NotFound):
        await aclient.templates.get("nope")


async def test_a_failed_operation_carries_its_error(fake: FakeAPI, aclient: AsyncClient) -> None:
    op = await aclient.templates.build("broken")
    failed = await aclient.operations.wait(op.id, timeout=30)
    assert failed.status == "failed"
    assert failed.error == {"code": "runtime_error", "message": "debootstrap failed"}
    assert isinstance(failed.exception(), errors.RuntimeFailure)
    with pytest.raises(errors.RuntimeFailure):
        failed.raise_for_error()
    assert fake.seen("GET", f"/v1/operations/{op.id}")[0].params == {"wait": "30"}


async def test_apikeys(fake: FakeAPI, aclient: AsyncClient) -> None:
    created = await aclient.apikeys.create("acme", role="admin", name="ci")
    assert created["key"].startswith("sk-")
    assert fake.seen("POST", "/v1/apikeys")[0].json() == {"tenant": "acme", "role": "admin", "name": "ci"}
    listed = await aclient.apikeys.list()
    assert [k["id"] for k in listed] == [created["id"]] and "key" not in listed[0]
    await aclient.apikeys.delete(created["id"])
    assert await aclient.apikeys.list() == []
    with pytest.raises(errors.ValidationFailed):
        await aclient.apikeys.create("acme", role="owner")
