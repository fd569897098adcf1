"""startup.start_and_wait against the real guest daemon (a host child process behind the real shim).

Aspects: a start command whose port comes up makes the wait return, and keeps running; env and
workdir of the template apply to it; a start command that fails before it is ready fails the
wait with its exit and log tail; a readiness check that never passes fails with the deadline; a
spec without a start command does nothing. Everything runs on the host's loopback only.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from space.errors import RuntimeFailure
from space.node.sandboxes.guest_client import GuestConnection
from space.node.sandboxes.startup import start_and_wait
from tests.e2e.harness import free_port
from tests.guest.fixtures import anyio_backend, conn, guest

pytestmark = pytest.mark.anyio

__all__ = ["anyio_backend", "conn", "guest"]  # fixtures


async def test_port_readiness_returns_once_the_server_listens(conn: GuestConnection, tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "index.html").write_text("ok\n")
    spec = {"start": {"cmd": f"sleep 0.5; exec python3 -m http.server {port} --bind 127.0.0.1",
                      "ready": {"port": port, "timeout_s": 20}},
            "workdir": str(tmp_path)}
    await start_and_wait(conn, spec, log_path=str(tmp_path / "start.log"))
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # listening, and still running after the wait
    running = [c for c in (await conn.request("list"))["commands"] if c["id"].startswith("start-")]
    assert [c["state"] for c in running] == ["running"]


async def test_env_and_workdir_apply_and_a_ready_cmd_counts(conn: GuestConnection, tmp_path: Path) -> None:
    spec = {"env": {"GREETING": "hi"}, "workdir": str(tmp_path),
            "start": {"cmd": 'echo "$GREETING $(pwd)" > out.txt; exec sleep 30',
                      "ready": {"cmd": "test -s out.txt", "timeout_s": 20}}}
    await start_and_wait(conn, spec, log_path=str(tmp_path / "start.log"))
    assert (tmp_path / "out.txt").read_text() == f"hi {tmp_path}\n"


async def test_a_start_command_that_fails_fails_the_wait_with_its_log(conn: GuestConnection,
                                                                      tmp_path: Path) -> None:
    spec = {"start": {"cmd": "echo boom-before-exit; exit 3", "ready": {"port": free_port(), "timeout_s": 20}}}
    with pytest.raises(RuntimeFailure) as exc:
        await start_and_wait(conn, spec, log_path=str(tmp_path / "start.log"))
    assert "exit 3" in exc.value.message and "boom-before-exit" in exc.value.message
    assert "boom-before-exit" in exc.value.details["log"]


async def test_a_check_that_never_passes_fails_at_the_deadline(conn: GuestConnection, tmp_path: Path) -> None:
    spec = {"start": {"cmd": "echo waiting; exec sleep 30", "ready": {"cmd": "false"}}}
    with pytest.raises(RuntimeFailure, match=r"not ready within 1s .*'false' succeeding.*waiting"):
        await start_and_wait(conn, spec, timeout=1, log_path=str(tmp_path / "start.log"))


async def test_no_start_command_is_a_no_op(conn: GuestConnection, tmp_path: Path) -> None:
    await start_and_wait(conn, {"env": {"A": "b"}}, log_path=str(tmp_path / "start.log"))
    assert (await conn.request("list"))["commands"] == []
    assert not (tmp_path / "start.log").exists()
