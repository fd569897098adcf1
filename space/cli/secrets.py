"""``space secret``: credentials injected by the egress gateway, never visible inside a sandbox."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from space.cli import output
from space.cli.context import client

app = typer.Typer(help="Secrets: credentials injected into a sandbox's outbound requests.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON exactly as the API returns it.")]
ScopeOpt = Annotated[str | None, typer.Option(
    "--scope", help="'tenant' (default), 'project:<name>' or 'sandbox:<id>'.")]


def _read_value(value: str) -> str:
    if value != "-":
        return value
    data = sys.stdin.read()
    # One trailing newline is the shell's (echo, a file's last line), not part of the secret.
    if data.endswith("\r\n"):
        return data[:-2]
    return data.removesuffix("\n")


@app.command("set")
def set_(
    ctx: typer.Context,
    name: str,
    value: Annotated[str, typer.Argument(help="The value; '-' reads it from stdin (keeps it out of shell history).")],
    host: Annotated[list[str], typer.Option(
        "--host", help="Host pattern it is injected for (api.x.com, *.x.com, *); repeatable.")],
    header: Annotated[str | None, typer.Option("--header", help="Header to set (default Authorization).")] = None,
    fmt: Annotated[str | None, typer.Option(
        "--format", help="Header value, '{}' is the secret (default 'Bearer {}'); 'basic' for user:password.")] = None,
    scope: ScopeOpt = None,
    ttl: Annotated[int | None, typer.Option("--ttl", help="Expire after SECONDS.")] = None,
    expires_at: Annotated[str | None, typer.Option(
        "--expires-at", help="Expire at this ISO 8601 time (with a zone, e.g. 2030-01-01T00:00:00Z).")] = None,
    rate_limit: Annotated[int | None, typer.Option(
        "--rate-limit", help="At most N injections per minute (per node).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create or replace secret NAME. The value is stored encrypted and never shown again."""
    if ttl is not None and expires_at is not None:
        raise typer.BadParameter("give --ttl or --expires-at, not both", param_hint="--ttl")
    secret = _read_value(value)
    with client(ctx) as c:
        view = c.secrets.set(name, secret, hosts=host, header=header, format=fmt, scope=scope,
                             expires_at=expires_at, ttl_seconds=ttl, rate_limit=rate_limit)
    if as_json:
        output.print_json(view)
    else:
        output.info(f"secret {view['name']} ({view['scope']}): {view['header']} for {', '.join(view['hosts'])}")


@app.command("list")
def list_(ctx: typer.Context, scope: ScopeOpt = None, as_json: JsonFlag = False) -> None:
    """Secrets with their scope and injection rule (never their values)."""
    with client(ctx) as c:
        secrets = c.secrets.list(scope)
    if as_json:
        output.print_json(secrets)
        return
    output.table(
        ["name", "scope", "hosts", "header", "format", "expires_at", "rate_limit"],
        [(s.get("name"), s.get("scope"), ",".join(s.get("hosts") or []), s.get("header"), s.get("format"),
          ("expired " if s.get("expired") else "") + str(s.get("expires_at")) if s.get("expires_at") else None,
          s.get("rate_limit")) for s in secrets],
    )


@app.command("delete")
def delete(ctx: typer.Context, name: str, scope: ScopeOpt = None) -> None:
    """Delete secret NAME (from the tenant scope unless --scope says otherwise)."""
    with client(ctx) as c:
        c.secrets.delete(name, scope)
    output.info(f"secret {name} deleted")
