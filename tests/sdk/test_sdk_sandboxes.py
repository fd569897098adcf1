"""SDK against the fake API: configuration, sandbox lifecycle calls and operation waiting.

Aspects: url/key defaults and their absence; the create request (body, Idempotency-Key); the
long-poll loop until the operation finishes; a failed creation raising its error class; get, list,
delete; the sync twin behaving the same.
"""

from __future__ import annotations

import pytest

from space import AsyncClient, Client, errors
from tests.sdk.fake_api import API_KEY, URL, FakeAPI


def test_url_and_key_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, fake: FakeAPI) -> None:
    monkeypatch.setenv("SPACE_URL", URL)
    monkeypatch.setenv("SPACE_API_KEY", API_KEY)
    with Client(transport=fake.transport) as c:
        assert c.health() == {"status": "ok", "nodes": 1}
        assert c.sandboxes.list() == []


@pytest.mark.parametrize("missing", ["SPACE_URL", "SPACE_API_KEY"])
def test_missing_url_or_key_is_a_clear_invalid_request(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    monkeypatch.setenv("SPACE_URL", URL)
    monkeypatch.setenv("SPACE_API_KEY", API_KEY)
    monkeypatch.delenv(missing)
    with pytest.raises(errors.InvalidRequest, match=missing):
        AsyncClient()


async def test_create_sends_the_contract_and_waits_by_long_poll(fake: FakeAPI, aclient: AsyncClient) -> None:
    fake.polls_to_finish = 3
    sandbox = await aclient.sandboxes.create(
        "base", cpu=2, memory_mb=1024, env={"A": "1"}, metadata={"owner": "me"}, idempotency_key="k1"
    )
    assert sandbox.state == "running" and sandbox.template == "base"
    [post] = fake.seen("POST", "/v1/sandboxes")
    assert post.json() == {"template": "base", "cpu": 2, "memory_mb": 1024, "env": {"A": "1"},
                           "metadata": {"owner": "me"}}
    assert post.headers["idempotency-key"] == "k1"
    assert post.headers["authorization"] == f"Bearer {API_KEY}"
    assert sandbox.operation is not None and sandbox.operation.status == "succeeded"
    polls = fake.seen("GET", f"/v1/operations/{sandbox.operation.id}")
    assert len(polls) == 3 and all(int(p.params["wait"]) > 0 for p in polls)


async def test_create_without_wait_returns_at_once(fake: FakeAPI, aclient: AsyncClient) -> None:
    sandbox = await aclient.sandboxes.create(wait=False)
    assert sandbox.state == "creating"
    assert sandbox.operation is not None and sandbox.operation.kind == "sandbox.create"
    assert not fake.seen("GET", f"/v1/operations/{sandbox.operation.id}")


async def test_same_idempotency_key_gives_the_same_sandbox(aclient: AsyncClient) -> None:
    first = await aclient.sandboxes.create(idempotency_key="retry-me", wait=False)
    second = await aclient.sandboxes.create(idempotency_key="retry-me", wait=False)
    assert first.id == second.id
    assert first.operation is not None and second.operation is not None
    assert first.operation.id == second.operation.id


async def test_failed_creation_raises_the_operation_error(aclient: AsyncClient) -> None:
    with pytest.raises(errors.RuntimeFailure, match="the guest did not start") as info:
        await aclient.sandboxes.create("broken")
    assert info.value.details["sandbox_id"].startswith("sb-")
    assert info.value.details["operation"].startswith("op-")


async def test_waiting_past_the_deadline_is_a_timeout(fake: FakeAPI, aclient: AsyncClient) -> None:
    fake.polls_to_finish = 100
    with pytest.raises(errors.Timeout, match="did not finish"):
        await aclient.sandboxes.create(timeout=0)


async def test_get_list_refresh_delete(fake: FakeAPI, aclient: AsyncClient) -> None:
    sandbox = await aclient.sandboxes.create()
    assert (await aclient.sandboxes.get(sandbox.id)).info == fake.sandboxes[sandbox.id]
    assert [s.id for s in await aclient.sandboxes.list(state="running")] == [sandbox.id]
    assert await aclient.sandboxes.list(state="paused") == []
    op = await aclient.sandboxes.delete(sandbox.id)
    assert op.kind == "sandbox.delete" and op.status == "succeeded"
    assert (await sandbox.refresh()).state == "terminated"
    assert await aclient.sandboxes.list() == []
    with pytest.raises(errors.NotFound):
        await aclient.sandboxes.get("sb-nope")


def test_the_sync_client_is_the_same_api(client: Client) -> None:
    sandbox = client.sandboxes.create(idempotency_key="x")
    assert sandbox.state == "running"
    result = sandbox.exec(["echo", "hi"])
    assert result.exit_code == 0 and result.stdout_text == "hi\n"
    assert sandbox.delete().status == "succeeded"
    assert sandbox.state == "terminating"  # the info the DELETE answered with
