"""``space exec``: run a command in a sandbox, its output streamed live as raw bytes.

The CLI exits with the command's exit code (128+N when signal N killed it). With ``--tty`` the
command gets a terminal; when ours is one too, it is switched to raw mode and every key, and every
window resize, goes to the sandbox.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import threading
from typing import Annotated, BinaryIO

import typer

from space import errors
from space.cli import output
from space.cli.context import client, parse_pairs
from space.sdk import Command, Event

STDIN_CHUNK = 64 * 1024
TTY_HELP = "Allocate a terminal; with a local one, raw mode and forwarded keys and window size."


def register(app: typer.Typer) -> None:
    # Options go before ID; everything after ID (or after --) is the command line.
    app.command("exec", context_settings={"allow_interspersed_args": False})(exec_command)


def exec_command(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="The sandbox.")],
    cmd: Annotated[list[str], typer.Argument(metavar="CMD", help="The command line (argv), after --.")],
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE (repeatable).")] = None,
    cwd: Annotated[str | None, typer.Option("--cwd", help="Working directory.")] = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Run as this user.")] = None,
    tty: Annotated[bool, typer.Option("--tty", "-t", help=TTY_HELP)] = False,
    stdin: Annotated[bool, typer.Option("--stdin", "-i", help="Forward our stdin (closed at its end).")]
    = False,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Kill the command after SECONDS.")]
    = None,
) -> None:
    """Run a command in a sandbox and exit with its exit code."""
    if cmd[:1] == ["--"]:  # `space exec ID -- CMD`: options end at ID, so the -- reaches us
        cmd = cmd[1:]
    if not cmd:
        raise typer.BadParameter("missing command", param_hint="CMD")
    env_map = parse_pairs(env, "--env")
    interactive = tty and sys.stdin.isatty()
    if tty:
        env_map.setdefault("TERM", os.environ.get("TERM", "xterm-256color"))
    with client(ctx) as c:
        command = c.sandboxes.ref(sandbox_id).start(
            cmd, env=env_map, cwd=cwd, user=user, pty=window_size() if tty else None,
            stdin=stdin or interactive, timeout=timeout,
        )
        if interactive:
            code = _interactive(command)
        elif stdin:
            pump = _start(_pump, command, sys.stdin.buffer)
            code = follow(command)
            pump.join(timeout=0.25)  # it is done unless the command exited before our stdin ended
        else:
            code = follow(command)
    raise typer.Exit(code)


def follow(command: Command) -> int:
    """Copy the command's output to ours until it exits; return its exit status.

    A first Ctrl-C is forwarded to the command as SIGINT; a second one gives up waiting.
    """
    out, err = sys.stdout.buffer, sys.stderr.buffer
    last = 0
    status: int | None = None
    interrupted = False
    while status is None:
        try:
            # Exit is the last event: the loop ends with the stream, which closes it.
            for event in command.events(after=last):
                last = event.seq
                if event.type == "stdout":
                    out.write(event.data)
                    out.flush()
                elif event.type == "stderr":
                    err.write(event.data)
                    err.flush()
                elif event.type == "gap":
                    output.info(f"[space: {event.lost_bytes} bytes of output were dropped]")
                elif event.type == "exit":
                    status = exit_status(event)
            if status is None:
                raise errors.Internal(f"the output of command {command.id} ended without an exit event")
        except KeyboardInterrupt:
            if interrupted:
                raise
            interrupted = True
            command.signal("SIGINT")
    return status


def exit_status(event: Event) -> int:
    if event.signal:
        return 128 + event.signal
    return event.exit_code if event.exit_code is not None else 1


def window_size() -> tuple[int, int]:
    cols, rows = shutil.get_terminal_size((80, 24))
    return rows, cols


def _start(target: object, *args: object) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


# Forwarders run beside the output stream and are best effort: if the command exited meanwhile, its
# stdin is gone (or our client closed); the exit event already tells the outcome.
_FORWARD_ERRORS = (errors.SpaceError, OSError, RuntimeError)


def _pump(command: Command, source: BinaryIO) -> None:
    try:
        while chunk := (source.read1(STDIN_CHUNK) if hasattr(source, "read1") else source.read(STDIN_CHUNK)):
            command.send_stdin(chunk)
        command.send_stdin(b"", eof=True)
    except _FORWARD_ERRORS:
        return


def _pump_tty(command: Command, fd: int, done: threading.Event) -> None:
    try:
        while not done.is_set():
            # A short select timeout lets the thread notice that the command ended.
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            data = os.read(fd, STDIN_CHUNK)
            if not data:
                command.send_stdin(b"", eof=True)
                return
            command.send_stdin(data)
    except _FORWARD_ERRORS:
        return


def _resize_on_winch(command: Command, winch: threading.Event, done: threading.Event) -> None:
    # The SIGWINCH handler only sets ``winch``: an HTTP call inside a signal handler could re-enter
    # the connection pool the main thread is in the middle of using.
    try:
        while True:
            winch.wait()
            if done.is_set():
                return
            winch.clear()
            command.resize(*window_size())
    except _FORWARD_ERRORS:
        return


def _interactive(command: Command) -> int:
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    done, winch = threading.Event(), threading.Event()
    previous = signal.signal(signal.SIGWINCH, lambda *_: winch.set())
    tty.setraw(fd)
    try:
        _start(_pump_tty, command, fd, done)
        _start(_resize_on_winch, command, winch, done)
        return follow(command)
    finally:
        done.set()
        winch.set()
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGWINCH, previous)
