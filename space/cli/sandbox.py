"""``space sandbox``: create, list, get and delete sandboxes."""

from __future__ import annotations

from typing import Annotated

import typer

from space.cli import output
from space.cli.context import client, parse_pairs

app = typer.Typer(help="Create, inspect and delete sandboxes.", no_args_is_help=True)

SandboxId = Annotated[str, typer.Argument(metavar="ID", help="The sandbox.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON exactly as the API returns it.")]


@app.command()
def create(
    ctx: typer.Context,
    template: Annotated[str, typer.Option("--template", "-t", help="Template to start from.")] = "base",
    cpu: Annotated[float | None, typer.Option("--cpu", help="CPU cores.")] = None,
    memory: Annotated[int | None, typer.Option("--memory", help="Memory in MiB.")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE (repeatable).")] = None,
    metadata: Annotated[list[str] | None, typer.Option("--metadata", "-m", help="KEY=VALUE (repeatable).")]
    = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Return while the sandbox is still creating.")]
    = False,
    idempotency_key: Annotated[str | None, typer.Option("--idempotency-key", help="Retry-safe creation.")]
    = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for it to run.")] = 300,
) -> None:
    """Create a sandbox and print its id (only the id, on stdout)."""
    env_map, meta_map = parse_pairs(env, "--env"), parse_pairs(metadata, "--metadata")
    with client(ctx) as c:
        sandbox = c.sandboxes.create(
            template, cpu=cpu, memory_mb=memory, env=env_map, metadata=meta_map,
            idempotency_key=idempotency_key, wait=False,
        )
        if not no_wait and sandbox.operation is not None:
            with output.progress(f"creating sandbox {sandbox.id} from {template}"):
                op = c.operations.wait(sandbox.operation.id, timeout)
            exc = op.exception()
            if exc is not None:
                output.info(f"sandbox {sandbox.id} failed to start")
                raise exc
        output.line(sandbox.id)


@app.command("list")
def list_(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option("--state", help="Only sandboxes in this state.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """List sandboxes (terminated ones only with --state terminated)."""
    with client(ctx) as c:
        sandboxes = c.sandboxes.list(state=state)
    if as_json:
        output.print_json([s.info for s in sandboxes])
        return
    output.table(
        ["id", "state", "template", "cpu", "memory", "created"],
        [(s.id, s.state, s.template, s.info.get("cpu"), _mib(s.info.get("memory_mb")),
          s.info.get("created_at")) for s in sandboxes],
    )


@app.command()
def get(ctx: typer.Context, sandbox_id: SandboxId, as_json: JsonFlag = False) -> None:
    """Show one sandbox."""
    with client(ctx) as c:
        sandbox = c.sandboxes.get(sandbox_id)
    if as_json:
        output.print_json(sandbox.info)
    else:
        output.fields(sandbox.info)


@app.command()
def delete(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Return while it is still terminating.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for it to go.")] = 300,
) -> None:
    """Delete a sandbox."""
    with client(ctx) as c, output.progress(f"deleting sandbox {sandbox_id}"):
        op = c.sandboxes.delete(sandbox_id, wait=not no_wait, timeout=timeout)
    output.info(f"{'deleted' if op.done else 'deleting'} {sandbox_id} (operation {op.id})")


def _mib(value: object) -> str:
    return "-" if value is None else f"{value} MiB"
