"""Self-fencing: a node cut off from the control plane for longer than its lease freezes its own
sandboxes, so that the control plane, which waits out that lease before restoring them elsewhere,
never has two copies of one sandbox running.

The lease follows the control plane's heartbeats (``GET /v1/node?hb=N&ack=M``). Heartbeat ``N``'s
arrival is recorded; ``ack=M`` says the control plane received this node's answer to heartbeat
``M``. Only then does the lease run from ``M``'s arrival: a heartbeat that arrived but whose answer
was lost (a one-way partition) renews nothing, because the control plane counts its wait from the
last answer it *received*, which is never earlier than that heartbeat's arrival here. So the
node's lease always ends first:

    node fences at      arrival(M) + lease              (M: the newest acknowledged heartbeat)
    control plane waits answer(K) + lease + margin      (K: its newest answered heartbeat, K >= M)

The agent alone cannot guarantee this: stopped (SIGSTOP), hung or dead, it fences nothing, while
its sandboxes' runtimes live on. So it publishes its lease's end (``lease_file``, on
CLOCK_BOOTTIME, which every process shares) and each sandbox's shim freezes its instance once
that moment is :data:`space.runtime.shim.GRACE` past, leaving a mark; the agent, when it runs
again, takes the marks and counts those sandboxes fenced (:meth:`Fence.watch`, and at start).

Frozen (the cgroup freezer) is not stopped: when contact returns, the control
plane says per sandbox whether this node still owns it (``unfence``: it runs on) or not (it was
restored elsewhere: the copy here is discarded). A fenced sandbox cannot be resumed any other way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from space.node.sandboxes.manager import SandboxManager

log = structlog.get_logger("space.node.sandboxes.fencing")

#: Heartbeat arrivals remembered (only the last few can still be acknowledged).
MAX_HEARTBEATS = 32


class Fence:
    def __init__(self, manager: SandboxManager, *, lease: float | None, state_file: Path | None = None,
                 lease_file: Path | None = None) -> None:
        self.manager = manager
        #: Seconds without an acknowledged heartbeat after which this node fences (None: never,
        #: e.g. ``space serve``'s own node, whose control plane is its parent process).
        self.lease = lease or None
        self._arrivals: OrderedDict[int, float] = OrderedDict()
        #: Monotonic arrival time of the newest acknowledged heartbeat (None: none yet, so no lease).
        self.renewed: float | None = None
        self.fenced_at: float | None = None
        #: Where the last renewal's wall-clock time is kept: an agent restarted (by its supervisor)
        #: while cut off still fences when the lease it had runs out, not a lease later.
        self.state_file = state_file
        self._saved = 0.0
        #: Where the shims read the lease's end (None: no shim fences, e.g. in unit tests).
        self.lease_file = lease_file
        self._published: float | None = None
        self._load()
        self._publish()

    def _load(self) -> None:
        if self.state_file is None:
            return
        try:
            wall = float(json.loads(self.state_file.read_text())["renewed_at"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        self.renewed = time.monotonic() - max(0.0, time.time() - wall)

    def _save(self) -> None:
        if self.state_file is None or self.renewed is None or time.monotonic() - self._saved < 1.0:
            return
        self._saved = time.monotonic()
        wall = time.time() - (time.monotonic() - self.renewed)
        with contextlib.suppress(OSError):
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"renewed_at": wall}))
            os.replace(tmp, self.state_file)

    def _publish(self) -> None:
        """Tell the shims when the lease ends (atomically: a shim never reads half a number); no
        lease, no file, and no shim fences."""
        if self.lease_file is None:
            return
        if self.lease is None or self.renewed is None:
            with contextlib.suppress(FileNotFoundError):
                self.lease_file.unlink()
            self._published = None
            return
        end = time.clock_gettime(time.CLOCK_BOOTTIME) - (time.monotonic() - self.renewed) + self.lease
        if self._published is not None and abs(end - self._published) < 0.05:
            return
        try:
            tmp = self.lease_file.with_suffix(".tmp")
            tmp.write_text(f"{end!r}\n")
            os.replace(tmp, self.lease_file)
            self._published = end
        except OSError as exc:  # the agent's own fencing still holds; the shims keep the older end
            log.warning("fence.lease_unpublished", error=str(exc))

    def heartbeat(self, hb: int | None, ack: int | None) -> None:
        now = time.monotonic()
        if ack is not None and (arrived := self._arrivals.get(ack)) is not None:
            self.renewed = arrived if self.renewed is None else max(self.renewed, arrived)
            self._save()
            self._publish()
        if hb is not None:
            self._arrivals[hb] = now
            self._arrivals.move_to_end(hb)
            while len(self._arrivals) > MAX_HEARTBEATS:
                self._arrivals.popitem(last=False)

    def expired(self, now: float | None = None) -> bool:
        if self.lease is None or self.renewed is None:
            return False
        return (now if now is not None else time.monotonic()) - self.renewed > self.lease

    def status(self) -> dict[str, Any]:
        left = None
        if self.lease is not None and self.renewed is not None:
            left = round(self.lease - (time.monotonic() - self.renewed), 1)
        return {"lease": self.lease, "lease_left": left,
                "fenced": sorted(sb.id for sb in self.manager.list() if sb.fenced)}

    async def watch(self, every: float = 0.25) -> None:
        """Fence every running sandbox once the lease has run out; again for any that appears.
        With a lease, also the sandboxes whose shims froze them (marks); without one no shim
        fences, and recover() took any marks left from an earlier run."""
        while True:
            if self.expired():
                await self.fence_all()
            if self.lease is not None:
                try:
                    if await self.manager.take_fence_marks():
                        self.fenced_at = time.time()
                except Exception:  # the marks stay where they are until the next round
                    log.exception("fence.marks_failed")
            await asyncio.sleep(every)

    async def fence_all(self) -> list[str]:
        fenced = []
        for sb in self.manager.list():
            if sb.fenced or sb.status not in ("running", "paused"):
                continue
            try:
                await self.manager.fence(sb.id)
            except Exception:  # keep freezing the others; this one is tried again next round
                log.exception("fence.failed", sandbox=sb.id)
                continue
            fenced.append(sb.id)
        if fenced:
            self.fenced_at = time.time()
            log.warning("node.fenced", sandboxes=fenced, lease=self.lease,
                        silent_for=round(time.monotonic() - (self.renewed or 0), 1))
        return fenced
