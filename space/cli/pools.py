"""``space pool``: warm pools (booted sandboxes each node keeps ready, per template and size)."""

from __future__ import annotations

from typing import Annotated

import typer

from space.cli import output
from space.cli.context import client

app = typer.Typer(help="Warm pools: sandboxes booted ahead of demand.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON exactly as the API returns it.")]


@app.command("set")
def set_(
    ctx: typer.Context,
    template: str,
    size: Annotated[int, typer.Option("--size", min=0, help="Warm sandboxes per node (0 removes the pool).")],
    cpu: Annotated[float, typer.Option("--cpu", help="CPUs of the pooled sandboxes.")] = 1.0,
    memory: Annotated[int, typer.Option("--memory", help="Memory (MiB) of the pooled sandboxes.")] = 512,
    as_json: JsonFlag = False,
) -> None:
    """Keep SIZE booted sandboxes of TEMPLATE ready on every node; creates of that template and
    size claim one in milliseconds, and the pool refills in the background."""
    with client(ctx) as c:
        pool = c.pools.set(template, size, cpu=cpu, memory_mb=memory)
    if as_json:
        output.print_json(pool)
    else:
        output.info(f"pool {template} ({cpu:g} cpu, {memory} MiB): size {size} per node, {pool.get('ready', 0)} ready")


@app.command("list")
def list_(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Pools with their size and how many sandboxes are ready now."""
    with client(ctx) as c:
        pools = c.pools.list()
    if as_json:
        output.print_json(pools)
        return
    output.table(
        ["template", "cpu", "memory", "size", "ready", "booting"],
        [(p.get("template"), p.get("cpu"), p.get("memory_mb"), p.get("size"), p.get("ready"), p.get("booting"))
         for p in pools],
    )
