"""Transparent mode (nftables redirect + SO_ORIGINAL_DST), in a private network namespace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.harness import GATEWAY_PY

SCENARIO = Path(__file__).with_name("transparent_scenario.py")


def test_transparent_mode(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("unshare"):
        pytest.skip("needs root, nft and unshare (a private network namespace with NAT rules)")
    if not GATEWAY_PY.exists():
        pytest.skip("the gateway venv is missing: run `make gateway`")
    proc = subprocess.run(["unshare", "-n", "--", sys.executable, str(SCENARIO), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["http_allowed"] == 200, out["log"]
    status, body = out["http_denied"]
    assert status == 403 and body.startswith("SPACE egress policy denied evil.test:")
    assert out["tls_passthrough"]["status"] == 200
    assert out["tls_passthrough"]["issuer"] == "upstream test CA"
    assert "authorization" not in out["tls_passthrough"]["headers"]
    assert out["tls_intercepted"]["issuer"] == "SPACE egress CA"
    # Injected (the upstream echoed a token of exactly its length), and redacted on the way back.
    assert out["tls_intercepted"]["headers"]["authorization"] == "*" * len("Bearer sk-transparent-0123456789")
    assert "error" in out["tls_denied"]  # reset during the handshake
    assert out["tls_sni_elsewhere"]["status"] == 200
    acts = [tuple(a) for a in out["audit"]]
    assert sum(1 for a in acts if a[0] == "egress.deny" and a[1].startswith("evil.test:")) == 2
    assert any(a[0] == "egress.allow" and a[1].startswith("api.test:") and a[2] == "transparent" for a in acts)
    assert any(a[0] == "secret.inject" for a in acts)
