"""``space node``: the nodes of a deployment and the join tokens that admit them (operator keys).

``space node run`` and ``space node teardown`` (the agent itself) are added by :mod:`space.cli.server`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from space.cli import output
from space.cli.context import client

app = typer.Typer(help="Nodes: list, inspect, remove, admit (join tokens); run a node agent.", no_args_is_help=True)
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
        [(n["id"], n["state"], n["url"], (n.get("capacity") or {}).get("cpus"),
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
