"""The one seam through which the node agent runs host commands (btrfs, mount, losetup, debootstrap).

Everything privileged goes through :func:`run`, :func:`stream_lines` or :func:`pipeline`, so a later
root helper process can serve exactly these calls from an allowlist while the agent itself drops
root. Failures become :class:`~space.errors.RuntimeFailure` naming the command and the tail of its
stderr; a command that outlives its timeout is killed with its whole process group (debootstrap and
dpkg fork children) and raises :class:`~space.errors.Timeout`. Cancellation kills the same way.

Every command gets the environment of a host tool (:func:`space.childenv.tool`: a ``PATH``) plus
the names its caller passes as ``env``; never this process's own, which may hold secrets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import structlog

from space import childenv
from space.errors import RuntimeFailure, Timeout

log = structlog.get_logger(__name__)

#: How much of a failed command's stderr an error carries.
TAIL_CHARS = 2000

LineCallback = Callable[[str], Awaitable[None] | None]


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")


def _tail(data: bytes | str) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return text.strip()[-TAIL_CHARS:]


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    # Every child runs in its own session, so its pid is its process group id.
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    _kill_group(proc)
    with contextlib.suppress(ProcessLookupError):
        await proc.wait()


async def spawn(*argv: str, env: Mapping[str, str] | None = None, **kwargs: Any) -> asyncio.subprocess.Process:
    """``create_subprocess_exec`` that a cancellation cannot split from its child: cancelled while
    the process is being started, it waits for the start and kills the new process group (asyncio
    alone would kill only the direct child, and leave a grandchild such as ``sleep`` running).
    ``env``: what the command gets besides a tool's environment (:func:`space.childenv.tool`)."""
    starting = asyncio.ensure_future(asyncio.create_subprocess_exec(*argv, env=childenv.tool(env), **kwargs))
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await _reap(await starting)
        raise


async def run(
    *argv: str,
    input: bytes | None = None,
    timeout: float = 60,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
) -> Result:
    """Run ``argv`` to completion and capture its output.

    With ``check`` a non-zero exit raises RuntimeFailure; without it the caller inspects
    ``returncode`` (used for probes such as ``blkid``, whose exit code is the answer).
    ``pass_fds`` are inherited by the command under the same numbers (``/proc/self/fd/N``).
    """
    started = time.monotonic()
    proc = await spawn(
        *argv,
        stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        env=env,
        pass_fds=tuple(pass_fds),
    )
    try:
        async with asyncio.timeout(timeout):
            stdout, stderr = await proc.communicate(input)
    except TimeoutError:
        await _reap(proc)
        log.warning("privileged.timeout", argv=list(argv), timeout=timeout)
        raise Timeout(f"command timed out after {timeout:g}s: {' '.join(argv)}", argv=list(argv)) from None
    except BaseException:
        await asyncio.shield(_reap(proc))
        raise
    rc = proc.returncode
    assert rc is not None
    log.debug("privileged.run", argv=list(argv), rc=rc, ms=round((time.monotonic() - started) * 1000))
    result = Result(tuple(argv), rc, stdout, stderr)
    if check and rc != 0:
        raise _failure(argv, rc, stderr or stdout)
    return result


def _failure(argv: Sequence[str], rc: int, output: bytes | str) -> RuntimeFailure:
    tail = _tail(output)
    return RuntimeFailure(
        f"command failed (exit {rc}): {' '.join(argv)}: {tail.splitlines()[-1] if tail else 'no output'}",
        argv=list(argv),
        returncode=rc,
        stderr=tail,
    )


