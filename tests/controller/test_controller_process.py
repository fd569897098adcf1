"""``space controller`` as a process: SIGTERM (what Kubernetes sends a pod, and podman a container)
stops it in order -- it says so and exits 0 -- also as a container's first process, where the
kernel gives SIGTERM no default action (tests/deploy/test_containers.py runs that case).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.e2e.harness import server_environment
from tests.store.conftest import reset_postgres
from tests.waiting import wait_for

pytestmark = pytest.mark.postgres


def test_a_controller_stops_in_order_at_sigterm(postgres_url: str, tmp_path: Path) -> None:
    anyio.run(reset_postgres, postgres_url)
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "space.cli.main", "keys", "generate", str(keys)],
                   check=True, capture_output=True, timeout=60)
    log = tmp_path / "controller.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "space.cli.main", "controller", "--database-url", postgres_url,
             "--object-store-url", f"file://{tmp_path / 'objects'}", "--keys-dir", str(keys)],
            stdout=out, stderr=out, env=server_environment({}))
    try:
        wait_for(lambda: b'"leader.elected"' in log.read_bytes() or proc.poll() is not None, 60,
                 "the controller to lead")
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert b'"controller.stopping"' in log.read_bytes()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
