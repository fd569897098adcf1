"""``space apikey``: create, list and delete API keys (admin)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from space.cli import output
from space.cli.context import client
from space.keyforms import API_KEY_PREFIX, e2b_spelling

app = typer.Typer(help="Manage API keys (needs an admin key).", no_args_is_help=True)


@app.command()
def create(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option("--tenant", help="Tenant the key acts for.")],
    role: Annotated[str, typer.Option("--role", help="admin, member or readonly.")] = "member",
    name: Annotated[str, typer.Option("--name", help="A label for humans.")] = "",
    e2b: Annotated[bool, typer.Option("--e2b", help="Print it spelled as E2B's SDKs want (e2b_…).")] = False,
) -> None:
    """Create a key and print it (only the key, on stdout; it is shown this once)."""
    with client(ctx) as c:
        created = c.apikeys.create(tenant, role=role, name=name)
    output.info(f"created API key {created['id']} for {tenant} ({role})")
    output.line(e2b_spelling(str(created["key"])) if e2b else str(created["key"]))


@app.command("e2b")
def e2b_form(
    key: Annotated[str | None, typer.Argument(help="The key (default: $SPACE_API_KEY).", show_default=False)] = None,
) -> None:
    """Print a key spelled as E2B's SDKs want it (``e2b_`` and hex): the same key, for E2B_API_KEY.
    Either spelling authenticates; revoking the key revokes both."""
    given = key or os.environ.get("SPACE_API_KEY", "")
    if not given.startswith(API_KEY_PREFIX):
        output.error(f"give a SPACE API key ({API_KEY_PREFIX}…), as an argument or in $SPACE_API_KEY")
        raise typer.Exit(2)
    output.line(e2b_spelling(given))


@app.command("list")
def list_(
    ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False
) -> None:
    """List keys (their prefixes; keys themselves are never shown again)."""
    with client(ctx) as c:
        keys = c.apikeys.list()
    if as_json:
        output.print_json(keys)
        return
    output.table(
        ["id", "tenant", "role", "name", "prefix", "created"],
        [(k.get("id"), k.get("tenant"), k.get("role"), k.get("name"), k.get("prefix"), k.get("created_at"))
         for k in keys],
    )


@app.command()
def delete(ctx: typer.Context, key_id: Annotated[str, typer.Argument(metavar="KEY_ID")]) -> None:
    """Revoke a key."""
    with client(ctx) as c:
        c.apikeys.delete(key_id)
    output.info(f"deleted API key {key_id}")
