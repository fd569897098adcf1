"""The short chaos run (``make chaos`` is the 30-minute one, bench/chaos.py): five minutes of
sandboxes writing files while nodes are killed and frozen, controllers and API replicas killed and
nodes drained, on a 3-node cluster over PostgreSQL and S3. Nothing may be lost: every sandbox exists
exactly once, on the node its row names, and no acknowledged write its last restore covered is
missing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.chaos import LEASE, Chaos, render
from tests.e2e.cluster import Cluster, cluster

pytestmark = [pytest.mark.runtime, pytest.mark.postgres, pytest.mark.chaos, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, postgres_url: str) -> Iterator[Cluster]:
    from tests.e2e.harness import runtime_available

    if reason := runtime_available():
        pytest.skip(reason)
    import anyio

    from tests.store.conftest import reset_postgres

    anyio.run(reset_postgres, postgres_url)
    with cluster(tmp_path_factory.mktemp("chaos"), postgres_url, apis=2, controllers=2, nodes=3,
                 node_env={"SPACE_FENCE_AFTER": str(LEASE)}) as c:
        yield c


def test_five_minutes_of_chaos_lose_nothing(deployment: Cluster, tmp_path: Path) -> None:
    res = Chaos(deployment, sandboxes=8, seed=15).run(minutes=5)
    res.update(date="test", args={})
    print(render(res))
    (tmp_path / "chaos.json").write_text(json.dumps(res, indent=2))
    assert res["faults_by_kind"], res["faults"]
    assert res["failed"] == {}, res
    assert res["not_exactly_once"] == [], res
    assert res["missing_writes"] == {}, res
    assert res["writes_acknowledged"] > 0
