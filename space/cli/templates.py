"""``space template`` and ``space operation``: templates, their builds, and operations."""

from __future__ import annotations

from typing import Annotated

import typer

from space import errors
from space.cli import output
from space.cli.context import client

app = typer.Typer(help="List and build templates.", no_args_is_help=True)
operations_app = typer.Typer(help="Inspect long-running operations.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON exactly as the API returns it.")]


@app.command("list")
def list_(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """List templates."""
    with client(ctx) as c:
        templates = c.templates.list()
    if as_json:
        output.print_json(templates)
        return
    output.table(
        ["name", "status", "digest", "size", "updated"],
        [(t.get("name"), t.get("status"), t.get("digest"), t.get("size_bytes"), t.get("updated_at"))
         for t in templates],
    )


@app.command()
def get(ctx: typer.Context, name: str, as_json: JsonFlag = False) -> None:
    """Show one template."""
    with client(ctx) as c:
        template = c.templates.get(name)
    if as_json:
        output.print_json(template)
    else:
        output.fields(template)


@app.command()
def build(
    ctx: typer.Context,
    name: str,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if it is up to date.")] = False,
) -> None:
    """Build a template: its log streams to stderr, then its digest is printed on stdout."""
    with client(ctx) as c:
        op = c.templates.build(name, force=force)
        output.info(f"building template {name} (operation {op.id})")
        for _, log_line in c.operations.logs(op.id):
            output.stderr().out(log_line, highlight=False)
        final = c.operations.get(op.id)
        final.raise_for_error()
        digest = (final.result or {}).get("digest") or c.templates.get(name).get("digest")
    output.line(str(digest))


@operations_app.command("get")
def get_operation(
    ctx: typer.Context,
    op_id: Annotated[str, typer.Argument(metavar="OP_ID")],
    wait: Annotated[float | None, typer.Option("--wait", help="Long-poll up to this many seconds.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Show an operation (with --wait, once it finished or the wait is over)."""
    with client(ctx) as c:
        if wait is None:
            op = c.operations.get(op_id)
        else:
            try:
                op = c.operations.wait(op_id, wait)
            except errors.Timeout:
                op = c.operations.get(op_id)
    if as_json:
        output.print_json(op.raw)
    else:
        output.fields({k: op.raw.get(k) for k in ("id", "kind", "target", "status", "progress", "error",
                                                  "result", "created_at", "finished_at")})
