"""Helpers for tests that need real btrfs pools: small sparse loop files, always torn down.

Pools are opened and torn down from a private event loop in a helper thread, so one pool can
serve a whole module of async tests (a :class:`~space.node.storage.pool.Pool` holds no loop state).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from space.node.storage.pool import Pool

T = TypeVar("T")

STORAGE_TOOLS = ("btrfs", "mkfs.btrfs", "losetup", "mount", "umount", "blkid")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a fresh event loop in its own thread (usable from sync
    fixtures whatever loop the test runner has)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="run_async")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def btrfs_unavailable() -> str | None:
    """Why real btrfs pools cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (losetup, mount, btrfs)"
    missing = [t for t in STORAGE_TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (install btrfs-progs / util-linux)"
    with open("/proc/filesystems") as f:
        if "btrfs" not in f.read() and subprocess.run(["modprobe", "btrfs"], check=False).returncode:
            return "the kernel has no btrfs support"
    return None


def loop_devices_of(image: Path) -> list[str]:
    """Loop devices attached to ``image`` (``losetup -j``)."""
    out = subprocess.run(["losetup", "-j", str(image), "-n", "-O", "NAME"],
                         capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


class PoolFactory:
    """Opens loop-file pools under ``base``; :meth:`close` tears every one down and checks that no
    loop device stays attached, then deletes the pool files."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.data_dirs: list[Path] = []

    def __call__(self, name: str = "pool", *, size_gb: int = 4) -> Pool:
        data_dir = self.base / name
        if data_dir not in self.data_dirs:
            self.data_dirs.append(data_dir)
        return run_async(Pool.open(data_dir, size_gb=size_gb))

    def close(self) -> None:
        leaked: dict[str, list[str]] = {}
        errors: list[BaseException] = []
        for data_dir in reversed(self.data_dirs):
            try:
                if (data_dir / "pool.img").exists() or (data_dir / "pool").exists():
                    # Re-open first: adopts whatever state a test left (mounted, detached, ...).
                    run_async(_reopen_and_teardown(data_dir))
            except BaseException as exc:
                errors.append(exc)
            image = data_dir / "pool.img"
            if image.exists():
                devices = loop_devices_of(image)
                if devices:
                    leaked[str(image)] = devices
            if not errors and not leaked:
                shutil.rmtree(data_dir, ignore_errors=True)
        if errors:
            raise errors[0]
        assert not leaked, f"loop devices still attached after teardown: {leaked}"


async def _reopen_and_teardown(data_dir: Path) -> None:
    pool = await Pool.open(data_dir)
    await pool.teardown()
