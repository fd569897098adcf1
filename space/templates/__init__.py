"""Templates shipped with SPACE, as ``space-template.toml`` files in this package.

They are built like any other template (``space template build NAME --builtin`` uploads their
files and sends their spec), never on a server's first start: each takes minutes to build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from space.errors import NotFound
from space.node.templates import spec as template_spec

_HERE: Final = Path(__file__).resolve().parent

#: Built-in template name -> its spec file.
BUILTIN: Final[dict[str, Path]] = {
    "code-interpreter-v1": _HERE / "code_interpreter" / template_spec.SPEC_FILE,
}


def names() -> list[str]:
    return sorted(BUILTIN)


def spec_file(name: str) -> Path:
    """The spec file of built-in template ``name`` (NotFound if SPACE ships none of that name)."""
    path = BUILTIN.get(name)
    if path is None:
        raise NotFound(f"SPACE ships no template named {name!r} (built-in: {', '.join(names())})", name=name)
    return path


def load(name: str) -> template_spec.ParsedTemplate:
    """Built-in template ``name``'s request spec and the local files it names by sha256."""
    return template_spec.load(spec_file(name), name=name)
