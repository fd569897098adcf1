"""Join tokens and nodes joining with them, on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from sqlalchemy import update

from space.errors import InvalidRequest, JoinTokenRefused, NodeBusy, NodeExists, NotFound
from space.store import Store
from space.store.membership import TOKEN_PREFIX
from space.store.models import JoinToken
from tests.store.storekit import new_op, new_sandbox

pytestmark = pytest.mark.anyio


def join_args(node_id: str = "n1", key: str = "a" * 64, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"node_id": node_id, "url": f"https://{node_id}:7070", "certificate": "PEM",
                            "key_sha256": key, "version": "0.1", "capacity": {}}
    args.update(kw)
    return args


async def test_a_token_admits_nodes_and_counts_them(store: Store) -> None:
    row, text = await store.create_join_token(description="rack 4", created_by="key_1")
    assert text.startswith(TOKEN_PREFIX + row.id + ".")
    node = await store.join_node(text, **join_args("n1"))
    assert (node.state, node.url, node.token, node.version) == ("joining", "https://n1:7070", "", "0.1")
    await store.join_node(text, **join_args("n2", key="b" * 64))
    [listed] = await store.list_join_tokens()
    assert (listed.uses, listed.description, listed.created_by) == (2, "rack 4", "key_1")
    # Only its hash is kept.
    assert text.split(".", 1)[1] not in repr(listed.__dict__)


@pytest.mark.parametrize("text", ["", "spj_", "spj_abcdefgh", "spj_abcdefgh.short", "xyz_abcdefgh." + "a" * 43,
                                  "spj_ABCDEFGH." + "a" * 43])
async def test_malformed_tokens_are_refused_alike(store: Store, text: str) -> None:
    with pytest.raises(JoinTokenRefused, match="invalid join token"):
        await store.join_node(text, **join_args())
    assert await store.list_nodes(None) == []


async def test_a_wrong_secret_is_refused(store: Store) -> None:
    row, text = await store.create_join_token()
    forged = f"{TOKEN_PREFIX}{row.id}." + ("A" if text[-1] != "A" else "B") * 43
    with pytest.raises(JoinTokenRefused, match="invalid join token"):
        await store.join_node(forged, **join_args())
    assert (await store.list_join_tokens())[0].uses == 0


async def test_revoked_expired_and_used_up_tokens_say_why(store: Store) -> None:
    revoked, text = await store.create_join_token()
    await store.revoke_join_token(revoked.id)
    with pytest.raises(JoinTokenRefused) as e:
        await store.join_node(text, **join_args())
    assert e.value.details["reason"] == "revoked"

    short_row, short = await store.create_join_token(ttl=dt.timedelta(hours=1))
    await store.join_node(short, **join_args("n1"))
    # Its hour is over (a back door: the database's clock is not ours to move).
    async with store._sessionmaker() as s, s.begin():
        await s.execute(update(JoinToken).where(JoinToken.id == short_row.id)
                        .values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)))
    with pytest.raises(JoinTokenRefused) as e:
        await store.check_join_token(short)
    assert e.value.details["reason"] == "expired"

    _, once = await store.create_join_token(max_uses=1)
    await store.join_node(once, **join_args("n2", key="b" * 64))
    with pytest.raises(JoinTokenRefused) as e:
        await store.join_node(once, **join_args("n3", key="c" * 64))
    assert e.value.details["reason"] == "used_up"
    assert {n.id for n in await store.list_nodes(None)} == {"n1", "n2"}


async def test_bad_token_settings_are_refused(store: Store) -> None:
    with pytest.raises(InvalidRequest):
        await store.create_join_token(ttl=dt.timedelta(days=400))
    with pytest.raises(InvalidRequest):
        await store.create_join_token(max_uses=0)
    with pytest.raises(NotFound):
        await store.revoke_join_token("nosuchid")


async def test_only_the_holder_of_a_nodes_key_joins_again_under_its_id(store: Store) -> None:
    _, text = await store.create_join_token()
    await store.join_node(text, **join_args("n1", key="a" * 64))
    with pytest.raises(NodeExists):
        await store.join_node(text, **join_args("n1", key="b" * 64, url="https://evil:7070"))
    assert (await store.get_node("n1")).url == "https://n1:7070"
    # The same key: a restart, a new address.
    moved = await store.join_node(text, **join_args("n1", key="a" * 64, url="https://n1-new:7070"))
    assert moved.url == "https://n1-new:7070"


async def test_a_bearer_token_node_cannot_be_taken_over_by_joining(store: Store) -> None:
    """``space serve``'s own node has no key: nobody may join under its id."""
    await store.upsert_node("node-1", "unix:///run/space/x/node.sock", "t" * 32, {})
    _, text = await store.create_join_token()
    with pytest.raises(NodeExists):
        await store.join_node(text, **join_args("node-1"))
    assert (await store.get_node("node-1")).url.startswith("unix://")


async def test_a_node_holding_sandboxes_is_not_removed(store: Store) -> None:
    _, text = await store.create_join_token()
    await store.join_node(text, **join_args("n1"))
    sb, _, _ = await store.create_sandbox(new_sandbox(node_id="n1"), new_op())
    with pytest.raises(NodeBusy) as e:
        await store.remove_node("n1")
    assert e.value.details["sandboxes"] == 1
    await store.update_sandbox(sb.id, node_id=None)  # moved off it
    await store.remove_node("n1")
    assert await store.list_nodes(None) == []
    with pytest.raises(NotFound):
        await store.remove_node("n1")
