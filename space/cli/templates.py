"""``space template`` and ``space operation``: templates, their builds, and operations."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from space import errors
from space import templates as builtin_templates
from space.cli import output
from space.cli.context import client
from space.node.templates import dockerfile
from space.node.templates import spec as template_spec
from space.sdk import Client

app = typer.Typer(help="List, build and save templates.", no_args_is_help=True)
operations_app = typer.Typer(help="Inspect long-running operations.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON exactly as the API returns it.")]


@app.command("list")
def list_(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """List templates."""
    with client(ctx) as c:
        templates = c.templates.list()
    if as_json:
        output.print_json(templates)
        return
    output.table(
        ["name", "status", "digest", "size", "updated"],
        [(t.get("name"), t.get("status"), t.get("digest"), t.get("size_bytes"), t.get("updated_at"))
         for t in templates],
    )


@app.command()
def get(ctx: typer.Context, name: str, as_json: JsonFlag = False) -> None:
    """Show one template."""
    with client(ctx) as c:
        template = c.templates.get(name)
    if as_json:
        output.print_json(template)
    else:
        output.fields(template)


@app.command()
def build(
    ctx: typer.Context,
    name: str,
    file: Annotated[Path | None, typer.Option(
        "-f", "--file", help="Build from this space-template.toml, or from this Dockerfile (any other name): "
                             "its files are uploaded first.",
        exists=True, dir_okay=False, readable=True)] = None,
    context: Annotated[Path | None, typer.Option(
        "--context", help="A Dockerfile's build context (default: the Dockerfile's directory).",
        exists=True, file_okay=False)] = None,
    build_arg: Annotated[list[str] | None, typer.Option(
        "--build-arg", help="NAME=VALUE for an ARG of the Dockerfile (repeatable).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if it is up to date.")] = False,
    builtin: Annotated[bool, typer.Option(
        "--builtin", help=f"Build the template SPACE ships as NAME ({', '.join(builtin_templates.names())}).")] = False,
    image: Annotated[str | None, typer.Option(
        "--image", help="Build from this container image (registry/repository:tag or @sha256:...), with its "
                        "config as the template's defaults.")] = None,
    tag: Annotated[list[str] | None, typer.Option(
        "--tag", "-t", help="Tag the build (repeatable): sandboxes of NAME:TAG start from it while it is "
                            "current.")] = None,
) -> None:
    """Build a template: its log streams to stderr, then its digest is printed on stdout."""
    if sum((builtin, file is not None, image is not None)) > 1:
        raise errors.ValidationFailed("--builtin, -f/--file and --image exclude each other", field="file")
    if builtin:
        file = builtin_templates.spec_file(name)
    with client(ctx) as c, tempfile.TemporaryDirectory(prefix="space-build-") as scratch:
        spec: dict[str, object] | None = {"image": image} if image is not None else None
        if file is not None:
            parsed = (template_spec.load(file, name=name) if file.suffix == ".toml"
                      else _dockerfile(file, name, context, build_arg or [], Path(scratch)))
            for sha, path in parsed.blobs.items():
                if not c.templates.has_blob(sha):
                    output.info(f"uploading {path} ({path.stat().st_size} bytes)")
                    c.templates.put_blob(sha, path.read_bytes())
            spec = parsed.spec
        op = c.templates.build(name, spec=spec, force=force, tags=tag or None)
        output.info(f"building template {name} (operation {op.id})")
        digest = _follow(c, op.id, name)
    output.line(digest)


def _dockerfile(file: Path, name: str, context: Path | None, build_args: list[str],
                scratch: Path) -> template_spec.ParsedTemplate:
    args: dict[str, str] = {}
    for given in build_args:
        key, eq, value = given.partition("=")
        if not eq or not key:
            raise errors.ValidationFailed(f"--build-arg takes NAME=VALUE, not {given[:60]!r}", field="build_arg")
        args[key] = value
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.ValidationFailed(f"cannot read {file}: {exc}", field="file") from None
    return dockerfile.parse(text, (context or file.parent).resolve(), name=name, build_args=args, scratch=scratch)


@app.command()
def tags(ctx: typer.Context, name: str, as_json: JsonFlag = False) -> None:
    """List a template's tags and the build (digest) each names."""
    with client(ctx) as c:
        rows = c.templates.tags(name)
    if as_json:
        output.print_json(rows)
        return
    output.table(["tag", "digest", "build", "tagged"],
                 [(t.get("tag"), t.get("digest"), t.get("build_id"), t.get("created_at")) for t in rows])


@app.command()
def save(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="SANDBOX_ID")],
    name: str,
    snapshot: Annotated[str | None, typer.Option("--snapshot", help="Save this snapshot of the sandbox "
                                                 "(default: a disk snapshot taken now).")] = None,
) -> None:
    """Save a sandbox as template NAME (published to object storage); prints its digest."""
    with client(ctx) as c:
        op = c.templates.save(name, sandbox_id, snapshot=snapshot)
        output.info(f"saving sandbox {sandbox_id} as template {name} (operation {op.id})")
        digest = _follow(c, op.id, name)
    output.line(digest)


def _follow(c: Client, op_id: str, name: str) -> str:
    """Stream the operation's log to stderr until it ends; its digest (raises if it failed)."""
    for _, log_line in c.operations.logs(op_id):
        output.stderr().out(log_line, highlight=False)
    final = c.operations.get(op_id)
    final.raise_for_error()
    return str((final.result or {}).get("digest") or c.templates.get(name).get("digest"))


@operations_app.command("get")
def get_operation(
    ctx: typer.Context,
    op_id: Annotated[str, typer.Argument(metavar="OP_ID")],
    wait: Annotated[float | None, typer.Option("--wait", help="Long-poll up to this many seconds.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Show an operation (with --wait, once it finished or the wait is over)."""
    with client(ctx) as c:
        if wait is None:
            op = c.operations.get(op_id)
        else:
            try:
                op = c.operations.wait(op_id, wait)
            except errors.Timeout:
                op = c.operations.get(op_id)
    if as_json:
        output.print_json(op.raw)
    else:
        output.fields({k: op.raw.get(k) for k in ("id", "kind", "target", "status", "progress", "error",
                                                  "result", "created_at", "finished_at")})
