"""Output conventions: data on stdout, progress and errors on stderr, plain text when not a TTY."""

from __future__ import annotations

import contextlib
import datetime
import json
import stat
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table


def stdout() -> Console:
    # Created per call: the streams may be swapped (tests, redirections) after import.
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:
        # Scripts parse the table: never wrap or truncate it to an assumed 80 columns.
        console = Console(highlight=False, soft_wrap=True, width=100_000, no_color=True)
    return console


def stderr() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def error(message: str) -> None:
    stderr().print(f"error: {message}", style="red", markup=False)


def info(message: str) -> None:
    stderr().print(message, style="dim", markup=False)


@contextlib.contextmanager
def progress(message: str) -> Iterator[None]:
    """A spinner on a terminal; nothing otherwise."""
    console = stderr()
    if not console.is_terminal:
        yield
        return
    with console.status(message):
        yield


def line(text: str) -> None:
    """One line of plain data on stdout (an id, a key): no markup, no wrapping."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_json(value: Any) -> None:
    line(json.dumps(value, indent=2, sort_keys=False))


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    console = stdout()
    t = Table(box=box.SIMPLE_HEAD if console.is_terminal else None, pad_edge=False, show_edge=False)
    for name in columns:
        t.add_column(name, overflow="fold", no_wrap=not console.is_terminal)
    for row in rows:
        t.add_row(*(fmt(v) for v in row))
    console.print(t)


def fields(obj: dict[str, Any]) -> None:
    """A key/value listing of one object."""
    table(["field", "value"], [(k, v) for k, v in obj.items()])


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


_TYPE_BITS = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}


def fmt_mode(mode: Any, kind: str | None = None) -> str:
    """``drwxr-xr-x``: the API sends permission bits and the type separately."""
    if not isinstance(mode, int):
        return fmt(mode)
    if not stat.S_IFMT(mode) and kind in _TYPE_BITS:
        mode |= _TYPE_BITS[kind]
    return stat.filemode(mode)


def fmt_time(value: Any) -> str:
    if isinstance(value, int | float):
        return datetime.datetime.fromtimestamp(value, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return fmt(value)
