"""Guest channel numbers: daemon boot, request round trip, bulk stdout throughput.

    .venv/bin/python bench/guest_bench.py [--no-runsc]

Runs the guest daemon behind the real shim with the real asyncio client, on the host (a child
process) and, when root with runsc and btrfs, as PID 1 of a gVisor sandbox. Prints medians; no asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from space.node.sandboxes.guest_client import GuestConnection
from tests.e2e.harness import Server, base_template, free_port
from tests.guest.guest_harness import HostGuest, RunscGuest, runtime_skip_reason

BULK = 200 * 1024 * 1024


async def rtt_us(conn: GuestConnection, op: str = "hello", n: int = 200, **args: Any) -> float:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        await conn.request(op, **args)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


async def throughput_mbs(conn: GuestConnection, nbytes: int = BULK, argv: list[str] | None = None) -> float:
    """MB/s of ``argv``'s stdout (``nbytes`` of it; default ``head -c nbytes /dev/zero``) off the channel."""
    t = time.perf_counter()
    cmd = f"bulk-{time.monotonic_ns()}"
    await conn.request("exec", cmd=cmd, argv=argv or ["head", "-c", str(nbytes), "/dev/zero"])
    got = 0
    async for _, payload in conn.events(cmd):
        got += len(payload)
    elapsed = time.perf_counter() - t
    assert got == nbytes, got
    return nbytes / elapsed / 1e6


async def channel(kind: str, guest: HostGuest | RunscGuest) -> None:
    conn = await GuestConnection.connect(guest.socket, timeout=30)
    try:
        rtt = await rtt_us(conn)
        stat = await rtt_us(conn, "fs.stat", path="/")
        mbs = await throughput_mbs(conn)
        print(f"{kind:6s} boot_ms={conn.hello['boot_ms']:.1f}  hello RTT median={rtt:.0f} us  "
              f"(fs.stat, on the worker pool: {stat:.0f} us)  head -c 200M stdout throughput={mbs:.0f} MB/s")
    finally:
        await conn.close()


async def boots(template: Path, scratch: Path, n: int = 5) -> None:
    boot, ready = [], []
    for _ in range(n):
        g = RunscGuest(template, scratch)
        try:
            t = time.perf_counter()
            g.start()
            conn = await GuestConnection.connect(g.socket, timeout=30)
            ready.append((time.perf_counter() - t) * 1000)
            boot.append(conn.hello["boot_ms"])
            await conn.close()
        finally:
            g.stop()
    print(f"runsc  guest boot_ms median of {n}: {statistics.median(boot):.1f} "
          f"(all: {', '.join(f'{b:.0f}' for b in boot)}); "
          f"runsc run -> hello answered: {statistics.median(ready):.0f} ms")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-runsc", action="store_true")
    args = ap.parse_args()
    g = HostGuest().start()
    try:
        await channel("host", g)
    finally:
        g.stop()
    reason = runtime_skip_reason()
    if args.no_runsc or reason:
        print(f"runsc: skipped ({reason or '--no-runsc'})")
        return
    # A scratch `space serve` provides a pool with the real base template to snapshot.
    with tempfile.TemporaryDirectory(prefix="space-guest-bench-") as tmp:
        srv = Server(data_dir=Path(tmp) / "data", port=free_port(), log_path=Path(tmp) / "serve.log")
        try:
            srv.start()
            template, scratch = base_template(srv), srv.data_dir / "pool" / "tmp"
            await boots(template, scratch)
            r = RunscGuest(template, scratch).start()
            try:
                await channel("runsc", r)
            finally:
                r.stop()
        finally:
            srv.teardown()


if __name__ == "__main__":
    asyncio.run(main())
