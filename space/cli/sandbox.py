"""``space sandbox``: create, list, get and delete sandboxes; pause, resume, suspend, restore,
roll back and fork them, and show their events."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from space.cli import output
from space.cli.context import client, parse_pairs
from space.sdk import Operation

app = typer.Typer(help="Create, inspect, move through the lifecycle and delete sandboxes.",
                  no_args_is_help=True)

SandboxId = Annotated[str, typer.Argument(metavar="ID", help="The sandbox.")]
SnapshotId = Annotated[str, typer.Argument(metavar="SNAPSHOT", help="The snapshot.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON exactly as the API returns it.")]
NoWait = Annotated[bool, typer.Option("--no-wait", help="Return while the operation is still running.")]
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds to wait for the operation.")]


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
    idle_pause: Annotated[int | None, typer.Option(
        "--idle-pause", min=1, metavar="SECONDS", help="Pause it after this long without activity.")] = None,
    idle_suspend: Annotated[int | None, typer.Option(
        "--idle-suspend", min=1, metavar="SECONDS", help="Suspend it after this long without activity.")]
    = None,
    lifetime: Annotated[int | None, typer.Option(
        "--lifetime", min=1, metavar="SECONDS", help="Delete it this long after creation.")] = None,
    snapshot_policy: Annotated[str | None, typer.Option(
        "--snapshot-policy", metavar="JSON",
        help='Snapshot schedule and retention, e.g. \'{"disk_every": 60, "full_every": 900}\'.')] = None,
    secret: Annotated[list[str] | None, typer.Option(
        "--secret", help="A secret the gateway injects into its requests (repeatable).")] = None,
    allow: Annotated[list[str] | None, typer.Option(
        "--allow", help="Egress allowed to this host pattern or CIDR[:port] (repeatable).")] = None,
    deny: Annotated[list[str] | None, typer.Option(
        "--deny", help="Egress denied to this host pattern or CIDR[:port] (repeatable).")] = None,
    project: Annotated[str | None, typer.Option("--project", help="Secret scope between tenant and sandbox.")]
    = None,
    idempotency_key: Annotated[str | None, typer.Option("--idempotency-key", help="Retry-safe creation.")]
    = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for it to run.")] = 300,
) -> None:
    """Create a sandbox and print its id (only the id, on stdout)."""
    env_map, meta_map = parse_pairs(env, "--env"), parse_pairs(metadata, "--metadata")
    policy = _parse_policy(snapshot_policy)
    egress = {"allow": allow or [], "deny": deny or []} if allow or deny else None
    with client(ctx) as c:
        sandbox = c.sandboxes.create(
            template, cpu=cpu, memory_mb=memory, env=env_map, metadata=meta_map,
            idle_pause=idle_pause, idle_suspend=idle_suspend, lifetime=lifetime, snapshot_policy=policy,
            egress=egress, secrets=secret or None, project=project,
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
def update(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    idle_pause: Annotated[str | None, typer.Option(
        "--idle-pause", metavar="SECONDS|off", help="Pause it after this long without activity.")] = None,
    idle_suspend: Annotated[str | None, typer.Option(
        "--idle-suspend", metavar="SECONDS|off", help="Suspend it after this long without activity.")] = None,
    lifetime: Annotated[str | None, typer.Option(
        "--lifetime", metavar="SECONDS|off", help="Delete it this long from now.")] = None,
    snapshot_policy: Annotated[str | None, typer.Option(
        "--snapshot-policy", metavar="JSON|off", help="Snapshot schedule and retention.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Change a sandbox's idle, lifetime or snapshot policy (``off`` turns one off)."""
    changes: dict[str, Any] = {}
    for name, raw in (("idle_pause", idle_pause), ("idle_suspend", idle_suspend), ("lifetime", lifetime)):
        if raw is not None:
            changes[name] = None if raw == "off" else _seconds(raw, name)
    if snapshot_policy is not None:
        changes["snapshot_policy"] = None if snapshot_policy == "off" else _parse_policy(snapshot_policy)
    with client(ctx) as c:
        sandbox = c.sandboxes.ref(sandbox_id).update(**changes)
    if as_json:
        output.print_json(sandbox.info)
    else:
        output.fields(sandbox.info)