async def stream_lines(
    *argv: str,
    on_line: LineCallback,
    timeout: float = 3600,
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
) -> int:
    """Run ``argv`` and hand every line of its merged stdout/stderr to ``on_line``; return the exit
    code (the caller decides what a failure means and keeps whatever tail it wants to report).
    ``pass_fds`` are inherited as in :func:`run`."""
    started = time.monotonic()
    proc = await spawn(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        env=env,
        pass_fds=tuple(pass_fds),
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(timeout):
            # Not readline(): a single line longer than the stream limit must not kill the build.
            pending = b""
            while chunk := await proc.stdout.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    await _deliver(on_line, raw)
            if pending:
                await _deliver(on_line, pending)
            rc = await proc.wait()
    except TimeoutError:
        await _reap(proc)
        log.warning("privileged.timeout", argv=list(argv), timeout=timeout)
        raise Timeout(f"command timed out after {timeout:g}s: {' '.join(argv)}", argv=list(argv)) from None
    except BaseException:
        await asyncio.shield(_reap(proc))
        raise
    log.debug("privileged.stream", argv=list(argv), rc=rc, ms=round((time.monotonic() - started) * 1000))
    return rc


async def _deliver(on_line: LineCallback, raw: bytes) -> None:
    maybe = on_line(raw.decode("utf-8", "replace").rstrip("\r"))
    if maybe is not None:
        await maybe


async def pipeline(
    *commands: Sequence[str],
    stdin: Path | None = None,
    stdout: Path | None = None,
    timeout: float = 600,
) -> list[Result]:
    """Run ``commands`` connected like a shell pipeline (``btrfs send X | zstd > file``).

    ``stdin`` feeds the first stage from a file and ``stdout`` writes the last stage to a file (else
    its output is captured). Any stage failing raises RuntimeFailure naming every failed stage, so
    the root cause is reported even when the other stages die of a broken pipe.
    """
    if not commands:
        raise ValueError("pipeline needs at least one command")
    started = time.monotonic()
    procs: list[asyncio.subprocess.Process] = []
    files: list[IO[Any]] = []
    fds: set[int] = set()  # pipe ends this process still holds

    def close_fd(fd: int) -> None:
        if fd in fds:
            fds.discard(fd)
            os.close(fd)

    try:
        read_end: Any = asyncio.subprocess.DEVNULL
        if stdin is not None:
            read_end = open(stdin, "rb")  # noqa: SIM115, ASYNC230 - opening does not block; closed below
            files.append(read_end)
        for i, argv in enumerate(commands):
            last = i == len(commands) - 1
            next_read: Any = asyncio.subprocess.DEVNULL
            write_end: Any
            if not last:
                next_read, write_end = os.pipe()
                fds.update((next_read, write_end))
            elif stdout is not None:
                write_end = open(stdout, "wb")  # noqa: SIM115, ASYNC230
                files.append(write_end)
            else:
                write_end = asyncio.subprocess.PIPE
            procs.append(
                await spawn(
                    *argv, stdin=read_end, stdout=write_end, stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,
                )
            )
            # The children hold their own copies; ours must go or the reader never sees EOF.
            if isinstance(read_end, int):
                close_fd(read_end)
            if isinstance(write_end, int):
                close_fd(write_end)
            read_end = next_read
        async with asyncio.timeout(timeout):
            outputs = await asyncio.gather(*(p.communicate() for p in procs))
    except TimeoutError:
        for p in procs:
            await _reap(p)
        names = " | ".join(" ".join(c) for c in commands)
        log.warning("privileged.timeout", pipeline=names, timeout=timeout)
        raise Timeout(f"pipeline timed out after {timeout:g}s: {names}") from None
    except BaseException:
        for p in procs:
            await asyncio.shield(_reap(p))
        raise
    finally:
        for f in files:
            f.close()
        for fd in list(fds):
            close_fd(fd)
    results = [
        Result(tuple(argv), p.returncode if p.returncode is not None else -1, out or b"", err or b"")
        for argv, p, (out, err) in zip(commands, procs, outputs, strict=True)
    ]
    log.debug(
        "privileged.pipeline",
        stages=[r.argv[0] for r in results],
        rcs=[r.returncode for r in results],
        ms=round((time.monotonic() - started) * 1000),
    )
    failed = [r for r in results if r.returncode != 0]
    if failed:
        # The stage that failed on its own (not of SIGPIPE) is the one worth naming first.
        failed.sort(key=lambda r: r.returncode == -signal.SIGPIPE)
        first = failed[0]
        err = _failure(first.argv, first.returncode, first.stderr or first.stdout)
        err.details["stages"] = [
            {"argv": list(r.argv), "returncode": r.returncode, "stderr": _tail(r.stderr)} for r in failed
        ]
        raise err
    return results
