"""Sandboxes: creating, finding and deleting them, and the handle that runs commands in one."""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from space.sdk._models import JSON, CommandResult, Operation, command_request

from ._commands import AsyncCommand, OutputCallback
from ._files import AsyncFiles
from ._http import AsyncHTTP
from ._resources import AsyncOperations


class AsyncSandbox:
    """A handle on one sandbox; ``info`` is its last known JSON (see ``refresh``)."""

    def __init__(
        self, http: AsyncHTTP, operations: AsyncOperations, info: JSON, operation: Operation | None = None
    ) -> None:
        self._http = http
        self._operations = operations
        self.info = info
        #: The last operation started through this handle (its creation, or its deletion).
        self.operation = operation
        self._path = f"/v1/sandboxes/{quote(self.id, safe='')}"
        self.files = AsyncFiles(http, self.id)

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

    async def refresh(self) -> AsyncSandbox:
        self.info = await self._http.json("GET", self._path)
        return self

    async def delete(
        self, *, wait: bool = True, timeout: float | None = 120.0
    ) -> Operation:
        reply = await self._http.json("DELETE", self._path)
        self.info = reply.get("sandbox", self.info)
        op = Operation.from_json(reply["operation"])
        if wait:
            op = await self._operations.wait(op.id, timeout)
        self.operation = op
        op.raise_for_error()
        return op

    async def start(
        self,
        cmd: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        pty: tuple[int, int] | bool | None = None,
        stdin: bool = False,
        timeout: float | None = None,
    ) -> AsyncCommand:
        """Start ``cmd`` (a string runs in a shell, a list as argv) and return at once with its handle."""
        body = command_request(cmd, env=env, cwd=cwd, user=user, pty=pty, stdin=stdin, timeout=timeout)
        info = await self._http.json("POST", f"{self._path}/commands", json=body)
        return AsyncCommand(self._http, self.id, info)

    async def exec(
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
        command = await self.start(
            cmd, env=env, cwd=cwd, user=user, pty=pty, stdin=stdin is not False, timeout=timeout
        )
        if stdin is not False:
            await command.send_stdin(b"" if stdin is True else stdin, eof=True)
        return await command.wait(on_stdout=on_stdout, on_stderr=on_stderr)

    async def get_command(self, command_id: str) -> AsyncCommand:
        """A handle on a command started earlier (to follow its output again, signal it, ...)."""
        info = await self._http.json("GET", f"{self._path}/commands/{quote(command_id, safe='')}")
        return AsyncCommand(self._http, self.id, info)

    async def list_commands(self) -> builtins.list[JSON]:
        return list((await self._http.json("GET", f"{self._path}/commands")).get("commands", []))


class AsyncSandboxes:
    def __init__(self, http: AsyncHTTP, operations: AsyncOperations) -> None:
        self._http = http
        self._operations = operations

    async def create(
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
    ) -> AsyncSandbox:
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
        reply = await self._http.json("POST", "/v1/sandboxes", json=body, headers=headers)
        op = Operation.from_json(reply["operation"])
        sandbox = AsyncSandbox(self._http, self._operations, reply["sandbox"], op)
        if wait:
            op = await self._operations.wait(op.id, timeout)
            sandbox.operation = op
            exc = op.exception()
            if exc is not None:
                exc.details.setdefault("sandbox_id", sandbox.id)
                raise exc
            await sandbox.refresh()
        return sandbox

    def ref(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on a sandbox without asking the server (``info`` holds only the id until refresh)."""
        return AsyncSandbox(self._http, self._operations, {"id": sandbox_id})

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        info = await self._http.json("GET", f"/v1/sandboxes/{quote(sandbox_id, safe='')}")
        return AsyncSandbox(self._http, self._operations, info)

    async def list(self, state: str | None = None) -> builtins.list[AsyncSandbox]:
        params = {"state": state} if state else None
        body = await self._http.json("GET", "/v1/sandboxes", params=params)
        return [AsyncSandbox(self._http, self._operations, info) for info in body.get("sandboxes", [])]

    async def delete(
        self, sandbox_id: str, *, wait: bool = True, timeout: float | None = 120.0
    ) -> Operation:
        """Delete a sandbox; with ``wait`` return once it is gone, raising the error if that failed."""
        reply = await self._http.json("DELETE", f"/v1/sandboxes/{quote(sandbox_id, safe='')}")
        op = Operation.from_json(reply["operation"])
        if wait:
            op = await self._operations.wait(op.id, timeout)
            op.raise_for_error()
        return op
