"""The gateway runs as a real subprocess from its own venv; see tests/gateway/harness.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.harness import GATEWAY_PY, SB1, SB2, Gateway, Upstream, UpstreamPKI, make_pki, running_gateway


def _need_venv() -> None:
    if not GATEWAY_PY.exists():
        pytest.skip("the gateway venv is missing: run `make gateway`")


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> UpstreamPKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def upstream() -> Iterator[Upstream]:
    up = Upstream(None)
    yield up
    up.close()


@pytest.fixture(scope="session")
def upstream_tls(pki: UpstreamPKI) -> Iterator[Upstream]:
    up = Upstream(pki)
    yield up
    up.close()


@pytest.fixture(scope="session")
def shared_gateway(tmp_path_factory: pytest.TempPathFactory, pki: UpstreamPKI) -> Iterator[Gateway]:
    _need_venv()
    with running_gateway(tmp_path_factory.mktemp("gw"), pki) as gw:
        yield gw


@pytest.fixture
def gw(shared_gateway: Gateway) -> Iterator[Gateway]:
    """The shared gateway, with no sandbox registered before or after the test."""
    for ip in (SB1, SB2):
        shared_gateway.ctl({"op": "delete", "ip": ip})
    yield shared_gateway
    for ip in (SB1, SB2):
        shared_gateway.ctl({"op": "delete", "ip": ip})
