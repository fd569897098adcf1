"""``space serve --default-quota``: NAME=VALUE pairs into limits; anything else is a usage error."""

from __future__ import annotations

import pytest
import typer

from space.cli.server import parse_quota


def test_parses_limits_and_none() -> None:
    assert parse_quota("sandboxes=10, cpu=2.5,memory_mb=4096,storage_mb=none,disk_mb=2048") == {
        "sandboxes": 10, "cpu": 2.5, "memory_mb": 4096, "storage_mb": None, "disk_mb": 2048}
    assert parse_quota("") == {}


@pytest.mark.parametrize("spec", ["sandbox=3", "sandboxes", "cpu=lots", "memory_mb=1.5", "disk_mb=-1"])
def test_refuses_what_is_not_a_limit(spec: str) -> None:
    with pytest.raises(typer.BadParameter):
        parse_quota(spec)
