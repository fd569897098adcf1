"""A template's sandbox defaults and start command: what a sandbox of it is like when it boots.

:func:`template_defaults` is what every process of such a sandbox gets unless the request says
otherwise (environment, user, working directory). :func:`start_and_wait` starts the template's
``start.cmd`` in the background inside a freshly booted sandbox -- detached from any client, as
the template's user with its environment and working directory, output appended to
:data:`START_LOG` inside the sandbox -- and waits until ``start.ready`` passes: a TCP port accepting
connections inside the sandbox, or a command exiting 0. The wait runs as one probe loop inside the
sandbox (one exec, not one per poll) while the start command is watched: a start command that
fails (non-zero exit, or a signal) before the sandbox is ready fails the wait at once with the
tail of its log; one that exits 0 is taken for a daemon that forked, and the probe decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shlex
from typing import Any, Final

from space.errors import RuntimeFailure, SpaceError
from space.node.sandboxes.guest_client import GuestConnection

#: Where the start command's stdout and stderr go, inside the sandbox.
START_LOG: Final = "/var/log/space-start.log"
DEFAULT_TIMEOUT: Final = 30.0
#: Extra time the node gives the guest to report the probe's end after its own kill timer.
GRACE: Final = 5.0
#: Output of a helper command the node keeps (its last bytes): the guest decides how much it sends.
MAX_HELPER_OUTPUT: Final = 64 * 1024

_PREPARE = 'f="$1"; u="$2"; : >> "$f"; if [ -n "$u" ]; then chown "$u" "$f" 2>/dev/null || true; fi'

# Bash for /dev/tcp (bash is Essential in Debian). 127.0.0.1 first, then ::1.
_PROBE = r"""
port="$1" check="$2"
while :; do
    if [ -n "$port" ]; then
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || (exec 3<>"/dev/tcp/::1/$port") 2>/dev/null; then
            exit 0
        fi
    elif /bin/sh -c "$check" >/dev/null 2>&1 </dev/null; then
        exit 0
    fi
    sleep 0.1
