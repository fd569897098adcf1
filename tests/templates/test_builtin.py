"""The templates SPACE ships (space/templates): their registry, the spec of ``code-interpreter-v1``,
and the CLI's ``--builtin`` refusals (the build itself: tests/e2e/test_code_interpreter.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from space import templates
from space.cli.main import app
from space.errors import NotFound
from space.node.templates import spec as template_spec
from space.templates.code_interpreter import server


def test_code_interpreter_spec_derives_from_base_and_starts_the_server_it_ships() -> None:
    assert templates.names() == ["code-interpreter-v1"]
    parsed = templates.load("code-interpreter-v1")
    spec = parsed.spec
    assert (spec["name"], spec["base_template"]) == ("code-interpreter-v1", "base")
    # Pinned: a template's digest must name one set of packages.
    assert all("==" in req for req in spec["pip"])
    assert {req.split("==")[0] for req in spec["pip"]} >= {"ipykernel", "jupyter-client", "tornado"}
    [copied] = spec["files"]
    assert copied["sha256"] == template_spec.file_sha256(templates.spec_file("code-interpreter-v1").parent /
                                                         "server.py")
    assert parsed.blobs[copied["sha256"]].name == "server.py"
    assert copied["dest"] in spec["start"]["cmd"] and f"--port {server.PORT}" in spec["start"]["cmd"]
    assert spec["start"]["ready"]["port"] == server.PORT == 49999


def test_an_unknown_builtin_is_not_found() -> None:
    with pytest.raises(NotFound):
        templates.spec_file("no-such-template")


def test_cli_builtin_refusals() -> None:
    runner = CliRunner()
    unknown = runner.invoke(app, ["--url", "http://127.0.0.1:9", "--api-key", "k", "template", "build", "nope",
                                  "--builtin"])
    assert unknown.exit_code == 1 and "no template named 'nope'" in unknown.output
    both = runner.invoke(app, ["--url", "http://127.0.0.1:9", "--api-key", "k", "template", "build",
                               "code-interpreter-v1", "--builtin", "-f",
                               str(templates.spec_file("code-interpreter-v1"))])
    assert both.exit_code == 1 and "exclude each other" in both.output
