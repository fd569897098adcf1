"""SingleFlight: concurrent callers for one key share one run, within a process and across processes.

Aspects: two tasks → `do` runs once and the other caller sees it done; different keys do not wait
for each other; a cancelled waiter does not keep the lock; two processes blocked on the same key's
flock → `do` runs once.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path

import pytest

from space.node.storage.artifacts import SingleFlight
from tests.waiting import await_for

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]


async def test_two_tasks_share_one_run(tmp_path: Path) -> None:
    flight = SingleFlight(tmp_path / "locks")
    done = False
    runs = 0
    checks = 0
    release = asyncio.Event()

    async def is_done() -> bool:
        nonlocal checks
        checks += 1
        return done

    async def do() -> str:
        nonlocal runs, done
        runs += 1
        await release.wait()
        done = True
        return "downloaded"

    first = asyncio.create_task(flight.once("snap-1", is_done, do))
    await await_for(lambda: _true(runs == 1), 10, "the first caller to start the download")
    second = asyncio.create_task(flight.once("snap-1", is_done, do))
    # The second caller has looked (not done yet) and is now queued behind the first.
    await await_for(lambda: _true(checks == 3), 10, "the second caller to check is_done")
    release.set()
    assert await first == "downloaded"
    assert await second is None
    assert runs == 1
    assert await flight.once("snap-1", is_done, do) is None


async def test_keys_are_independent_and_cancellation_releases(tmp_path: Path) -> None:
    flight = SingleFlight(tmp_path / "locks")
    async with flight.hold("a"):
        # Another key is free while "a" is held.
        async with flight.hold("b"):
            pass
        # A second holder of "a" in another SingleFlight (its own descriptor: flock conflicts as
        # between processes) waits in a thread; cancelling it must not leave the lock taken.
        other = SingleFlight(tmp_path / "locks")
        waiter = asyncio.create_task(_enter(other, "a"))
        await await_for(lambda: _true(_blocked_flocks(flight.lock_path("a")) == 1), 10,
                        "the second holder to block on the flock")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    # "a" is free again for everyone, including the instance whose waiter was cancelled.
    async with asyncio.timeout(10), other.hold("a"):
        pass


async def _enter(flight: SingleFlight, key: str) -> None:
    async with flight.hold(key):
        pass


async def _true(value: bool) -> bool:
    return value


def _blocked_flocks(lock_file: Path) -> int:
    """How many flock requests on ``lock_file`` are waiting, per /proc/locks."""
    inode = lock_file.stat().st_ino
    count = 0
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and "FLOCK" in fields and fields[-3].rsplit(":", 1)[-1] == str(inode):
            count += 1
    return count


CHILD = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from space.node.storage.artifacts import SingleFlight

    lock_dir, work = Path(sys.argv[1]), Path(sys.argv[2])

    async def main() -> None:
        async def is_done() -> bool:
            return (work / "done").exists()

        async def do() -> str:
            with open(work / "runs", "a") as f:
                f.write("ran\\n")
            (work / "done").write_text("yes")
            return "ran"

        result = await SingleFlight(lock_dir).once("snap-1", is_done, do)
        print(result or "skipped")

    asyncio.run(main())
""")


async def test_two_processes_share_one_run(tmp_path: Path) -> None:
    lock_dir, work = tmp_path / "locks", tmp_path / "work"
    work.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    flight = SingleFlight(lock_dir)
    procs: list[asyncio.subprocess.Process] = []
    try:
        # Hold the key so both children get past is_done and block on the flock together.
        async with flight.hold("snap-1"):
            for _ in range(2):
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, str(script), str(lock_dir), str(work), cwd=REPO,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
            await await_for(lambda: _true(_blocked_flocks(flight.lock_path("snap-1")) == 2), 30,
                            "both children to block on the flock")
        outputs = []
        for p in procs:
            async with asyncio.timeout(30):
                out, err = await p.communicate()
            assert p.returncode == 0, err.decode()
            outputs.append(out.decode().strip())
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    assert sorted(outputs) == ["ran", "skipped"]
    assert (work / "runs").read_text() == "ran\n"
