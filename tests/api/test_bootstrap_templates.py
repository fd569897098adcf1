"""The configured templates a control plane builds when it starts (space.controlplane.bootstrap_templates):
a missing or failed one, and one built from another version's spec (an upgrade that changed
``base``, e.g. its sudo), but not one already built from this spec."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space.api.state import AppState
from space.cluster.pki import ClusterCA
from space.controller import Controller, NodeRegistry
from space.controlplane import TEMPLATE_SPECS, bootstrap_templates
from space.node.templates.store import spec_digest
from space.objstore import ObjectStore
from space.store import Store

pytestmark = pytest.mark.anyio


@pytest.fixture
async def state(store: Store, tmp_path: Path) -> AsyncIterator[AppState]:
    nodes = NodeRegistry(store)
    objects = ObjectStore.from_url(str(tmp_path / "objects"))
    st = AppState(store=store, nodes=nodes, controller=Controller(store, nodes, objects=objects,
                                                                  template_specs=TEMPLATE_SPECS),
                  secret=b"k" * 32, cluster_ca=ClusterCA.create())
    try:
        yield st
    finally:
        await st.audit.aclose()
        await nodes.aclose()


async def builds(store: Store) -> int:
    return len(await store.find_operations(target="base", kind="template.build"))


async def test_built_when_missing_failed_or_from_another_spec(state: AppState) -> None:
    current = spec_digest(TEMPLATE_SPECS["base"])
    await bootstrap_templates(state, ["base", "not-configured"], "default")
    assert await builds(state.store) == 1  # missing: built (an unknown name is not ours to build)

    await state.store.upsert_template("base", digest=current, status="ready", spec=TEMPLATE_SPECS["base"])
    await bootstrap_templates(state, ["base"], "default")
    assert await builds(state.store) == 1  # the build under way is not doubled, and it is this spec

    for op in await state.store.find_operations(target="base", kind="template.build"):
        claimed = await state.store.claim_operation("test", 60, op_id=op.id)
        assert claimed is not None
        await state.store.finish_operation(op.id, "succeeded", result={"digest": current})
    await bootstrap_templates(state, ["base"], "default")
    assert await builds(state.store) == 1  # ready from this spec: nothing to do

    await state.store.upsert_template("base", digest="0" * 64, status="ready", spec={"name": "base"})
    await bootstrap_templates(state, ["base"], "default")
    assert await builds(state.store) == 2  # an older version's base: rebuilt from this one's spec