def _seconds(raw: str, name: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise typer.BadParameter(f"--{name.replace('_', '-')} takes a number of seconds or 'off', not {raw!r}")
    return int(raw)


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


@app.command()
def pause(ctx: typer.Context, sandbox_id: SandboxId, no_wait: NoWait = False, timeout: Timeout = 300) -> None:
    """Freeze a sandbox's processes in memory (resume continues them)."""
    with client(ctx) as c, output.progress(f"pausing sandbox {sandbox_id}"):
        op = c.sandboxes.ref(sandbox_id).pause(wait=not no_wait, timeout=timeout)
    _done(op, "paused", "pausing", sandbox_id)


@app.command()
def resume(ctx: typer.Context, sandbox_id: SandboxId, no_wait: NoWait = False, timeout: Timeout = 300) -> None:
    """Continue a paused sandbox."""
    with client(ctx) as c, output.progress(f"resuming sandbox {sandbox_id}"):
        op = c.sandboxes.ref(sandbox_id).resume(wait=not no_wait, timeout=timeout)
    _done(op, "resumed", "resuming", sandbox_id)


@app.command()
def suspend(ctx: typer.Context, sandbox_id: SandboxId, no_wait: NoWait = False, timeout: Timeout = 600) -> None:
    """Save a sandbox's memory and files to object storage and free its node."""
    with client(ctx) as c, output.progress(f"suspending sandbox {sandbox_id}"):
        op = c.sandboxes.ref(sandbox_id).suspend(wait=not no_wait, timeout=timeout)
    _done(op, "suspended", "suspending", sandbox_id)


@app.command()
def restore(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    node: Annotated[str | None, typer.Option("--node", help="Restore onto this node (admin only).")] = None,
    no_wait: NoWait = False,
    timeout: Timeout = 600,
) -> None:
    """Bring a suspended sandbox back, processes and all."""
    with client(ctx) as c, output.progress(f"restoring sandbox {sandbox_id}"):
        ref = c.sandboxes.ref(sandbox_id)
        op = ref.restore(node, wait=not no_wait, timeout=timeout)
    where = ref.info.get("node_id")
    _done(op, "restored" + (f" on node {where}" if op.done and where else ""), "restoring", sandbox_id)


@app.command()
def rollback(
    ctx: typer.Context, sandbox_id: SandboxId, snapshot_id: SnapshotId, no_wait: NoWait = False,
    timeout: Timeout = 600,
) -> None:
    """Put a sandbox back to one of its snapshots (a full one brings its processes back too)."""
    with client(ctx) as c, output.progress(f"rolling sandbox {sandbox_id} back to {snapshot_id}"):
        op = c.sandboxes.ref(sandbox_id).rollback(snapshot_id, wait=not no_wait, timeout=timeout)
    _done(op, f"rolled back to {snapshot_id}", f"rolling back to {snapshot_id}", sandbox_id)


@app.command()
def fork(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    snapshot: Annotated[str | None, typer.Option(
        "--snapshot", help="Fork from this snapshot (default: a full checkpoint taken now).")] = None,
    count: Annotated[int, typer.Option("--count", "-n", min=1, help="How many copies.")] = 1,
    no_wait: NoWait = False,
    timeout: Timeout = 600,
) -> None:
    """Copy a sandbox, processes and all; print the new sandbox ids, one per line (only them, on stdout)."""
    with client(ctx) as c, output.progress(f"forking sandbox {sandbox_id} into {count}"):
        source = c.sandboxes.ref(sandbox_id)
        forks = source.fork(snapshot, count, wait=not no_wait, timeout=timeout)
    op = source.operation
    origin = (op.result or {}).get("snapshot") if op is not None else None
    what = "forked" if op is not None and op.done else "forking"
    output.info(f"{what} {sandbox_id} into {len(forks)} sandbox(es)" + (f" from snapshot {origin}" if origin else "")
                + (f" (operation {op.id})" if op is not None else ""))
    for f in forks:
        output.line(f.id)


@app.command()
def events(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    after: Annotated[int, typer.Option("--after", min=0, help="Only events after this event id.")] = 0,
    as_json: JsonFlag = False,
) -> None:
    """Show a sandbox's timeline: pauses, snapshots, rollbacks, forks, crashes and recoveries."""
    with client(ctx) as c:
        evs = c.sandboxes.ref(sandbox_id).events(after=after)
    if as_json:
        output.print_json([e.raw for e in evs])
        return
    output.table(["id", "at", "kind", "message"], [(e.id, e.at, e.kind, e.message) for e in evs])


def _done(op: Operation, finished: str, running: str, sandbox_id: str) -> None:
    """``<id> paused (operation <op>)`` on stderr: stdout stays empty for scripts."""
    output.info(f"{sandbox_id} {finished if op.done else running} (operation {op.id})")


def _parse_policy(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        policy = json.loads(text)
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="--snapshot-policy") from None
    if not isinstance(policy, dict):
        raise typer.BadParameter("expected a JSON object", param_hint="--snapshot-policy")
    return policy


def _mib(value: object) -> str:
    return "-" if value is None else f"{value} MiB"
