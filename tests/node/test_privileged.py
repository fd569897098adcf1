"""The host-command seam (no root needed).

Aspects: output capture and input; failures carry the command and the stderr tail; probes with
``check=False``; lines are streamed with merged stderr, a last line without newline and lines longer
than the stream buffer; a timeout or a cancellation kills the whole process group; pipelines pass
data between stages and files, and name the stage that failed (pipefail semantics).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from space.errors import RuntimeFailure, Timeout
from space.node.helper import privileged
from tests.waiting import await_exit

pytestmark = pytest.mark.anyio

DEADLINE = 30.0


async def test_run_captures_output_and_feeds_input() -> None:
    res = await privileged.run("cat", input=b"hello")
    assert (res.returncode, res.stdout, res.text) == (0, b"hello", "hello")
    assert res.argv == ("cat",)


async def test_a_failure_names_the_command_and_its_stderr() -> None:
    with pytest.raises(RuntimeFailure) as excinfo:
        await privileged.run("sh", "-c", "echo early >&2; echo 'the reason' >&2; exit 3")
    err = excinfo.value
    assert "exit 3" in err.message and "the reason" in err.message
    assert err.details["argv"][0] == "sh"
    assert err.details["returncode"] == 3
    assert "early" in err.details["stderr"]


async def test_check_false_returns_the_exit_code() -> None:
    res = await privileged.run("sh", "-c", "exit 2", check=False)
    assert res.returncode == 2


async def test_stream_lines_merges_stderr_and_keeps_every_line() -> None:
    lines: list[str] = []
    long = "x" * 200_000
    script = "echo one; echo two >&2; head -c 200000 /dev/zero | tr '\\0' x; echo; printf last"
    rc = await privileged.stream_lines("sh", "-c", script, on_line=lines.append)
    assert rc == 0
    assert lines == ["one", "two", long, "last"]


async def test_stream_lines_awaits_async_callbacks_and_returns_failures() -> None:
    seen: list[str] = []

    async def on_line(line: str) -> None:
        seen.append(line)

    rc = await privileged.stream_lines("sh", "-c", "echo a; exit 5", on_line=on_line)
    assert (rc, seen) == (5, ["a"])


async def test_a_timeout_kills_the_process_group() -> None:
    pids: list[int] = []
    with pytest.raises(Timeout):
        # The child of the shell (the sleep) must die too, not only the shell.
        await privileged.stream_lines("sh", "-c", "sleep 300 & echo $!; wait",
                                      on_line=lambda s: pids.append(int(s)), timeout=1)
    assert len(pids) == 1
    await await_exit(pids[0])


async def test_cancellation_kills_the_process_group() -> None:
    started = asyncio.Event()
    pids: list[int] = []

    def on_line(line: str) -> None:
        pids.append(int(line))
        started.set()

    task = asyncio.create_task(
        privileged.stream_lines("sh", "-c", "sleep 300 & echo $!; wait", on_line=on_line)
    )
    async with asyncio.timeout(DEADLINE):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await await_exit(pids[0])


async def test_pipeline_connects_stages_and_files(tmp_path: Path) -> None:
    src, dst = tmp_path / "in", tmp_path / "out"
    src.write_bytes(b"hello pipeline\n" * 10_000)
    results = await privileged.pipeline(["gzip", "-c"], ["gzip", "-d", "-c"], ["tr", "a-z", "A-Z"],
                                        stdin=src, stdout=dst)
    assert [r.returncode for r in results] == [0, 0, 0]
    assert dst.read_bytes() == b"HELLO PIPELINE\n" * 10_000
    captured = await privileged.pipeline(["echo", "hi"], ["cat"])
    assert captured[-1].stdout == b"hi\n"


async def test_pipeline_names_the_stage_that_failed() -> None:
    with pytest.raises(RuntimeFailure) as excinfo:
        await privileged.pipeline(["sh", "-c", "echo data; echo 'producer broke' >&2; exit 4"], ["cat"])
    err = excinfo.value
    assert err.details["returncode"] == 4 and "producer broke" in err.message
    with pytest.raises(RuntimeFailure) as excinfo:
        await privileged.pipeline(
            ["yes"], ["sh", "-c", "head -c 10 >/dev/null; echo 'consumer broke' >&2; exit 7"]
        )
    err = excinfo.value
    # The consumer is the cause; the producer only died of the broken pipe.
    assert err.details["returncode"] == 7 and "consumer broke" in err.message
    assert len(err.details["stages"]) == 2


async def test_no_descriptors_leak_from_pipelines() -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        await privileged.pipeline(["echo", "x"], ["cat"], ["cat"])
    assert len(os.listdir("/proc/self/fd")) <= before


async def test_cancel_while_starting_kills_the_new_process_group(tmp_path: Path) -> None:
    # Cancelled at every point of the start, a command never leaves a process behind: asyncio
    # itself would kill only the direct child, not what it started in its session.
    pids = tmp_path / "pids"
    for delay in range(12):
        task = asyncio.ensure_future(privileged.run(
            "sh", "-c", f'sh -c "echo \\$\\$ >> {pids}; exec sleep 300" & wait'))
        for _ in range(delay):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    for pid in [int(p) for p in pids.read_text().split()] if pids.exists() else []:
        await await_exit(pid)
