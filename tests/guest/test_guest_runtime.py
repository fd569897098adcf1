"""The guest daemon as PID 1 of a real gVisor sandbox (runsc) on a btrfs snapshot of the template."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Iterator

import pytest

from space import errors
from space.node.sandboxes.guest_client import GuestConnection
from tests.e2e.harness import Server, base_template
from tests.guest.guest_harness import RunscGuest, connected, runtime_skip_reason
from tests.guest.test_guest_exec import cid, collect, run
from tests.waiting import await_for

pytestmark = pytest.mark.runtime
MiB = 1 << 20


@pytest.fixture(scope="module")
def sandbox(server: Server) -> Iterator[RunscGuest]:
    """The daemon straight under runsc (no node agent), on the shared server's real base template."""
    template = base_template(server)
    reason = runtime_skip_reason(template)
    if reason:
        pytest.skip(reason)
    g = RunscGuest(template, server.data_dir / "pool" / "tmp")
    try:
        g.start()
        yield g
    finally:
        g.stop()


@pytest.fixture
async def rconn(sandbox: RunscGuest) -> AsyncIterator[GuestConnection]:
    async with connected(sandbox.socket, timeout=30) as c:
        yield c


async def test_pid1_in_its_own_kernel(rconn: GuestConnection) -> None:
    assert rconn.hello["pid"] == 1
    _, out, _ = await run(rconn, argv=["uname", "-r"])
    assert out.strip() and out.strip().decode() != os.uname().release


async def test_exec_pty_signal_and_reaping(rconn: GuestConnection) -> None:
    evs, out, err = await run(rconn, shell="echo out; echo err >&2; exit 3")
    assert (out, err, evs[-1]["exit_code"]) == (b"out\n", b"err\n", 3)
    _, out, _ = await run(rconn, argv=["tty"], pty={"rows": 10, "cols": 20})
    assert out.startswith(b"/dev/pts/")
    c = cid()
    await rconn.request("exec", cmd=c, argv=["sleep", "60"])
    await rconn.request("signal", cmd=c, signal="TERM")
    evs, _, _ = await collect(rconn, c)
    assert evs[-1]["signal"] == 15
    # Orphans are reparented to PID 1 (us) and must not stay zombies.
    await run(rconn, shell="(sleep 0.05 &) ; exit 0")
    # One look at /proc per poll, from the test, until no zombie is left (with a deadline).
    probe = ("import os\n"
             "print(sum(1 for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/stat').read()"
             ".rsplit(')',1)[1].split()[0]=='Z'))")

    async def no_zombies() -> bool:
        _, out, _ = await run(rconn, argv=["python3", "-c", probe])
        return out.strip() == b"0"

    await await_for(no_zombies, 10, "the orphan to be reaped by PID 1")


async def test_files_and_bulk_output(rconn: GuestConnection) -> None:
    data = os.urandom(3 * MiB + 7)

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), MiB):
            yield data[i : i + MiB]

    entry = (await rconn.upload("fs.write", chunks(), path="/srv/t/blob", mode=0o640))["entry"]
    assert entry["size"] == len(data) and entry["mode"] == 0o640
    stream = rconn.stream("fs.read", path="/srv/t/blob")
    got = b"".join([p async for _, p in stream])
    assert got == data
    assert [e["name"] for e in (await rconn.request("fs.list", path="/srv/t"))["entries"]] == ["blob"]
    _, out, _ = await run(rconn, argv=["sha256sum", "/srv/t/blob"])
    assert out.split()[0].decode() == hashlib.sha256(data).hexdigest()
    await rconn.request("fs.remove", path="/srv/t", recursive=True)
    with pytest.raises(errors.NotFound):
        await rconn.request("fs.stat", path="/srv/t")
    with pytest.raises(errors.InvalidPath):
        await rconn.request("fs.stat", path="/../etc")
    _, out, _ = await run(rconn, argv=["head", "-c", str(20 * MiB), "/dev/zero"], buffer_bytes=MiB)
    assert len(out) == 20 * MiB
