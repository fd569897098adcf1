"""``space quota``: a tenant's limits and what it uses of them."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from space.cli import output
from space.cli.context import client
from space.sdk._sync._tenancy import UNSET, Unset

app = typer.Typer(help="Per-tenant quotas (setting them needs an operator key).", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON exactly as the API returns it.")]
RESOURCES = (("sandboxes", "sandboxes"), ("cpu", "cpu"), ("memory_mb", "memory (MiB)"), ("storage_mb", "storage (MiB)"),
             ("disk_mb", "disk per sandbox (MiB)"))
_CLEAR = ("none", "null", "unlimited")


def _show(quota: dict[str, Any]) -> None:
    limits, usage = quota.get("limits") or {}, quota.get("usage") or {}
    source = quota.get("source")
    output.info(f"tenant {quota.get('tenant')}" + (" (the default limits)" if source == "default" else ""))
    output.table(["resource", "limit", "in use"],
                 [(label, "unlimited" if limits.get(key) is None else limits[key], usage.get(key))
                  for key, label in RESOURCES])


@app.command("get")
def get(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Argument(help="Tenant (default: the API key's own).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Show the limits of TENANT and its usage (a limit shown as unlimited has none)."""
    with client(ctx) as c:
        quota = c.quotas.get(tenant)
    if as_json:
        output.print_json(quota)
    else:
        _show(quota)


def _parse(value: str | None, option: str) -> float | Unset | None:
    if value is None:
        return UNSET
    if value.strip().lower() in _CLEAR:
        return None
    try:
        number = float(value)
    except ValueError:
        raise typer.BadParameter(f"expected a number or 'none', got {value!r}", param_hint=option) from None
    if number < 0:
        raise typer.BadParameter("must not be negative", param_hint=option)
    return number


def _whole(value: str | None, option: str) -> int | Unset | None:
    number = _parse(value, option)
    if isinstance(number, float):
        if not number.is_integer():
            raise typer.BadParameter("must be a whole number", param_hint=option)
        return int(number)
    return number


@app.command("set")
def set_(
    ctx: typer.Context,
    tenant: str,
    sandboxes: Annotated[str | None, typer.Option("--sandboxes", help="Sandboxes at once ('none': unlimited).")] = None,
    cpu: Annotated[str | None, typer.Option("--cpu", help="CPUs of all its sandboxes ('none': unlimited).")] = None,
    memory: Annotated[str | None, typer.Option("--memory", help="MiB of all its sandboxes ('none': unlimited).")]
    = None,
    storage: Annotated[str | None, typer.Option("--storage", help="MiB of its snapshots ('none': unlimited).")]
    = None,
    disk: Annotated[str | None, typer.Option(
        "--disk", help="Largest disk limit of one of its sandboxes, MiB ('none': unlimited).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Change TENANT's limits; the ones not given stay as they are (from then on the defaults no
    longer apply to it)."""
    with client(ctx) as c:
        quota = c.quotas.set(tenant, sandboxes=_whole(sandboxes, "--sandboxes"), cpu=_parse(cpu, "--cpu"),
                             memory_mb=_whole(memory, "--memory"), storage_mb=_whole(storage, "--storage"),
                             disk_mb=_whole(disk, "--disk"))
    if as_json:
        output.print_json(quota)
    else:
        _show(quota)


def _every_text(view: dict[str, Any]) -> str:
    every = view.get("every")
    if every is None:
        return "the deployment's default"
    return "off" if every == 0 else f"every {every:g} s"


@app.command("backup")
def backup(
    ctx: typer.Context,
    tenant: str,
    every: Annotated[str | None, typer.Option(
        "--every", help="Set it: a duration ('45s', '2m'), 'off', or 'default' (the deployment's).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Show (or with --every set) how often TENANT's sandboxes are backed up to object storage; a
    sandbox's own policy (snapshot_policy.backup_every) still wins."""
    with client(ctx) as c:
        view = c.quotas.get_backup(tenant) if every is None else c.quotas.set_backup(tenant, every)
    if as_json:
        output.print_json(view)
    else:
        output.line(f"tenant {view.get('tenant')}: backup {_every_text(view)}")
