# Generated from space/sdk/_async/_sandboxes.py by scripts/unasync.py: do not edit.
"""Sandboxes: creating, finding and deleting them, and the handle that runs commands in one."""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from space.sdk._models import JSON, CommandResult, Operation, command_request

from ._commands import Command, OutputCallback
from ._files import Files
from ._http import SyncHTTP
from ._resources import Operations


class Sandbox:
    """A handle on one sandbox; ``info`` is its last known JSON (see ``refresh``)."""

    def __init__(
        self, http: SyncHTTP, operations: Operations, info: JSON, operation: Operation | None = None
    ) -> None:
        self._http = http
        self._operations = operations
        self.info = info
        #: The last operation started through this handle (its creation, or its deletion).
        self.operation = operation
        self._path = f"/v1/sandboxes/{quote(self.id, safe='')}"
        self.files = Files(http, self.id)

    @property
    def id(self) -> str:
        return str(self.info["id"])

    @property
    def state(self) -> str:
        return str(self.info.get("state", "unknown"))

    @property
    def template(self) -> str:
        return str(self.info.get("template", ""))

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.state} template={self.template}>"

    def refresh(self) -> Sandbox:
        self.info = self._http.json("GET", self._path)
        return self

    def delete(
        self, *, wait: bool = True, timeout: float | None = 120.0
    ) -> Operation:
        reply = self._http.json("DELETE", self._path)
        self.info = reply.get("sandbox", self.info)
        op = Operation.from_json(reply["operation"])
        if wait:
            op = self._operations.wait(op.id, timeout)
        self.operation = op
        op.raise_for_error()
        return op

    def start(
        self,
        cmd: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        pty: tuple[int, int] | bool | None = None,
        stdin: bool = False,
        timeout: float | None = None,
    ) -> Command:
        """Start ``cmd`` (a string runs in a shell, a list as argv) and return at once with its handle."""
        body = command_request(cmd, env=env, cwd=cwd, user=user, pty=pty, stdin=stdin, timeout=timeout)
        info = self._http.json("POST", f"{self._path}/commands", json=body)
        return Command(self._http, self.id, info)

    def exec(
        self,
        cmd: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        pty: tuple[int, int] | bool | None = None,
        stdin: bool | bytes = False,
        timeout: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandResult:
        """Run ``cmd`` to completion. ``stdin`` may be bytes: they are written, then stdin is closed."""
        command = self.start(
            cmd, env=env, cwd=cwd, user=user, pty=pty, stdin=stdin is not False, timeout=timeout
        )
        if stdin is not False:
            command.send_stdin(b"" if stdin is True else stdin, eof=True)
        return command.wait(on_stdout=on_stdout, on_stderr=on_stderr)

    def get_command(self, command_id: str) -> Command:
        """A handle on a command started earlier (to follow its output again, signal it, ...)."""
        info = self._http.json("GET", f"{self._path}/commands/{quote(command_id, safe='')}")
        return Command(self._http, self.id, info)

    def list_commands(self) -> builtins.list[JSON]:
        return list((self._http.json("GET", f"{self._path}/commands")).get("commands", []))


class Sandboxes:
    def __init__(self, http: SyncHTTP, operations: Operations) -> None:
        self._http = http
        self._operations = operations

    def create(
        self,
        template: str = "base",
        *,
        cpu: float | None = None,
        memory_mb: int | None = None,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        wait: bool = True,
        timeout: float | None = 120.0,
    ) -> Sandbox:
        """Create a sandbox; with ``wait`` return once it runs, raising its creation error if it failed.

        Retrying with the same ``idempotency_key`` returns the same sandbox instead of a second one.
        """
        body: dict[str, Any] = {"template": template}
        if cpu is not None:
            body["cpu"] = cpu
        if memory_mb is not None:
            body["memory_mb"] = memory_mb
        if env:
            body["env"] = dict(env)
        if metadata:
            body["metadata"] = dict(metadata)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        reply = self._http.json("POST", "/v1/sandboxes", json=body, headers=headers)
        op = Operation.from_json(reply["operation"])
        sandbox = Sandbox(self._http, self._operations, reply["sandbox"], op)
        if wait:
            op = self._operations.wait(op.id, timeout)
            sandbox.operation = op
            exc = op.exception()
            if exc is not None:
                exc.details.setdefault("sandbox_id", sandbox.id)
                raise exc
            sandbox.refresh()
        return sandbox

    def ref(self, sandbox_id: str) -> Sandbox:
        """A handle on a sandbox without asking the server (``info`` holds only the id until refresh)."""
        return Sandbox(self._http, self._operations, {"id": sandbox_id})

    def get(self, sandbox_id: str) -> Sandbox:
        info = self._http.json("GET", f"/v1/sandboxes/{quote(sandbox_id, safe='')}")
        return Sandbox(self._http, self._operations, info)

    def list(self, state: str | None = None) -> builtins.list[Sandbox]:
        params = {"state": state} if state else None
        body = self._http.json("GET", "/v1/sandboxes", params=params)
        return [Sandbox(self._http, self._operations, info) for info in body.get("sandboxes", [])]

    def delete(
        self, sandbox_id: str, *, wait: bool = True, timeout: float | None = 120.0
    ) -> Operation:
        """Delete a sandbox; with ``wait`` return once it is gone, raising the error if that failed."""
        reply = self._http.json("DELETE", f"/v1/sandboxes/{quote(sandbox_id, safe='')}")
        op = Operation.from_json(reply["operation"])
        if wait:
            op = self._operations.wait(op.id, timeout)
            op.raise_for_error()
        return op