done
"""


def template_defaults(spec: dict[str, Any]) -> tuple[dict[str, str], str | None, str | None]:
    """``(env, user, workdir)`` of sandboxes of the template with ``spec`` (empty/None when unset).

    A derived template's spec already carries what it inherits (template_spec.resolve_base)."""
    env = spec.get("env")
    user = spec.get("user")
    workdir = spec.get("workdir")
    return (
        {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
        str(user) if user else None,
        str(workdir) if workdir else None,
    )


async def start_and_wait(conn: GuestConnection, spec: dict[str, Any], *, timeout: float | None = None,
                         log_path: str = START_LOG) -> None:
    """Start the template's start command (if any) and wait for its readiness check (if any).

    Raises :class:`~space.errors.RuntimeFailure` (with ``log`` = the tail of :data:`START_LOG`) when
    the command fails before the sandbox is ready or the check does not pass within ``timeout``
    (default: the spec's ``start.ready.timeout_s``, else 30 s).
    """
    start = spec.get("start")
    if not isinstance(start, dict) or not start.get("cmd"):
        return
    ready = start.get("ready") if isinstance(start.get("ready"), dict) else None
    if timeout is None:
        timeout = float(ready.get("timeout_s", DEFAULT_TIMEOUT)) if ready else DEFAULT_TIMEOUT
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    env, user, workdir = template_defaults(spec)

    await _run(conn, ["/bin/sh", "-c", _PREPARE, "prepare", log_path, user or ""], timeout=timeout)
    start_id = f"start-{secrets.token_hex(4)}"
    await conn.request("exec", cmd=start_id, shell=f"exec >>{shlex.quote(log_path)} 2>&1 </dev/null\n{start['cmd']}",
                       env=env, cwd=workdir, user=user)
    if ready is None:
        return

    remaining = max(0.1, deadline - loop.time())
    probe_id = f"ready-{secrets.token_hex(4)}"
    port = str(ready["port"]) if "port" in ready else ""
    await conn.request("exec", cmd=probe_id, argv=["/bin/bash", "-c", _PROBE, "probe", port, str(ready.get("cmd", ""))],
                       env=env, cwd=workdir, user=user, kill_after=remaining)
    probe = asyncio.create_task(_exit_of(conn, probe_id))
    started = asyncio.create_task(_exit_of(conn, start_id))
    failed: str | None = None
    code: int | None = None
    try:
        async with asyncio.timeout(remaining + GRACE):
            done, _ = await asyncio.wait({probe, started}, return_when=asyncio.FIRST_COMPLETED)
            if started in done and not probe.done():
                start_code, sig = started.result()
                if start_code != 0 or sig:
                    failed = _how(start_code, sig)
            if failed is None:
                code, _sig = await probe
    except TimeoutError:
        code = None
    finally:
        for t in (probe, started):
            t.cancel()
        await asyncio.gather(probe, started, return_exceptions=True)
    if failed is not None:
        with contextlib.suppress(SpaceError):
            await conn.request("signal", cmd=probe_id, signal="SIGKILL")
        raise await _failure(conn, f"the template's start command exited ({failed}) before the sandbox was ready",
                             log_path)
    if code != 0:
        what = f"port {ready['port']} accepting connections" if port else f"{ready.get('cmd')!r} succeeding"
        raise await _failure(conn, f"the sandbox was not ready within {timeout:g}s (waited for {what})", log_path)
    with contextlib.suppress(SpaceError):
        await conn.request("forget", cmd=probe_id)


async def prime(conn: GuestConnection, user: str | None, *, timeout: float = 10.0) -> None:
    """Run ``/bin/true`` once as the sandbox's default user, then forget it (no trace in the
    command list): the first command its owner runs then finds the exec path warm (the runtime's
    file cache, the user switch) instead of paying for it. For warm-pool sandboxes, off the hot path."""
    cid = f"prime-{secrets.token_hex(4)}"
    await conn.request("exec", cmd=cid, argv=["/bin/true"], user=user, kill_after=timeout)
    async with asyncio.timeout(timeout + GRACE):
        await _exit_of(conn, cid)
    with contextlib.suppress(SpaceError):
        await conn.request("forget", cmd=cid)


def _how(code: Any, sig: Any) -> str:
    return f"signal {sig}" if sig else f"exit {code}"


async def _exit_of(conn: GuestConnection, cid: str) -> tuple[int | None, Any]:
    """The command's exit code and signal, once it exits."""
    async with contextlib.aclosing(conn.events(cid)) as events:
        async for ev, _ in events:
            if ev.get("kind") == "exit":
                code = ev.get("exit_code")
                return (int(code) if code is not None else None), ev.get("signal")
    return None, "lost"


async def _run(conn: GuestConnection, argv: list[str], *, timeout: float) -> tuple[int | None, bytes]:
    """Run a short helper command as the guest's own user (root); its exit code and the last
    MAX_HELPER_OUTPUT bytes of its stdout."""
    cid = f"startup-{secrets.token_hex(4)}"
    await conn.request("exec", cmd=cid, argv=argv, kill_after=timeout)
    out = bytearray()
    code: int | None = None
    async with asyncio.timeout(timeout + GRACE), contextlib.aclosing(conn.events(cid)) as events:
        async for ev, payload in events:
            if ev.get("kind") == "out" and ev.get("fd", 1) == 1:
                out += payload
                if len(out) > MAX_HELPER_OUTPUT:
                    del out[:-MAX_HELPER_OUTPUT]
            elif ev.get("kind") == "exit":
                code = ev.get("exit_code")
                break
    with contextlib.suppress(SpaceError):
        await conn.request("forget", cmd=cid)
    return code, bytes(out)


async def _failure(conn: GuestConnection, message: str, log_path: str) -> RuntimeFailure:
    tail = ""
    with contextlib.suppress(SpaceError, TimeoutError):
        _, out = await _run(conn, ["/usr/bin/tail", "-c", "2000", log_path], timeout=10)
        tail = out.decode("utf-8", "replace")
    last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
    suffix = f"; its log ({log_path}) ends with: {last}" if last else f"; its log ({log_path}) is empty"
    return RuntimeFailure(message + suffix, log=tail)
