"""The node agent's side of the egress gateway: keep the gateway process running, and talk to it.

The gateway (``python -m space.gateway``, run from its own virtualenv because mitmproxy pins
libraries the node agent needs newer) listens on the node's gateway address. Like a sandbox's shim
it lives in its own session, so a restarted node agent finds it still running, with its open
connections and the secrets it holds, and adopts it through its pid file and control socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import structlog

from space.errors import Unavailable

log = structlog.get_logger(__name__)

PIDFILE = "gateway.pid"
VERSIONFILE = "gateway.version"


def code_version() -> str:
    """A digest of the gateway's code: a running gateway of other code (an upgrade) is replaced."""
    import hashlib

    import space.gateway as pkg

    h = hashlib.sha256()
    for f in sorted(Path(pkg.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def default_python() -> Path:
    """The gateway's interpreter: ``.venv-gateway`` next to the node agent's own virtualenv."""
    override = os.environ.get("SPACE_GATEWAY_PYTHON")
    if override:
        return Path(override)
    return Path(sys.prefix).parent / ".venv-gateway" / "bin" / "python"


class GatewayClient:
    """One request, one answer, over the gateway's control socket (newline-delimited JSON)."""

    def __init__(self, socket_path: Path, *, timeout: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._lock = asyncio.Lock()
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def call(self, op: str, **args: Any) -> dict[str, Any]:
        async with self._lock:
            for attempt in (1, 2):  # a gateway restarted since the last call: reconnect once
                try:
                    async with asyncio.timeout(self.timeout):
                        reader, writer = await self._connection()
                        writer.write(json.dumps({"op": op, **args}).encode() + b"\n")
                        await writer.drain()
                        line = await reader.readline()
                    if not line:
                        raise ConnectionResetError("gateway closed the control connection")
                    reply: dict[str, Any] = json.loads(line)
                    if not reply.get("ok", False):
                        raise Unavailable(f"egress gateway refused {op}: {reply.get('error', reply)}")
                    return reply
                except (OSError, TimeoutError) as exc:
                    await self._drop()
                    if attempt == 2:
                        raise Unavailable(f"egress gateway unreachable: {exc}", op=op) from exc
        raise AssertionError("unreachable")

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._conn is None:
            self._conn = await asyncio.open_unix_connection(str(self.socket_path), limit=1 << 24)
        return self._conn

    async def _drop(self) -> None:
        if self._conn is not None:
            _, writer = self._conn
            self._conn = None
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def close(self) -> None:
        async with self._lock:
            await self._drop()


class GatewayProcess:
    """Start the node's gateway or adopt the one already running; restart it if it dies."""

    def __init__(self, work_dir: Path, control: Path, *, address: str, proxy_port: int,
                 transparent_port: int, dns_port: int, ca_dir: Path, python: Path | None = None,
                 hosts_file: Path | None = None, upstream_dns: str | None = None,
                 upstream_ca: Path | None = None) -> None:
        self.work_dir = work_dir
        self.control = control
        self.address = address
        self.ports = (proxy_port, transparent_port, dns_port)
        self.ca_dir = ca_dir
        self.python = python or default_python()
        self.hosts_file = hosts_file
        self.upstream_dns = upstream_dns
        self.upstream_ca = upstream_ca
        self.client = GatewayClient(control)
        self.pid: int | None = None

    def argv(self) -> list[str]:
        proxy, transparent, dns = self.ports
        argv = [str(self.python), "-m", "space.gateway",
                "--proxy", f"{self.address}:{proxy}",
                "--transparent", f"{self.address}:{transparent}",
                "--dns", f"{self.address}:{dns}",
                "--control", str(self.control),
                "--confdir", str(self.ca_dir),
                "--journal", str(self.work_dir / "journal")]
        if self.hosts_file is not None:
            argv += ["--hosts-file", str(self.hosts_file)]
        if self.upstream_dns:
            argv += ["--upstream-dns", self.upstream_dns]
        if self.upstream_ca is not None:
            argv += ["--upstream-ca", str(self.upstream_ca)]
        return argv

    def _alive_pid(self) -> int | None:
        try:
            pid = int((self.work_dir / PIDFILE).read_text())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return None
        try:  # a recycled pid is not our gateway
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return pid if b"space.gateway" in cmdline and str(self.control).encode() in cmdline else None

    async def ensure(self, *, timeout: float = 30.0) -> None:
        """The gateway is running and answers on its control socket."""
        pid = self._alive_pid()
        version = code_version()
        if pid is not None:
            try:
                running = (self.work_dir / VERSIONFILE).read_text().strip()
            except FileNotFoundError:
                running = ""
            if running != version:
                # Replacing it resets the sandboxes' open connections; their policies are given
                # back by the agent, their secrets by the control plane.
                log.warning("gateway.replaced", pid=pid, running=running, version=version)
                await self.stop()
            else:
                try:
                    await self.client.call("stats")
                    self.pid = pid
                    return
                except Unavailable:
                    log.warning("gateway.unresponsive", pid=pid)
                    await self.stop()
        if not self.python.exists():
            raise Unavailable(f"egress gateway interpreter {self.python} is missing: run `make setup`")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.control.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.control.unlink()
        with open(self.work_dir / "gateway.log", "ab") as logf:  # noqa: ASYNC230 -- handed to the child
            proc = subprocess.Popen(  # noqa: ASYNC220 -- a fork+exec, quicker inline
                self.argv(), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                start_new_session=True, cwd="/",
            )
        self.pid = proc.pid
        (self.work_dir / PIDFILE).write_text(str(proc.pid))
        (self.work_dir / VERSIONFILE).write_text(version)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if proc.poll() is not None:
                tail = (self.work_dir / "gateway.log").read_text(errors="replace")[-1500:]
                raise Unavailable(f"egress gateway exited at start (exit {proc.returncode}): {tail}")
            if self.control.exists():
                try:
                    await self.client.call("stats")
                    break
                except Unavailable:
                    pass
            if loop.time() > deadline:
                await self.stop()
                raise Unavailable(f"egress gateway did not come up within {timeout:g}s")
            await asyncio.sleep(0.05)
        log.info("gateway.started", pid=proc.pid, address=self.address)

    def alive(self) -> bool:
        return self._alive_pid() is not None

    async def stop(self) -> None:
        await self.client.close()
        pid = self._alive_pid() or self.pid
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while loop.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 -- WNOHANG never blocks
            await asyncio.sleep(0.05)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        (self.work_dir / PIDFILE).unlink(missing_ok=True)
        self.pid = None
