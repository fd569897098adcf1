"""``space files``: move files in and out of a sandbox (streamed) and manage its tree."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from space.cli import output
from space.cli.context import client

app = typer.Typer(help="Copy and manage files inside a sandbox.", no_args_is_help=True)

SandboxId = Annotated[str, typer.Argument(metavar="ID", help="The sandbox.")]
Remote = Annotated[str, typer.Argument(metavar="PATH", help="Absolute path inside the sandbox.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON exactly as the API returns it.")]


@app.command()
def put(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    local: Annotated[str, typer.Argument(metavar="LOCAL", help="Local file, or - for stdin.")],
    remote: Remote,
) -> None:
    """Upload LOCAL to PATH (streamed; parents are created)."""
    with client(ctx) as c:
        sandbox = c.sandboxes.ref(sandbox_id)
        if local == "-":
            entry = sandbox.files.write(remote, sys.stdin.buffer)
        else:
            entry = sandbox.files.upload(local, remote)
    output.info(f"wrote {entry.get('size')} bytes to {entry.get('path', remote)}")


@app.command()
def get(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    remote: Remote,
    local: Annotated[str, typer.Argument(metavar="LOCAL", help="Local file or directory, or - for stdout.")],
) -> None:
    """Download PATH to LOCAL (streamed; the local file appears only when complete)."""
    with client(ctx) as c:
        sandbox = c.sandboxes.ref(sandbox_id)
        if local == "-":
            out = sys.stdout.buffer
            for chunk in sandbox.files.read_stream(remote):
                out.write(chunk)
            out.flush()
        else:
            target = sandbox.files.download(remote, local)
            output.info(f"saved {remote} to {target}")


@app.command("ls")
def ls(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    path: Annotated[str, typer.Argument(metavar="PATH")] = "/home/user",
    depth: Annotated[int, typer.Option("--depth", min=1, help="Levels to descend.")] = 1,
    as_json: JsonFlag = False,
) -> None:
    """List a directory."""
    with client(ctx) as c:
        entries = c.sandboxes.ref(sandbox_id).files.list(path, depth=depth)
    if as_json:
        output.print_json(entries)
        return
    output.table(
        ["type", "size", "mode", "mtime", "name"],
        [(e.get("type"), e.get("size"), output.fmt_mode(e.get("mode"), e.get("type")), output.fmt_time(e.get("mtime")),
          _display_name(e, path)) for e in entries],
    )


@app.command()
def stat(ctx: typer.Context, sandbox_id: SandboxId, path: Remote, as_json: JsonFlag = False) -> None:
    """Show one file's metadata."""
    with client(ctx) as c:
        entry = c.sandboxes.ref(sandbox_id).files.stat(path)
    if as_json:
        output.print_json(entry)
    else:
        output.fields({**entry, "mode": output.fmt_mode(entry.get("mode"), entry.get("type")),
                       "mtime": output.fmt_time(entry.get("mtime"))})


@app.command()
def rm(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    path: Remote,
    recursive: Annotated[bool, typer.Option("--recursive", "-r", help="Remove a directory and its content.")]
    = False,
) -> None:
    """Remove a file (or, with -r, a directory tree)."""
    with client(ctx) as c:
        c.sandboxes.ref(sandbox_id).files.remove(path, recursive=recursive)


@app.command()
def mkdir(ctx: typer.Context, sandbox_id: SandboxId, path: Remote) -> None:
    """Create a directory (and its parents)."""
    with client(ctx) as c:
        c.sandboxes.ref(sandbox_id).files.mkdir(path)


@app.command()
def mv(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    src: Annotated[str, typer.Argument(metavar="SRC")],
    dst: Annotated[str, typer.Argument(metavar="DST")],
) -> None:
    """Move or rename a file or directory."""
    with client(ctx) as c:
        c.sandboxes.ref(sandbox_id).files.move(src, dst)


def _display_name(entry: dict[str, object], root: str) -> str:
    """The path below the listed directory (just the name at depth 1), ``-> target`` for symlinks."""
    path = str(entry.get("path") or entry.get("name"))
    prefix = root.rstrip("/") + "/"
    name = path[len(prefix):] if path.startswith(prefix) else str(entry.get("name"))
    if entry.get("type") == "dir":
        name += "/"
    if entry.get("symlink_target"):
        name += f" -> {entry['symlink_target']}"
    return name
