# Generated from space/sdk/_async/_commands.py by scripts/unasync.py: do not edit.
"""A process started in a sandbox: its event stream, stdin, signals and terminal size."""

from __future__ import annotations

from collections.abc import Iterator, Callable
from typing import Any
from urllib.parse import quote

import httpx

from space import errors
from space.sdk._models import JSON, CommandResult, Event
from space.sdk._sse import ACCEPT_EVENTS

from ._http import STREAM_IDLE_TIMEOUT, SyncHTTP, decoded

OutputCallback = Callable[[bytes], Any]


class Command:
    def __init__(self, http: SyncHTTP, sandbox_id: str, info: JSON) -> None:
        self._http = http
        self.sandbox_id = sandbox_id
        self.info = info
        self._path = f"/v1/sandboxes/{quote(sandbox_id, safe='')}/commands/{quote(self.id, safe='')}"

    @property
    def id(self) -> str:
        return str(self.info["id"])

    @property
    def pid(self) -> int | None:
        pid = self.info.get("pid")
        return None if pid is None else int(pid)

    @property
    def attach_token(self) -> str | None:
        return self.info.get("attach_token")

    def __repr__(self) -> str:
        return f"<Command {self.id} pid={self.pid} sandbox={self.sandbox_id}>"

    def refresh(self) -> JSON:
        """Re-read the command (state, exit code); attach token and other creation fields are kept."""
        self.info = {**self.info, **self._http.json("GET", self._path)}
        return self.info

    def events(self, after: int = 0) -> Iterator[Event]:
        """Output and exit events, in order and each exactly once, across dropped connections."""
        for name, seq, payload in self._http.events(f"{self._path}/events", final="exit", after=after):
            event = Event.from_wire(name, seq or 0, payload)
            if event is not None:
                yield event

    def wait(
        self, on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None
    ) -> CommandResult:
        """Follow the command to its end, collecting its output (and passing it to the callbacks)."""
        return collect(self.events(), on_stdout, on_stderr, f"command {self.id}")

    def send_stdin(self, data: bytes, eof: bool = False) -> None:
        params = {"eof": "true"} if eof else None
        headers = {"Content-Type": "application/octet-stream"}
        self._http.request("POST", f"{self._path}/stdin", params=params, content=data, headers=headers)

    def signal(self, sig: str | int = "SIGTERM") -> None:
        self._http.request("POST", f"{self._path}/signal", json={"signal": sig})

    def resize(self, rows: int, cols: int) -> None:
        self._http.request("POST", f"{self._path}/resize", json={"rows": rows, "cols": cols})


def _exit_code(event: Event) -> int:
    if event.exit_code is not None:
        return event.exit_code
    # The shell convention for a process killed by a signal.
    return 128 + event.signal if event.signal is not None else -1


def collect(
    events: Iterator[Event], on_stdout: OutputCallback | None, on_stderr: OutputCallback | None, what: str
) -> CommandResult:
    """A command's output and exit from its events (each passed to the callbacks as it comes)."""
    out, err = bytearray(), bytearray()
    result: CommandResult | None = None
    # The loop runs to the end of the stream (exit is its last event) rather than returning at
    # exit, so the stream is closed here and not whenever the generator is collected.
    for event in events:
        if event.type == "stdout":
            out += event.data
            if on_stdout is not None:
                on_stdout(event.data)
        elif event.type == "stderr":
            err += event.data
            if on_stderr is not None:
                on_stderr(event.data)
        elif event.type == "exit":
            result = CommandResult(_exit_code(event), bytes(out), bytes(err), event.signal)
    if result is None:
        raise errors.Internal(f"the event stream of {what} ended without an exit event")
    return result


class SyncRun:
    """A command started and followed in one request (``POST .../commands`` with ``Accept:
    text/event-stream``): the answer is its event stream, led by the command itself. A stream that
    drops before the exit goes on through ``GET .../events`` from the last event seen."""

    def __init__(self, http: SyncHTTP, sandbox_id: str, body: JSON) -> None:
        self._http = http
        self.sandbox_id = sandbox_id
        self._body = body
        self.command: Command | None = None
        self._last = 0

    def events(self) -> Iterator[Event]:
        path = f"/v1/sandboxes/{quote(self.sandbox_id, safe='')}/commands"
        timeout = httpx.Timeout(self._http.timeout, read=STREAM_IDLE_TIMEOUT)
        try:
            with self._http.stream("POST", path, json=self._body, timeout=timeout,
                                         headers={"Accept": ACCEPT_EVENTS}) as resp:
                for ev in decoded(resp):
                    if ev.event == "started":
                        self.command = Command(self._http, self.sandbox_id, ev.data)
                        continue
                    if ev.event == "error":
                        raise errors.from_wire(500, {"error": ev.data})
                    if ev.event == "moved":
                        break
                    if ev.seq is not None:
                        if ev.seq <= self._last:
                            continue
                        self._last = ev.seq
                    event = Event.from_wire(ev.event, ev.seq or 0, ev.data)
                    if event is not None:
                        yield event
                        if event.type == "exit":
                            return
        except errors.SpaceError as exc:
            if self.command is None or not exc.retryable:
                raise
        if self.command is None:
            raise errors.Internal("the command's event stream ended before it said the command started")
        for event in self.command.events(after=self._last):
            yield event
