"""``space policy``: read and change a sandbox's egress policy (applies to a running one at once)."""

from __future__ import annotations

from typing import Annotated

import typer

from space.cli import output
from space.cli.context import client

app = typer.Typer(help="A sandbox's egress policy.", no_args_is_help=True)


def _show(view: dict[str, object], as_json: bool) -> None:
    if as_json:
        output.print_json(view)
        return
    eff = view.get("effective") or {}
    assert isinstance(eff, dict)
    source = "tenant default" if view.get("inherited") else "its own"
    output.line(f"sandbox {view.get('sandbox_id')} ({source} policy)")
    layers = eff.get("all_of") or [eff]
    for i, layer in enumerate(layers):
        if len(layers) > 1:
            output.line(f"  {'tenant default' if i == 0 else 'its own'} (both must allow):")
        output.line(f"  allow:   {', '.join(layer.get('allow', [])) or '-'}")
        output.line(f"  deny:    {', '.join(layer.get('deny', [])) or '-'}")
        output.line(f"  default: {layer.get('default') or ('deny' if layer.get('allow') else 'allow')}")
    limits = view.get("limits") or {}
    assert isinstance(limits, dict)
    for note in limits.get("clipped") or []:
        output.line(f"  note:    {note}")
    secrets = view.get("secrets") or []
    assert isinstance(secrets, list)
    output.line(f"  secrets: {', '.join(str(s) for s in secrets) or '-'}")


@app.command("get")
def get(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the sandbox's egress policy and the secrets bound to it (names only)."""
    with client(ctx) as c:
        _show(c.sandboxes.get(sandbox_id).get_policy(), as_json)


@app.command("set")
def set_(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id.")],
    allow: Annotated[list[str] | None, typer.Option("--allow", help="Host pattern or CIDR[:port] (repeatable).")]
    = None,
    deny: Annotated[list[str] | None, typer.Option("--deny", help="Host pattern or CIDR[:port] (repeatable).")]
    = None,
    default: Annotated[str | None, typer.Option("--default", help="allow or deny what no rule matches.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Replace the sandbox's egress policy (no --allow/--deny/--default: back to the tenant's default)."""
    if default is not None and default not in ("allow", "deny"):
        raise typer.BadParameter("--default must be 'allow' or 'deny'")
    with client(ctx) as c:
        _show(c.sandboxes.get(sandbox_id).set_policy(allow=allow or [], deny=deny or [], default=default),
              as_json)
