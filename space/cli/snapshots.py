"""``space snapshot``: take, list and delete a sandbox's snapshots (roll back and fork with
``space sandbox rollback`` / ``fork``)."""

from __future__ import annotations

from typing import Annotated

import typer

from space.cli import output
from space.cli.context import client
from space.cli.sandbox import JsonFlag, NoWait, SandboxId, SnapshotId, Timeout

app = typer.Typer(help="Take, list and delete sandbox snapshots.", no_args_is_help=True)


@app.command()
def create(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    memory: Annotated[bool, typer.Option(
        "--memory", help="A full snapshot: memory too, so processes come back on rollback or fork.")] = False,
    no_wait: NoWait = False,
    timeout: Timeout = 600,
) -> None:
    """Snapshot a sandbox's files (with --memory, its processes too); print the snapshot id last."""
    kind = "full" if memory else "disk"
    with client(ctx) as c, output.progress(f"taking a {kind} snapshot of sandbox {sandbox_id}"):
        snap = c.sandboxes.ref(sandbox_id).snapshot(memory=memory, wait=not no_wait, timeout=timeout)
    output.info(f"{snap.kind} snapshot of {sandbox_id}: {snap.status}"
                + (f", {fmt_size(snap.size_bytes)}" if snap.size_bytes is not None else ""))
    output.line(snap.id)


@app.command("list")
def list_(ctx: typer.Context, sandbox_id: SandboxId, as_json: JsonFlag = False) -> None:
    """List a sandbox's snapshots, oldest first."""
    with client(ctx) as c:
        snaps = c.sandboxes.ref(sandbox_id).snapshots()
    if as_json:
        output.print_json([s.raw for s in snaps])
        return
    output.table(
        ["id", "kind", "created", "size", "restorable"],
        [(s.id, s.kind, s.created_at, fmt_size(s.size_bytes), "yes" if s.restorable else "no") for s in snaps],
    )


@app.command()
def delete(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    snapshot_id: SnapshotId,
    no_wait: NoWait = False,
    timeout: Timeout = 300,
) -> None:
    """Delete a snapshot (refused while a fork or restore uses it)."""
    with client(ctx) as c, output.progress(f"deleting snapshot {snapshot_id}"):
        op = c.sandboxes.ref(sandbox_id).delete_snapshot(snapshot_id, wait=not no_wait, timeout=timeout)
    output.info(f"{'deleted' if op.done else 'deleting'} {snapshot_id} (operation {op.id})")


def fmt_size(n: int | None) -> str:
    """``12.3MiB``: no space, so a table row still splits into its columns on whitespace."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n}B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"
