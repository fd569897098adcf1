"""Waiting on conditions with deadlines: the one place tests poll (never a fixed sleep)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


async def await_for(predicate: Callable[[], Awaitable[T]], timeout: float, what: str,
                    interval: float = 0.01) -> T:
    """The async twin of :func:`wait_for`, for conditions that need the event loop to progress."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                got = await predicate()
                if got:
                    return got
                await asyncio.sleep(interval)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


async def await_exit(pid: int, timeout: float = 30.0) -> None:
    """Until process ``pid`` has exited (its pidfd turns readable then), failing at the deadline."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    loop.add_reader(fd, exited.set)
    try:
        async with asyncio.timeout(timeout):
            await exited.wait()
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for process {pid} to exit") from None
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """:func:`await_for` for a plain predicate (state other tasks of this event loop change)."""
    async def check() -> T:
        return predicate()

    return await await_for(check, timeout, what, interval)
