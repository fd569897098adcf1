"""How the node agent asks for a privileged verb: one interface, in-process or through the helper."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import structlog

from space.errors import InvalidRequest, RuntimeFailure, Timeout
from space.node.helper.verbs import Call, HelperContext, lookup, parse_args

log = structlog.get_logger(__name__)

LineCallback = Callable[[str], Awaitable[None] | None]


class Privileged(Protocol):
    async def call(self, verb: str, args: Mapping[str, Any] | None = None, *,
                   fds: Mapping[str, int] | None = None, on_line: LineCallback | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        """Run ``verb``; its result, or the :mod:`space.errors` class it failed with."""
        ...


def _sink(on_line: LineCallback | None) -> Callable[[str], Awaitable[None]] | None:
    if on_line is None:
        return None

    async def emit(text: str) -> None:
        maybe = on_line(text)
        if maybe is not None:
            await maybe
    return emit


async def invoke(ctx: HelperContext, verb: str, args: Mapping[str, Any] | None, *,
                 fds: Mapping[str, int] | None = None, on_line: LineCallback | None = None,
                 timeout: float | None = None, peer_pid: int | None = None) -> dict[str, Any]:
    """Validate and run one verb in this process: what both backends' server side does
    (``peer_pid``: the caller's pid; None: this process)."""
    v = lookup(verb)
    given = dict(fds or {})
    if set(given) - set(v.fds):
        raise InvalidRequest(f"{verb} takes fds {list(v.fds)}, not {sorted(given)}")
    parsed: Any = parse_args(v.args, args)
    limit = v.cap if timeout is None else min(max(timeout, 0.0), v.cap)
    started = time.monotonic()
    try:
        async with asyncio.timeout(limit):
            result = await v.fn(ctx, parsed, Call(given, _sink(on_line), peer_pid or os.getpid()))
    except TimeoutError:
        log.warning("helper.timeout", verb=verb, timeout=limit)
        raise Timeout(f"privileged {verb} timed out after {limit:g}s", verb=verb) from None
    except Exception as exc:
        log.info("helper.call", verb=verb, args=_loggable(args), ok=False, error=type(exc).__name__,
                 ms=round((time.monotonic() - started) * 1000, 1))
        raise
    (log.info if v.audit else log.debug)("helper.call", verb=verb, args=_loggable(args), ok=True,
                                         ms=round((time.monotonic() - started) * 1000, 1))
    return result


def _loggable(args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The arguments as the log keeps them: long strings (a CA certificate) cut short."""
    return {k: (v[:120] + "...") if isinstance(v, str) and len(v) > 120 else v for k, v in (args or {}).items()}


class InProcess:
    """Runs verbs in this (root) process: the helper itself, verb tests, ``space node teardown``."""

    def __init__(self, ctx: HelperContext) -> None:
        self.ctx = ctx

    async def call(self, verb: str, args: Mapping[str, Any] | None = None, *,
                   fds: Mapping[str, int] | None = None, on_line: LineCallback | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        if os.geteuid() != 0:
            # Unprivileged, runsc and btrfs fail in ways that look like answers (an empty list of
            # instances, an undercounted size): never run a verb without root.
            raise RuntimeFailure(f"privileged {verb} needs root; this process runs as uid {os.geteuid()}")
        return await invoke(self.ctx, verb, args, fds=fds, on_line=on_line, timeout=timeout)
