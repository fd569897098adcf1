# Generated from space/sdk/_async/_sandboxes.py by scripts/unasync.py: do not edit.
"""Sandboxes: creating, finding and deleting them, and the handle that runs commands in one and
moves it through its lifecycle (pause, snapshots, rollback, fork, suspend, restore)."""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from space import errors
from space.sdk._models import (
    JSON,
    UNSET,
    CommandResult,
    Operation,
    SandboxEvent,
    Snapshot,
    Unset,
    command_request,
)

from ._commands import Command, SyncRun, OutputCallback, collect
from ._files import Files
from ._http import SyncHTTP
from ._resources import Operations

#: Lifecycle operations move memory images and file system deltas: they get a longer default wait.
LIFECYCLE_TIMEOUT = 300.0


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

    def get_policy(self) -> JSON:
        """Its egress policy: ``policy`` (its own), ``effective`` (what the gateway enforces),
        ``secrets`` (bound names)."""
        return self._http.json("GET", f"/v1/sandboxes/{self.id}/policy")

    def set_policy(self, *, allow: Sequence[str] = (), deny: Sequence[str] = (),
                         default: str | None = None) -> JSON:
        """Replace its egress policy; a running sandbox's next connection obeys it."""
        body: dict[str, Any] = {"allow": list(allow), "deny": list(deny)}
        if default is not None:
            body["default"] = default
        return self._http.json("PUT", f"/v1/sandboxes/{self.id}/policy", json=body)

    def refresh(self) -> Sandbox:
        self.info = self._http.json("GET", self._path)
        return self

    def update(
        self,
        *,
        idle_pause: int | Unset | None = UNSET,
        idle_suspend: int | Unset | None = UNSET,
        lifetime: int | Unset | None = UNSET,
        snapshot_policy: Mapping[str, Any] | Unset | None = UNSET,
        metadata: Mapping[str, str] | Unset | None = UNSET,
    ) -> Sandbox:
        """Change its policies or metadata; ``None`` turns a policy off, leaving one out keeps it.
        ``lifetime`` counts from now."""
        body: dict[str, Any] = {}
        for name, value in (("idle_pause_s", idle_pause), ("idle_suspend_s", idle_suspend),
                            ("lifetime_s", lifetime), ("snapshot_policy", snapshot_policy),
                            ("metadata", metadata)):
            if not isinstance(value, Unset):
                body[name] = dict(value) if isinstance(value, Mapping) else value
        self.info = self._http.json("PATCH", self._path, json=body)
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

    # -- lifecycle -----------------------------------------------------------------------------

    def _act(
        self, action: str, body: JSON | None, *, wait: bool, timeout: float | None
    ) -> Operation:
        """POST an action, then (with ``wait``) follow its operation and the sandbox's new state."""
        reply = self._http.json("POST", f"{self._path}/{action}", json=body)
        self.info = reply.get("sandbox", self.info)
        answered = Operation.from_json(reply["operation"])
        op = self._finish(answered, wait, timeout)
        if wait and not answered.done:  # (done in the answer: its sandbox is the one after it)
            self.refresh()
        return op

    def _finish(self, op: Operation, wait: bool, timeout: float | None) -> Operation:
        if wait and not op.done:  # the server carried it out before it answered (a pause)
            op = self._operations.wait(op.id, timeout)
        self.operation = op
        exc = op.exception()
        if exc is not None:
            exc.details.setdefault("sandbox_id", self.id)
            raise exc
        return op

    def pause(self, *, wait: bool = True, timeout: float | None = LIFECYCLE_TIMEOUT) -> Operation:
        """Freeze every process (memory stays in place); ``resume`` continues them."""
        return self._act("pause", None, wait=wait, timeout=timeout)

    def resume(self, *, wait: bool = True, timeout: float | None = LIFECYCLE_TIMEOUT) -> Operation:
        return self._act("resume", None, wait=wait, timeout=timeout)

    def suspend(self, *, wait: bool = True, timeout: float | None = LIFECYCLE_TIMEOUT) -> Operation:
        """Checkpoint memory and files to object storage and free the node; ``restore`` brings it back."""
        return self._act("suspend", None, wait=wait, timeout=timeout)

    def restore(
        self, node: str | None = None, *, wait: bool = True, timeout: float | None = LIFECYCLE_TIMEOUT
    ) -> Operation:
        """Bring a suspended sandbox back, on ``node`` if given (admin keys only), else where it fits."""
        body = {"node": node} if node is not None else None
        return self._act("restore", body, wait=wait, timeout=timeout)

    def rollback(
        self, snapshot_id: str, *, wait: bool = True, timeout: float | None = LIFECYCLE_TIMEOUT
    ) -> Operation:
        """Put the sandbox back to one of its snapshots (a full one brings its processes back too)."""
        return self._act("rollback", {"snapshot": snapshot_id}, wait=wait, timeout=timeout)

    def fork(
        self,
        snapshot: str | None = None,
        count: int = 1,
        *,
        metadata: Mapping[str, str] | None = None,
        wait: bool = True,
        timeout: float | None = LIFECYCLE_TIMEOUT,
    ) -> builtins.list[Sandbox]:
        """``count`` new sandboxes from ``snapshot`` (default: a full checkpoint taken now).

        With ``wait`` they are running when this returns; without, they are still creating and each
        handle's ``operation`` is the fork's.
        """
        body: JSON = {"count": count}
        if snapshot is not None:
            body["snapshot"] = snapshot
        if metadata:
            body["metadata"] = dict(metadata)
        reply = self._http.json("POST", f"{self._path}/fork", json=body)
        op = Operation.from_json(reply["operation"])
        forks = [Sandbox(self._http, self._operations, info, op) for info in reply.get("sandboxes", [])]
        if wait:
            op = self._operations.wait(op.id, timeout)
            self.operation = op
            exc = op.exception()
            if exc is not None:
                exc.details.setdefault("sandbox_id", self.id)
                exc.details.setdefault("sandbox_ids", [f.id for f in forks])
                raise exc
            for f in forks:
                f.operation = op
                f.refresh()
        else:
            self.operation = op
        return forks

    def snapshot(
        self, memory: bool = False, *, wait: bool = True, timeout: float | None = LIFECYCLE_TIMEOUT
    ) -> Snapshot:
        """Take a snapshot: of the files (``disk``), or with ``memory`` of processes too (``full``)."""
        kind = "full" if memory else "disk"
        reply = self._http.json("POST", f"{self._path}/snapshots", json={"kind": kind})
        self.info = reply.get("sandbox", self.info)
        op = self._finish(Operation.from_json(reply["operation"]), wait, timeout)
        named = reply.get("snapshot")
        if op.done and op.result and op.result.get("snapshot"):
            return self.get_snapshot(str(op.result["snapshot"]))
        if isinstance(named, dict):
            return Snapshot.from_json(named)
        return self._pending_snapshot(kind, op)

    def _pending_snapshot(self, kind: str, op: Operation) -> Snapshot:
        # The 202 answer names the operation, not the snapshot. The snapshot row is written in the
        # operation's transaction, so it is the first manual one of that kind made since then.
        since = _when(op.raw.get("created_at"))
        mine = [s for s in self.snapshots() if s.kind == kind and s.origin == "manual"]
        if since is not None:
            mine = [s for s in mine if (_when(s.created_at) or since) >= since]
        if not mine:
            raise errors.Internal(f"the {kind} snapshot just asked of sandbox {self.id} is not listed",
                                  operation=op.id)
        return min(mine, key=lambda s: _when(s.created_at) or _NEVER)

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return Snapshot.from_json(self._http.json("GET", f"/v1/snapshots/{quote(snapshot_id, safe='')}"))

    def snapshots(self) -> builtins.list[Snapshot]:
        """This sandbox's snapshots (being taken, ready, or failed), oldest first."""
        body = self._http.json("GET", f"{self._path}/snapshots")
        return [Snapshot.from_json(s) for s in body.get("snapshots", [])]

    def delete_snapshot(
        self, snapshot_id: str, *, wait: bool = True, timeout: float | None = LIFECYCLE_TIMEOUT
    ) -> Operation:
        """Delete one of this sandbox's snapshots (409 conflict while a fork or restore uses it)."""
        reply = self._http.json("DELETE", f"{self._path}/snapshots/{quote(snapshot_id, safe='')}")
        return self._finish(Operation.from_json(reply["operation"]), wait, timeout)

    def events(self, after: int = 0) -> builtins.list[SandboxEvent]:
        """The sandbox's timeline after event id ``after``, oldest first."""
        out: builtins.list[SandboxEvent] = []
        while True:
            # The server answers in pages: ask again from the last id until nothing new comes.
            body = self._http.json("GET", f"{self._path}/events", params={"after": after})
            page = [SandboxEvent.from_json(e) for e in body.get("events", [])]
            if not page:
                return out
            out.extend(page)
            after = page[-1].id

    # -- commands ------------------------------------------------------------------------------

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
        if stdin is False:  # started and followed in one request
            body = command_request(cmd, env=env, cwd=cwd, user=user, pty=pty, stdin=False, timeout=timeout)
            run = SyncRun(self._http, self.id, body)
            return collect(run.events(), on_stdout, on_stderr, f"a command in sandbox {self.id}")
        command = self.start(cmd, env=env, cwd=cwd, user=user, pty=pty, stdin=True, timeout=timeout)
        command.send_stdin(b"" if stdin is True else stdin, eof=True)
        return command.wait(on_stdout=on_stdout, on_stderr=on_stderr)

    def get_command(self, command_id: str) -> Command:
        """A handle on a command started earlier (to follow its output again, signal it, ...)."""
        info = self._http.json("GET", f"{self._path}/commands/{quote(command_id, safe='')}")
        return Command(self._http, self.id, info)

    def list_commands(self) -> builtins.list[JSON]:
        return list((self._http.json("GET", f"{self._path}/commands")).get("commands", []))


