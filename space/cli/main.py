"""The ``space`` command: wiring of the command groups and the global options."""

from __future__ import annotations

import importlib.util
from typing import Annotated

import typer

from space.cli import (
    apikeys,
    audit,
    files,
    nodes,
    policy,
    pools,
    quotas,
    sandbox,
    secrets,
    snapshots,
    templates,
    tenant,
)
from space.cli import exec as exec_
from space.cli.context import Settings, SpaceGroup

app = typer.Typer(
    name="space",
    cls=SpaceGroup,
    help="SPACE: sandboxes for AI agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option("--url", envvar="SPACE_URL", help="Server URL.")] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="SPACE_API_KEY", help="API key.",
                                                show_envvar=True)] = None,
) -> None:
    ctx.obj = Settings(url=url, api_key=api_key)


app.add_typer(sandbox.app, name="sandbox")
app.add_typer(snapshots.app, name="snapshot")
app.add_typer(files.app, name="files")
app.add_typer(templates.app, name="template")
app.add_typer(templates.operations_app, name="operation")
app.add_typer(apikeys.app, name="apikey")
app.add_typer(pools.app, name="pool")
app.add_typer(nodes.app, name="node")
app.add_typer(quotas.app, name="quota")
app.add_typer(tenant.app, name="tenant")
app.add_typer(secrets.app, name="secret")
app.add_typer(policy.app, name="policy")
exec_.register(app)
audit.register(app)

# Server-side commands (serve, node) live in their own module; a client-only install may lack it.
if importlib.util.find_spec("space.cli.server") is not None:
    from space.cli import server

    server.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
