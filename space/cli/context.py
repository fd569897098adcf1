"""What every command shares: connection settings, the client factory and error reporting.

Tests point the CLI at a fake server by replacing :data:`client_factory`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperGroup

from space import errors
from space.cli import output
from space.sdk import Client


@dataclasses.dataclass(frozen=True)
class Settings:
    """From ``--url`` / ``--api-key``; None falls back to ``$SPACE_URL`` / ``$SPACE_API_KEY`` in the SDK."""

    url: str | None = None
    api_key: str | None = None


def default_client_factory(settings: Settings) -> Client:
    return Client(settings.url, settings.api_key)


#: How commands get their client; replaced in tests to inject a transport.
client_factory: Callable[[Settings], Client] = default_client_factory


def client(ctx: typer.Context) -> Client:
    return client_factory(ctx.find_object(Settings) or Settings())


def parse_pairs(values: list[str] | None, option: str) -> dict[str, str]:
    """``["K=V", ...]`` into a dict (a usage error, exit 2, when an item has no ``=``)."""
    pairs: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=option)
        pairs[key] = value
    return pairs


class SpaceGroup(TyperGroup):
    """The root command: turns SPACE and local I/O errors into ``error: <code>: <message>``, exit 1."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except errors.SpaceError as exc:
            output.error(str(exc))
        except BrokenPipeError:
            raise  # typer exits quietly when the reader of stdout went away
        except OSError as exc:  # local files: a missing upload source, an unwritable target
            what = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
            output.error(f"local_io: {what}")
        raise typer.Exit(1)
