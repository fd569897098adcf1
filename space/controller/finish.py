"""What an operation's handler returns when its last step is its sandbox's new state."""

from __future__ import annotations

import dataclasses
from typing import Any

from space.store.sandboxes import StateChange


@dataclasses.dataclass(frozen=True, slots=True)
class Finish:
    """The handler's ``result`` and the ``change`` that completes its work: the controller writes
    both in the operation's final write (:meth:`Store.finish_with_change`), one write instead of
    two on the path of a pause or a resume. A crash before that write leaves the operation running
    and the sandbox in its old state: the retry sees the old state and does the (idempotent) work
    again."""

    result: dict[str, Any]
    change: StateChange
