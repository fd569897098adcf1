"""Plain values the SDK hands back: operations, command events and results, snapshots and
sandbox events.

They are shared by the async and the sync client (neither does I/O here).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from space import errors

JSON = dict[str, Any]

EventType = Literal["stdout", "stderr", "gap", "exit"]


@dataclass(frozen=True, slots=True)
class Operation:
    """A long-running change on the server (``sandbox.create``, ``template.build`` ...)."""

    id: str
    kind: str
    target: str | None
    status: str
    error: JSON | None = None
    progress: JSON | None = None
    result: JSON | None = None
    raw: JSON = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, body: JSON) -> Operation:
        return cls(
            id=str(body["id"]),
            kind=str(body.get("kind", "")),
            target=body.get("target"),
            status=str(body.get("status", "pending")),
            error=body.get("error"),
            progress=body.get("progress"),
            result=body.get("result"),
            raw=body,
        )

    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed")

    def exception(self) -> errors.SpaceError | None:
        """The error of a failed operation as the class of its code (None unless it failed)."""
        if self.status != "failed":
            return None
        err = self.error or {"code": "internal", "message": f"operation {self.id} failed"}
        exc = errors.from_wire(_status_of(err), {"error": err})
        exc.details.setdefault("operation", self.id)
        return exc

    def raise_for_error(self) -> None:
        exc = self.exception()
        if exc is not None:
            raise exc


def _status_of(err: JSON) -> int:
    cls = errors.BY_CODE.get(str(err.get("code")))
    return cls.status if cls is not None else 500


@dataclass(frozen=True, slots=True)
class Event:
    """One event of a command's output stream; ``exit`` is always the last one."""

    type: EventType
    seq: int
    data: bytes = b""
    exit_code: int | None = None
    signal: int | None = None
    lost_bytes: int = 0

    @classmethod
    def from_wire(cls, name: str, seq: int, payload: JSON) -> Event | None:
        """Build an event from its SSE name and JSON data; unknown names give None (ignored)."""
        if name in ("stdout", "stderr"):
            data = payload.get("data", b"")  # bytes from frames, base64 from SSE
            return cls("stdout" if name == "stdout" else "stderr", seq,
                       data=data if isinstance(data, bytes) else base64.b64decode(data))
        if name == "gap":
            return cls("gap", seq, lost_bytes=int(payload.get("lost_bytes", 0)))
        if name == "exit":
            code = payload.get("exit_code")
            sig = payload.get("signal")
            return cls(
                "exit",
                seq,
                exit_code=None if code is None else int(code),
                signal=None if sig is None else int(sig),
            )
        return None


@dataclass(frozen=True, slots=True)
class CommandResult:
    """How a command ended and everything it wrote."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    signal: int | None = None

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.signal is None


def command_request(
    cmd: Sequence[str] | str,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | None = None,
    pty: tuple[int, int] | bool | None = None,
    stdin: bool = False,
    timeout: float | None = None,
) -> JSON:
    """The body of ``POST /v1/sandboxes/{id}/commands``: a string runs in a shell, a list as argv."""
    if isinstance(cmd, str):
        body: JSON = {"shell": cmd}
    else:
        argv = list(cmd)
        if not argv:
            raise errors.InvalidRequest("empty command")
        body = {"cmd": argv}
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if user is not None:
        body["user"] = user
    if pty is True:
        body["pty"] = {"rows": 24, "cols": 80}
    elif pty:
        body["pty"] = {"rows": pty[0], "cols": pty[1]}
    if stdin:
        body["stdin"] = True
    if timeout is not None:
        body["timeout"] = timeout
    return body


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A point a sandbox can go back to (rollback) or be copied from (fork).

    ``kind`` is ``disk`` (the files) or ``full`` (memory and files: processes come back too).
    ``restorable`` is true only once it is ready and its artifacts are in place.
    """

    id: str
    sandbox_id: str
    kind: str
    status: str
    restorable: bool
    origin: str = ""
    size_bytes: int | None = None
    created_at: str | None = None
    location: tuple[str, ...] = ()
    node_id: str | None = None
    error: str | None = None
    raw: JSON = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, body: JSON) -> Snapshot:
        size = body.get("size_bytes")
        return cls(
            id=str(body["id"]),
            sandbox_id=str(body.get("sandbox_id", "")),
            kind=str(body.get("kind", "")),
            status=str(body.get("status", "")),
            restorable=bool(body.get("restorable", False)),
            origin=str(body.get("origin", "")),
            size_bytes=None if size is None else int(size),
            created_at=body.get("created_at"),
            location=tuple(str(w) for w in body.get("location") or ()),
            node_id=body.get("node_id"),
            error=body.get("error"),
            raw=body,
        )


@dataclass(frozen=True, slots=True)
class SandboxEvent:
    """One entry of a sandbox's timeline (``paused``, ``rolled_back``, ``recovered`` ...)."""

    id: int
    kind: str
    message: str
    at: str | None = None
    data: JSON = field(default_factory=dict)
    raw: JSON = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, body: JSON) -> SandboxEvent:
        return cls(
            id=int(body["id"]),
            kind=str(body.get("kind", "")),
            message=str(body.get("message", "")),
            at=body.get("at"),
            data=dict(body.get("data") or {}),
            raw=body,
        )


class Unset:
    """The default of an optional argument that was not given (``None`` means "turn it off")."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset()
