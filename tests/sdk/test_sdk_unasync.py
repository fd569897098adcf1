"""The sync SDK is generated from the async one, and the committed copy matches a fresh run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sync_sdk_is_up_to_date() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "unasync.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_generated_files_say_so() -> None:
    for path in (ROOT / "space" / "sdk" / "_sync").glob("*.py"):
        assert path.read_text().startswith("# Generated from space/sdk/_async/"), path


def test_public_surface_has_a_sync_twin_for_every_async_class() -> None:
    import space
    import space.sdk

    exported = set(space.sdk.__all__)
    assert all(hasattr(space.sdk, name) for name in exported)
    for name in exported:
        if name.startswith("Async"):
            assert name.removeprefix("Async") in exported, name
    assert space.Client is space.sdk.Client and space.AsyncClient is space.sdk.AsyncClient
