"""Finding 8, kept closed: every place in ``space/`` that starts a process passes ``env=`` built by
:mod:`space.childenv`, so that no child ever gets a copy of its parent's environment.

The guard reads the source (AST), so a new ``subprocess.Popen(...)`` without ``env=childenv...``
fails here before it ever runs. Code that runs inside a sandbox (the guest daemon, a template's
own server) is out of scope: there the environment is the sandbox's own, given by its tenant.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SPACE = Path(__file__).resolve().parents[2] / "space"
#: Run inside sandboxes, not on the host.
INSIDE_SANDBOXES = ("guest", "templates")

#: Calls that start a process, by module: each must pass ``env=`` (a call into space.childenv).
SPAWNERS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "os": {"execve", "execvpe", "execle", "execlpe", "posix_spawn", "posix_spawnp", "spawnve", "spawnvpe",
           "spawnle", "spawnlpe"},
}
#: Calls that start a process with the parent's environment and no way to pass another: never allowed.
INHERITING = {
    "subprocess": {"getoutput", "getstatusoutput"},
    "os": {"system", "popen", "execv", "execvp", "execl", "execlp", "spawnv", "spawnvp", "spawnl", "spawnlp",
           "fork", "forkpty"},
}


def _host_sources() -> list[Path]:
    return sorted(p for p in SPACE.rglob("*.py") if p.relative_to(SPACE).parts[0] not in INSIDE_SANDBOXES)


class _Spawns(ast.NodeVisitor):
    """Spawn calls of one module, with what each passes as ``env``."""

    def __init__(self) -> None:
        #: local name -> (module, function) for ``from subprocess import Popen`` style imports.
        self.functions: dict[str, tuple[str, str]] = {}
        #: local name -> module for ``import subprocess as sp``.
        self.modules: dict[str, str] = {m: m for m in SPAWNERS}
        #: local names bound to space.childenv (the module or its functions).
        self.childenv: set[str] = set()
        self.problems: list[tuple[int, str]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name in SPAWNERS or a.name in INHERITING:
                self.modules[a.asname or a.name] = a.name
            if a.name == "space.childenv":
                self.childenv.add(a.asname or "childenv")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            if node.module in SPAWNERS or node.module in INHERITING:
                self.functions[a.asname or a.name] = (node.module, a.name)
            if node.module == "space" and a.name == "childenv":
                self.childenv.add(a.asname or a.name)
            if node.module == "space.childenv":
                self.childenv.add(a.asname or a.name)

    def _target(self, func: ast.expr) -> tuple[str, str] | None:
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in self.modules:
            return self.modules[func.value.id], func.attr
        if isinstance(func, ast.Name) and func.id in self.functions:
            return self.functions[func.id]
        return None

    def _from_childenv(self, value: ast.expr) -> bool:
        if not isinstance(value, ast.Call):
            return False
        f = value.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            return f.value.id in self.childenv
        return isinstance(f, ast.Name) and f.id in self.childenv

    def visit_Call(self, node: ast.Call) -> None:
        target = self._target(node.func)
        if target is not None:
            module, name = target
            if name in INHERITING.get(module, set()):
                self.problems.append((node.lineno, f"{module}.{name} always hands its child this process's "
                                                   "environment"))
            elif name in SPAWNERS.get(module, set()):
                env = next((k.value for k in node.keywords if k.arg == "env"), None)
                if env is None:
                    self.problems.append((node.lineno, f"{module}.{name} without env= (the child would copy "
                                                       "this process's environment)"))
                elif not self._from_childenv(env):
                    self.problems.append((node.lineno, f"{module}.{name} with an env= not built by "
                                                       f"space.childenv: {ast.unparse(env)}"))
        self.generic_visit(node)


def spawn_problems(source: str) -> list[tuple[int, str]]:
    v = _Spawns()
    v.visit(ast.parse(source))
    return v.problems


def test_every_spawn_site_in_space_builds_its_env_with_childenv() -> None:
    problems = []
    for path in _host_sources():
        for line, what in spawn_problems(path.read_text()):
            problems.append(f"{path.relative_to(SPACE.parent)}:{line}: {what}")
    assert not problems, "spawn sites that do not go through space.childenv:\n" + "\n".join(problems)


@pytest.mark.parametrize("source", [
    "import subprocess\nsubprocess.Popen(['x'])",
    "import subprocess as sp\nsp.run(['x'], env=None)",
    "from subprocess import Popen\nPopen(['x'], env=dict(os.environ))",
    "import asyncio\nasyncio.create_subprocess_exec('x')",
    "import os\nos.system('x')",
    "import os\nos.execv('/bin/x', ['x'])",
    "from space import childenv\nimport subprocess\nsubprocess.run(['x'], env={**childenv.tool()})",
], ids=["popen-no-env", "run-env-none", "popen-copied-env", "asyncio-no-env", "os-system", "execv",
        "env-wrapping-childenv"])
def test_the_guard_catches_a_spawn_that_bypasses_childenv(source: str) -> None:
    assert spawn_problems(source)


@pytest.mark.parametrize("source", [
    "from space import childenv\nimport subprocess\nsubprocess.Popen(['x'], env=childenv.build('shim'))",
    "from space.childenv import tool\nimport asyncio\nasyncio.create_subprocess_exec('x', env=tool())",
])
def test_the_guard_accepts_childenv(source: str) -> None:
    assert spawn_problems(source) == []
