"""``space audit``: the audit trail of mutating API calls (admin keys)."""

from __future__ import annotations

from typing import Annotated

import typer

from space.cli import output
from space.cli.context import client


def audit(
    ctx: typer.Context,
    action: Annotated[str | None, typer.Option("--action", help="An action, or a prefix ending in '.'.")] = None,
    target: Annotated[str | None, typer.Option("--target", help="A sandbox, snapshot, key... id.")] = None,
    after: Annotated[int, typer.Option("--after", min=0, help="Only records with a greater id.")] = 0,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Another tenant's (operator keys).")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="At most this many.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Who did what, when, and with what result, oldest first (page on with --after)."""
    with client(ctx) as c:
        records = c.audit.list(after=after, action=action, target=target, tenant=tenant, limit=limit)
    if as_json:
        output.print_json(records)
        return
    output.table(
        ["id", "at", "tenant", "actor", "action", "target", "result", "status"],
        [(r.get("id"), r.get("at"), r.get("tenant"), r.get("actor"), r.get("action"), r.get("target") or "-",
          r.get("result"), r.get("status")) for r in records],
    )


def register(app: typer.Typer) -> None:
    app.command("audit")(audit)
