"""The CLI runs in-process (typer's CliRunner) against the SDK's fake API."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from typer.testing import CliRunner, Result

from space.cli import context
from space.cli.main import app
from space.sdk import Client
from tests.sdk.fake_api import API_KEY, URL, FakeAPI

Run = Callable[..., Result]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAPI:
    api = FakeAPI()

    def factory(settings: context.Settings) -> Client:
        return Client(settings.url or URL, settings.api_key or API_KEY, transport=api.transport)

    monkeypatch.setattr(context, "client_factory", factory)
    return api


@pytest.fixture
def space(fake: FakeAPI) -> Run:
    """``space(*args, input=...)`` runs the CLI and returns its result (stdout and stderr apart)."""
    runner = CliRunner()

    def run(*args: str, input: bytes | str | None = None) -> Result:
        return runner.invoke(app, list(args), input=input, catch_exceptions=False)

    return run


@pytest.fixture
def sandbox_id(space: Run) -> str:
    result = space("sandbox", "create")
    assert result.exit_code == 0, result.output
    return result.stdout.strip()
