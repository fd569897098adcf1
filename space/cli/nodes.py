"""``space node``: the nodes of a deployment and the join tokens that admit them (operator keys).

``space node run`` and ``space node teardown`` (the agent itself) are added by :mod:`space.cli.server`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from space.cli import output
from space.cli.context import client

app = typer.Typer(help="Nodes: list, inspect, cordon, drain, remove, admit (join tokens); run a node agent.",
                  no_args_is_help=True)
tokens = typer.Typer(help="Join tokens: what a node joins the cluster with (never an API key).",
                     no_args_is_help=True)
app.add_typer(tokens, name="token")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON exactly as the API returns it.")]


def _duration(text: str) -> int:
    """``90s``, ``15m``, ``24h``, ``7d`` or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        return int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
    except ValueError:
        raise typer.BadParameter(f"{text!r}: a duration like 90s, 15m, 24h or 7d", param_hint="--ttl") from None


@app.command("list")
def list_(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Every node with its state, capacity, load, version and last heartbeat."""
    with client(ctx) as c:
        nodes = c.nodes.list()
    if as_json:
        output.print_json(nodes)
        return
    output.table(
        ["id", "state", "url", "cpus", "memory", "sandboxes", "version", "heartbeat"],
        [(n["id"], n["state"] + (",cordoned" if n.get("cordoned") else ""), n["url"],
          (n.get("capacity") or {}).get("cpus"),
          (n.get("capacity") or {}).get("memory_mb"), (n.get("load") or {}).get("sandboxes"), n.get("version"),
          n.get("heartbeat_at")) for n in nodes],
    )


@app.command("get")
def get(ctx: typer.Context, node_id: str) -> None:
    """One node, as JSON."""
    with client(ctx) as c:
        output.print_json(c.nodes.get(node_id))


@app.command("remove")
def remove(ctx: typer.Context, node_id: str) -> None:
    """Forget a node (refused while sandboxes are on it). It may join again with a token."""
    with client(ctx) as c:
        c.nodes.remove(node_id)
    output.info(f"node {node_id} removed")


@app.command("cordon")
def cordon(ctx: typer.Context, node_id: str) -> None:
    """Place nothing new on the node (its warm pool is let go); what runs there runs on."""
    with client(ctx) as c:
        c.nodes.cordon(node_id)
    output.info(f"node {node_id} cordoned")


@app.command("uncordon")
def uncordon(ctx: typer.Context, node_id: str) -> None:
    """Put the node back into placement (a drain under way stops; what it moved stays moved)."""
    with client(ctx) as c:
        c.nodes.uncordon(node_id)
    output.info(f"node {node_id} uncordoned")


@app.command("drain")
def drain(
    ctx: typer.Context,
    node_id: str,
    parallel: Annotated[int, typer.Option(min=1, max=16, help="Sandboxes moved at once.")] = 2,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Print the operation id and return.")] = False,
) -> None:
    """Cordon the node and move every sandbox off it: running ones with their processes (a pause of
    about one checkpoint and its transfer), paused ones stay paused, suspended ones need nothing.
    Progress on stderr; a drain interrupted here goes on (the control plane runs it)."""
    with client(ctx) as c:
        op = c.nodes.drain(node_id, parallel=parallel)
        if no_wait:
            output.line(op.id)
            return
        output.info(f"draining node {node_id} (operation {op.id})")
        shown = None
        while not op.done:
            message = (op.progress or {}).get("message")
            if message and message != shown:
                output.info(f"{node_id}: {message}")
                shown = message
            op = c.operations.get(op.id, wait=1.0)
    failure = op.exception()
    if failure is not None:
        raise failure
    result = op.result or {}
    output.info(f"node {node_id} drained: {len(result.get('moved') or [])} sandboxes moved in "
                f"{result.get('elapsed_s', 0)} s; it stays cordoned (space node uncordon {node_id})")


@tokens.command("create")
def token_create(
    ctx: typer.Context,
    ttl: Annotated[str, typer.Option("--ttl", help="How long it admits nodes: 90s, 15m, 24h, 7d.")] = "24h",
    description: Annotated[str, typer.Option("--description", help="What it is for (shown in listings).")] = "",
    max_uses: Annotated[int | None, typer.Option("--max-uses", min=1, help="Nodes it may admit at most.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Make a join token. Its text is printed this once: put it in the node's --join-token-file."""
    with client(ctx) as c:
        t = c.nodes.tokens.create(ttl_seconds=_duration(ttl), description=description, max_uses=max_uses)
    if as_json:
        output.print_json(t)
        return
    typer.echo(t["token"])
    output.info(f"join token {t['id']} admits nodes until {t['expires_at']}"
                f"{f' (at most {max_uses})' if max_uses else ''}; cluster CA sha256 {t['ca_fingerprint']}")


@tokens.command("list")
def token_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Join tokens (their ids: the secret half is never shown again)."""
    with client(ctx) as c:
        items = c.nodes.tokens.list()
    if as_json:
        output.print_json(items)
        return
    output.table(["id", "description", "expires", "revoked", "uses", "max_uses"],
                 [(t["id"], t["description"], t["expires_at"], t["revoked_at"] or "", t["uses"], t["max_uses"] or "")
                  for t in items])


@tokens.command("revoke")
def token_revoke(ctx: typer.Context, token_id: str) -> None:
    """Revoke a join token: it admits no more nodes (the nodes it admitted stay)."""
    with client(ctx) as c:
        c.nodes.tokens.revoke(token_id)
    output.info(f"join token {token_id} revoked")