_NEVER = datetime.max.replace(tzinfo=UTC)


def _when(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        return None
    # Aware throughout, so comparisons never mix naive and aware (the server writes UTC).
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


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
        idle_pause: int | None = None,
        idle_suspend: int | None = None,
        lifetime: int | None = None,
        snapshot_policy: Mapping[str, Any] | None = None,
        egress: Mapping[str, Any] | None = None,
        secrets: Sequence[str] | None = None,
        project: str | None = None,
        idempotency_key: str | None = None,
        wait: bool = True,
        timeout: float | None = 120.0,
    ) -> Sandbox:
        """Create a sandbox; with ``wait`` return once it runs, raising its creation error if it failed.

        ``idle_pause`` / ``idle_suspend``: seconds without activity before it is paused / suspended;
        ``lifetime``: seconds before it is deleted; ``snapshot_policy``: its snapshot schedule and
        retention (e.g. ``{"disk_every": 60, "full_every": "15m", "retention": [...]}``).
        ``egress``: its egress policy (``{"allow": [...], "deny": [...], "default": "deny"}``; None:
        the tenant's default); ``secrets``: names of secrets the gateway injects into its matching
        requests; ``project``: the scope level between tenant and sandbox for those secrets.
        Retrying with the same ``idempotency_key`` returns the same sandbox instead of a second one.
        """
        body: dict[str, Any] = {"template": template}
        if egress is not None:
            body["egress"] = dict(egress)
        if secrets:
            body["secrets"] = list(secrets)
        if project:
            body["project"] = project
        if cpu is not None:
            body["cpu"] = cpu
        if memory_mb is not None:
            body["memory_mb"] = memory_mb
        if env:
            body["env"] = dict(env)
        if metadata:
            body["metadata"] = dict(metadata)
        for name, value in (("idle_pause_s", idle_pause), ("idle_suspend_s", idle_suspend),
                            ("lifetime_s", lifetime)):
            if value is not None:
                body[name] = value
        if snapshot_policy is not None:
            body["snapshot_policy"] = dict(snapshot_policy)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        reply = self._http.json("POST", "/v1/sandboxes", json=body, headers=headers)
        op = Operation.from_json(reply["operation"])
        sandbox = Sandbox(self._http, self._operations, reply["sandbox"], op)
        if op.done:  # a warm sandbox: the reply already describes it running
            sandbox._finish(op, False, None)
        elif wait:
            sandbox._finish(op, wait, timeout)
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
