"""Template tags in the store: a tag names one build (digest) of a template, moves when given
again, lists in the order given, goes when removed; a malformed tag is refused before a write."""

from __future__ import annotations

import pytest

from space.errors import InvalidRequest, NotFound
from space.store import Store

pytestmark = pytest.mark.anyio


async def test_tags_name_builds_and_move(store: Store) -> None:
    await store.upsert_template("env", digest="d1", status="ready", spec={})
    rows = await store.tag_template("env", ["v1", "prod", "v1"], digest="d1", build_id="b1")
    assert [(r.tag, r.digest, r.build_id) for r in rows] == [("v1", "d1", "b1"), ("prod", "d1", "b1")]
    assert (await store.get_template_tag("env", "prod")).digest == "d1"

    await store.tag_template("env", ["prod"], digest="d2", build_id="b2")  # moved to the new build
    assert {(t.tag, t.digest) for t in await store.list_template_tags("env")} == {("v1", "d1"), ("prod", "d2")}
    assert await store.list_template_tags("other") == []

    assert await store.untag_template("env", ["prod", "absent"]) == 1
    with pytest.raises(NotFound, match="template env has no tag 'prod'"):
        await store.get_template_tag("env", "prod")
    assert [t.tag for t in await store.list_template_tags("env")] == ["v1"]


@pytest.mark.parametrize("tag", ["", ":x", "a:b", "-lead", "x" * 129, "sp ace", "new\nline"])
async def test_malformed_tags_write_nothing(store: Store, tag: str) -> None:
    with pytest.raises(InvalidRequest, match="invalid tag"):
        await store.tag_template("env", ["good", tag], digest="d1", build_id="b1")
    assert await store.list_template_tags("env") == []
