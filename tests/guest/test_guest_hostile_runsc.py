"""A hostile guest daemon as PID 1 of a real gVisor sandbox (``hostile_guest/hostile_guest.py``),
behind the real shim, next to an honest sandbox whose daemon is the real one: whatever the hostile
one sends, the node side (the GuestConnection here, the shim) stays bounded and the honest sandbox
keeps answering exec.

Memory is what this process holds beyond its baseline (tracemalloc: the connections live here) and
the shim's RSS; the honest sandbox's execs each have a generous deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from space import errors
from space.node.sandboxes import guest_client
from space.node.sandboxes.guest_client import GuestConnection
from tests.e2e.harness import Server, base_template
from tests.guest.guest_harness import RunscGuest, connected, runtime_skip_reason
from tests.guest.hostile import MiB, Retained
from tests.guest.test_guest_exec import run

pytestmark = pytest.mark.runtime
HOSTILE_DIR = Path(__file__).resolve().parent / "hostile_guest"
#: What this process may hold beyond its baseline during a flood: one replay page (STREAM_LIMIT,
#: 9 MiB), one subscriber's queue and the output held for it (SUB_LIMIT, 8 MiB each), and slack.
BOUND = 40 * MiB
#: The shim's resident memory under any flood (its buffers are 8 MiB + one frame + one read).
SHIM_RSS = 64 * MiB


class HostileGuest(RunscGuest):
    """hostile_guest.py as PID 1 (the real guest directory is still mounted: it imports protocol.py)."""

    def spec(self) -> dict[str, Any]:
        spec = super().spec()
        process: dict[str, Any] = spec["process"]  # type: ignore[assignment]
        process["args"] = ["/usr/bin/python3", "-I", "-S", "/opt/hostile/hostile_guest.py"]
        mounts: list[dict[str, Any]] = spec["mounts"]  # type: ignore[assignment]
        mounts.append({"destination": "/opt/hostile", "type": "bind", "source": str(HOSTILE_DIR),
                       "options": ["rbind", "ro"]})
        return spec

    def shim_rss(self) -> int:
        assert self.chan.shim is not None
        for line in Path(f"/proc/{self.chan.shim.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def shim_log(self) -> int:
        return os.path.getsize(self.workdir / "shim.log")


G = TypeVar("G", bound=RunscGuest)


def _sandbox(server: Server, cls: type[G]) -> Iterator[G]:
    template = base_template(server)
    reason = runtime_skip_reason(template)
    if reason:
        pytest.skip(reason)
    g = cls(template, server.data_dir / "pool" / "tmp")
    try:
        g.start()
        yield g
    finally:
        g.stop()


@pytest.fixture
def hostile(server: Server) -> Iterator[HostileGuest]:
    yield from _sandbox(server, HostileGuest)


@pytest.fixture(scope="module")
def honest(server: Server) -> Iterator[RunscGuest]:
    yield from _sandbox(server, RunscGuest)


@pytest.fixture
async def conns(hostile: HostileGuest, honest: RunscGuest
                ) -> AsyncIterator[tuple[GuestConnection, GuestConnection]]:
    async with connected(hostile.socket, timeout=60) as bad, connected(honest.socket, timeout=60) as good:
        yield bad, good


async def flooding(conn: GuestConnection) -> bool:
    return bool((await conn.request("hello", timeout=120)).get("flooding"))


async def keep_working(bad: GuestConnection, good: GuestConnection, mem: Retained, execs: int = 5) -> int:
    """With the hostile sandbox flooding (until told to stop), run ``execs`` execs in the honest one,
    each within 60 s; then stop the flood and wait for its end. The most this process held."""
    most = 0
    for i in range(execs):
        assert await flooding(bad)
        async with asyncio.timeout(60):
            _, out, _ = await run(good, argv=["echo", f"still here {i}"])
        assert out == f"still here {i}\n".encode()
        most = max(most, mem.now())
    await bad.request("stop", timeout=120)
    async with asyncio.timeout(120):
        while await flooding(bad):
            most = max(most, mem.now())
    return max(most, mem.now())


async def test_forged_ids(conns: tuple[GuestConnection, GuestConnection]) -> None:
    """Events for commands nobody started, answers for requests nobody made."""
    bad, good = conns
    with Retained() as mem:
        await bad.request("forge")
        most = await keep_working(bad, good, mem)
    assert most < BOUND, f"{most / MiB:.1f} MiB held during a flood of forged ids"
    assert bad.buffered == 0 and not bad.closed


async def test_output_flood_at_a_stalled_subscriber(conns: tuple[GuestConnection, GuestConnection]) -> None:
    """A command whose output (tiny events) ignores acks, and a subscriber that took one event and
    stopped reading; the replay it asks for is answered with endless chunks too."""
    bad, good = conns
    with Retained() as mem:
        await bad.request("exec", cmd="c-flood", argv=["x"], size=1)
        async with contextlib.aclosing(bad.events("c-flood")) as events:
            await anext(events)
            most = await keep_working(bad, good, mem)
    assert most < BOUND, f"{most / MiB:.1f} MiB held for one flooded command"
    assert bad.buffered == 0


async def test_endless_answer(conns: tuple[GuestConnection, GuestConnection],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``fs.list`` answered with endless part chunks: a clean too_large, nothing kept."""
    monkeypatch.setattr(guest_client, "ANSWER_LIMIT", 8 * MiB, raising=False)
    bad, good = conns
    with Retained() as mem:
        # 2,000 chunks of 100 entries (~140 MiB parsed): capped, for code that keeps them all.
        listing = asyncio.create_task(bad.request("fs.list", path="/", frames=2_000, timeout=600))
        await asyncio.sleep(0)  # the task sends its request before we ask whether the flood runs
        most = await keep_working(bad, good, mem)
        with pytest.raises(errors.PayloadTooLarge):
            await listing
    assert most < 8 * MiB + BOUND, f"{most / MiB:.1f} MiB held for one endless answer"
    assert bad.buffered == 0


async def test_garbage_and_broken_frames(hostile: HostileGuest,
                                         conns: tuple[GuestConnection, GuestConnection]) -> None:
    """Lengths beyond the protocol, bytes that are not frames, frames cut short: the shim skips them
    (its memory and its log stay small) and the channel still works afterwards."""
    bad, good = conns
    log_before = hostile.shim_log()
    with Retained() as mem:
        await bad.request("garbage")
        most = await keep_working(bad, good, mem)
    assert most < BOUND
    assert hostile.shim_rss() < SHIM_RSS
    assert hostile.shim_log() - log_before < 64 * 1024, "the shim logged every burst of garbage"
    assert (await bad.request("hello"))["version"] == 1


async def test_a_frame_that_never_ends(hostile: HostileGuest,
                                       conns: tuple[GuestConnection, GuestConnection]) -> None:
    """Holds already: a frame begun and trickled forever costs the shim at most one frame, and the
    honest sandbox works on (the hostile one's channel is stuck behind its own frame: its own loss)."""
    bad, good = conns
    await bad.request("partial")
    for i in range(5):
        async with asyncio.timeout(60):
            _, out, _ = await run(good, argv=["echo", str(i)])
        assert out == f"{i}\n".encode()
    assert hostile.shim_rss() < SHIM_RSS
