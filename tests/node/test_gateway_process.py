"""The node's GatewayProcess: a running gateway is adopted after an agent restart, and replaced when
its code changed (an upgrade must not leave the old gateway running)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from space.node.gateway import PIDFILE, VERSIONFILE, GatewayProcess, default_python
from tests.gateway.harness import free_port

pytestmark = pytest.mark.skipif(not default_python().exists(), reason="no gateway venv (make gateway)")


def make(tmp: Path) -> GatewayProcess:
    return GatewayProcess(tmp / "gw", tmp / "gw.sock", address="127.0.0.1", proxy_port=free_port(),
                          transparent_port=free_port(), dns_port=free_port(udp_too=True), ca_dir=tmp / "ca")


def test_adopted_when_unchanged_replaced_when_its_code_changed(tmp_path: Path) -> None:
    async def scenario() -> None:
        first = make(tmp_path)
        await first.ensure()
        pid = first.pid
        assert pid is not None
        # A restarted agent (a new GatewayProcess) adopts the same process.
        again = GatewayProcess(first.work_dir, first.control, address="127.0.0.1", proxy_port=first.ports[0],
                               transparent_port=first.ports[1], dns_port=first.ports[2], ca_dir=first.ca_dir)
        await again.ensure()
        assert again.pid == pid
        # The running one is of other code: it is replaced.
        (first.work_dir / VERSIONFILE).write_text("older-code")
        await again.ensure()
        try:
            assert again.pid not in (None, pid)
            assert int((first.work_dir / PIDFILE).read_text()) == again.pid
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
            await again.client.call("stats")
        finally:
            await again.stop()
            await first.client.close()

    asyncio.run(scenario())
