"""The node's control socket: a unix socket (mode 0660), newline-delimited JSON, one reply per request.

The socket is either bound here (``--control PATH``, optionally ``--control-group GID``) or, when the
gateway runs as its own unprivileged user, bound by the node agent in a directory only the agent
may enter and handed over already listening (``--control-fd N``): the gateway then needs no access
to that directory, and it never decides who may connect.

    {"op":"put","ip","sandbox","tenant","policy","tenant_policy","ceiling","secrets":[...]}
                                                                    → {"ok":true,"reset":n}
    {"op":"delete","ip"}                                            → {"ok":true,"existed":bool,"reset":n}
    {"op":"list"}                                                   → {"ok":true,"sandboxes":[...]} (no values)
    {"op":"reset","ip"}                                             → {"ok":true,"reset":n}
    {"op":"audit","after":N,"limit":M}                              → {"ok":true,"records":[...],"last":N}
    {"op":"ack","upto":N}                                           → {"ok":true,"acked":N}
    {"op":"stats"}                                                  → {"ok":true, counters...}

``put``: ``policy`` is the sandbox's own, ``tenant_policy`` its tenant's default (both must allow),
``ceiling`` the tenant's private ranges (null: this gateway's ``--private-ceiling``; never wider than
it, whatever is sent). The fence (``--sandbox-network``, the node's own addresses, loopback,
link-local, metadata) holds whatever a ``put`` says.

``audit``'s ``last`` is the seq of the last record returned (pass it as the next ``after``), or,
when none is, the larger of ``after`` and the ack watermark. ``put`` also resets the sandbox's open
tunnels its new policy denies (``"reset": n``); ``delete`` resets all of them.

Errors: ``{"ok":false,"error":{"code","message"}}`` with the codes of :mod:`space.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from space.errors import InvalidRequest, NotFound, SpaceError
from space.gateway.addon import Gateway
from space.gateway.conns import Connections
from space.gateway.dns import DnsServer
from space.gateway.journal import Journal
from space.gateway.registry import Registry, normalize_ip
from space.gateway.stats import Stats

log = logging.getLogger("space.gateway")

MAX_LINE = 4 << 20
MAX_AUDIT = 10_000


class ControlServer:
    def __init__(self, registry: Registry, journal: Journal, stats: Stats, conns: Connections,
                 gateway: Gateway, dns: DnsServer | None) -> None:
        self.registry = registry
        self.journal = journal
        self.stats = stats
        self.conns = conns
        self.gateway = gateway
        self.dns = dns
        self._server: asyncio.Server | None = None
        self._ops: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "put": self.op_put, "delete": self.op_delete, "list": self.op_list, "reset": self.op_reset,
            "audit": self.op_audit, "ack": self.op_ack, "stats": self.op_stats,
        }

    async def start(self, path: str | None = None, *, sock: socket.socket | None = None,
                    group: int | None = None) -> None:
        """Serve on a listening unix socket handed over (``sock``), or bind ``path``: mode 0660,
        group ``group`` (default: this process's), so the node agent's group may connect."""
        if sock is not None:
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_LINE)
            return
        if path is None:
            raise ValueError("a control socket path or a listening socket is required")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        old = os.umask(0o177)  # never world- or group-accessible before its group is set
        try:
            self._server = await asyncio.start_unix_server(self._serve, path, limit=MAX_LINE)
        finally:
            os.umask(old)
        if group is not None:
            os.chown(path, -1, group)
        os.chmod(path, 0o660)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                reply = await self.handle_line(line)
                writer.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    async def handle_line(self, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise InvalidRequest("a request is a JSON object")
            op = self._ops.get(str(req.get("op")))
            if op is None:
                raise InvalidRequest(f"unknown op {req.get('op')!r}; ops: {', '.join(self._ops)}")
            return {"ok": True, **await op(req)}
        except ValueError as e:
            return _error(InvalidRequest(f"invalid JSON: {e}"))
        except SpaceError as e:
            return _error(e)
        except Exception as e:  # a bug must not take the control socket down
            log.exception("control request failed")
            return {"ok": False, "error": {"code": "internal", "message": str(e)}}

    # ---- ops ---------------------------------------------------------------------------------------

    async def op_put(self, req: dict[str, Any]) -> dict[str, Any]:
        entry = self.registry.put(req)
        return {"reset": self.gateway.recheck(entry)}

    async def op_delete(self, req: dict[str, Any]) -> dict[str, Any]:
        ip = _ip(req)
        existed = self.registry.delete(ip) is not None
        return {"existed": existed, "reset": await self._reset(ip)}

    async def op_list(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"sandboxes": [{**e.public(), "connections": self.conns.count(e.ip)}
                              for e in self.registry.entries()]}

    async def op_reset(self, req: dict[str, Any]) -> dict[str, Any]:
        ip = _ip(req)
        if self.registry.get(ip) is None and not self.conns.count(ip):
            raise NotFound(f"no sandbox at {ip}", ip=ip)
        return {"reset": await self._reset(ip)}

    async def _reset(self, ip: str) -> int:
        n = await self.conns.reset(ip)
        if self.dns is not None:
            n += self.dns.reset(ip)
        return n

    async def op_audit(self, req: dict[str, Any]) -> dict[str, Any]:
        after, limit = _int(req, "after", 0), _int(req, "limit", 1000)
        if limit < 1:
            raise InvalidRequest("'limit' must be positive")
        records, last = self.journal.read(after, min(limit, MAX_AUDIT))
        return {"records": records, "last": last}

    async def op_ack(self, req: dict[str, Any]) -> dict[str, Any]:
        if "upto" not in req:
            raise InvalidRequest("'upto' is required")
        return {"acked": self.journal.ack(_int(req, "upto", 0))}

    async def op_stats(self, req: dict[str, Any]) -> dict[str, Any]:
        return {**self.stats.as_dict(), "sandboxes": len(self.registry.entries()),
                "open_connections": self.conns.count(), "audit_last": self.journal.last,
                "audit_acked": self.journal.acked}


def _ip(req: dict[str, Any]) -> str:
    try:
        return normalize_ip(str(req.get("ip", "")))
    except ValueError:
        raise InvalidRequest(f"invalid ip {req.get('ip')!r}") from None


def _int(req: dict[str, Any], key: str, default: int) -> int:
    v = req.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequest(f"'{key}' must be an integer")
    return v


def _error(e: SpaceError) -> dict[str, Any]:
    return {"ok": False, "error": e.to_wire()["error"]}
