"""Failpoints: named places where a test can make a process die or stall, to prove that a crash
at that line loses nothing. Off unless ``$SPACE_FAILPOINTS`` names them::

    SPACE_FAILPOINTS="shipping.before_manifest=crash-once:/tmp/marker,other=sleep:5"

``crash`` ends the process at once with no cleanup (like SIGKILL); ``crash-once:PATH`` does so only
if PATH does not exist yet (and creates it), so the restarted process gets past it; ``sleep:N``
stalls for N seconds; ``sleep-once:PATH:N`` stalls for N seconds in the first process to get
there (of all that share PATH: several controllers), so a test can kill the one that stalls and
watch another get past. ``while:PATH`` is a condition, not an action: :func:`active` is true while
PATH exists (a node "partitioned" for as long as a test keeps the file).
"""

from __future__ import annotations

import asyncio
import os

import structlog

log = structlog.get_logger("space.failpoints")


def _table() -> dict[str, str]:
    raw = os.environ.get("SPACE_FAILPOINTS", "")
    out = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        name, _, action = item.partition("=")
        out[name] = action
    return out


async def hit(name: str) -> None:
    action = _table().get(name)
    if action is None:
        return
    kind, _, arg = action.partition(":")
    if kind == "sleep":
        log.warning("failpoint.sleep", name=name, seconds=arg)
        await asyncio.sleep(float(arg))
    elif kind == "sleep-once":
        marker, _, seconds = arg.rpartition(":")
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return
        log.warning("failpoint.sleep", name=name, seconds=seconds, pid=os.getpid())
        await asyncio.sleep(float(seconds))
    elif kind == "crash" or (kind == "crash-once" and not os.path.exists(arg)):  # noqa: ASYNC240
        if kind == "crash-once":
            with open(arg, "w") as f:  # noqa: ASYNC230 -- the process ends on the next line
                f.write(name)
        log.warning("failpoint.crash", name=name)
        os._exit(137)


def active(name: str) -> bool:
    """Whether failpoint ``name`` (``while:PATH``) holds right now."""
    action = _table().get(name)
    if action is None:
        return False
    kind, _, arg = action.partition(":")
    return kind == "while" and os.path.exists(arg)


def configured(name: str) -> bool:
    """Whether ``$SPACE_FAILPOINTS`` names ``name`` at all (decided once, at start)."""
    return name in _table()
