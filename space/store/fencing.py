"""Fencing tokens for a controller's writes: an operation's handler writes only while it holds
the operation's lease.

A controller whose lease lapsed (it stalled; the database answered too slowly) is cancelled, but
a statement it had already sent may still commit after another controller claimed the operation
and began again: a create's ``running`` landing after the new attempt read ``creating`` makes
that attempt's compare-and-set fail as if the sandbox had been deleted. So every write
transaction made under :func:`fenced` first locks the operation's row and checks that the lease is
still this holder's (:class:`space.errors.LeaseLost` otherwise), in the same transaction: a claim
by another controller (an update of that row) either commits before, and the stale write is
refused, or waits until the stale write has committed, and the new attempt sees it.

On SQLite (one process, one controller: every claim is its own) writes are not fenced.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Fence:
    op_id: str
    owner: str


_current: contextvars.ContextVar[Fence | None] = contextvars.ContextVar("space_store_fence", default=None)


def current() -> Fence | None:
    """The lease this task's writes are fenced by, if any."""
    return _current.get()


@contextlib.contextmanager
def fenced(op_id: str, owner: str) -> Iterator[None]:
    """Fence every write of this task (and of the tasks it starts) by ``owner``'s lease on ``op_id``."""
    token = _current.set(Fence(op_id, owner))
    try:
        yield
    finally:
        _current.reset(token)


def unfenced_context() -> contextvars.Context:
    """A copy of the current context without the fence, for work an operation starts that
    outlives it (a size filled in later, a copy removed in the background)."""
    ctx = contextvars.copy_context()
    ctx.run(_current.set, None)
    return ctx
