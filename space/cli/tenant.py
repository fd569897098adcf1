"""``space tenant key``: the key a tenant's snapshots and backups in object storage are sealed under."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from space.cli import output
from space.cli.context import client

app = typer.Typer(help="A tenant's settings.", no_args_is_help=True)
key_app = typer.Typer(help="The key the tenant's stored snapshots and backups are encrypted under (BYOK).",
                      no_args_is_help=True)
app.add_typer(key_app, name="key")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON exactly as the API returns it.")]
TenantOpt = Annotated[str | None, typer.Option("--tenant", help="Whose (default: your key's tenant).")]
#: The CLI's names for the API's key providers.
PROVIDERS = {"aws": "aws-kms", "local": "local", "default": None}


def _tenant(c: Any, tenant: str | None) -> str:
    return tenant if tenant is not None else str(c.quotas.get().get("tenant"))


def _describe(view: dict[str, Any]) -> str:
    where = "the deployment's key" if view.get("source") == "default" else "its own key"
    state = "" if view.get("encryption", True) else " (object encryption is off in this deployment)"
    return f"tenant {view.get('tenant')}: {where}, {view.get('provider')} {view.get('key_id')}{state}"


@key_app.command("show")
def show(ctx: typer.Context, tenant: TenantOpt = None, as_json: JsonFlag = False) -> None:
    """Show the key the tenant's snapshots and backups are sealed under."""
    with client(ctx) as c:
        view = c.quotas.get_key(_tenant(c, tenant))
    if as_json:
        output.print_json(view)
    else:
        output.line(_describe(view))


@key_app.command("set")
def set_key(
    ctx: typer.Context,
    kms: Annotated[str, typer.Option("--kms", help="aws (AWS KMS), local (the deployment's keyring), or "
                                                   "default (back to the deployment's key).")],
    key_id: Annotated[str | None, typer.Option("--key-id", help="The key's ARN or id (aws).")] = None,
    tenant: TenantOpt = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Print the re-wrap's operation id and return.")]
    = False,
    as_json: JsonFlag = False,
) -> None:
    """Seal what the tenant stores from now on under this key, and re-wrap the data keys of what it
    stored before (nothing is re-encrypted; progress on stderr). Keep the old key usable until the
    re-wrap is done. Operator or the tenant's admin key; audited."""
    if kms not in PROVIDERS:
        raise typer.BadParameter(f"one of {', '.join(PROVIDERS)}", param_hint="--kms")
    if kms == "aws" and not key_id:
        raise typer.BadParameter("an AWS KMS key needs --key-id (its ARN or id)", param_hint="--key-id")
    with client(ctx) as c:
        view = c.quotas.set_key(_tenant(c, tenant), PROVIDERS[kms], key_id)
        op_id = str((view.get("operation") or {}).get("id"))
        if no_wait:
            output.line(op_id)
            return
        output.info(_describe(view))
        op = c.operations.get(op_id)
        shown = None
        while not op.done:
            progress = op.progress or {}
            if progress.get("total") is not None and progress.get("done") != shown:
                output.info(f"re-wrapping: {progress.get('done')}/{progress.get('total')}")
                shown = progress.get("done")
            op = c.operations.get(op_id, wait=1.0)
    failure = op.exception()
    if failure is not None:
        raise failure
    result = op.result or {}
    if as_json:
        output.print_json({**view, "rewrap": result})
    else:
        output.info(f"re-wrapped {result.get('rewrapped', 0)} of {result.get('total', 0)} stored objects' keys")
