"""The node's GatewayProcess with a real gateway process: a running gateway is adopted after an
agent restart, and replaced when its code changed (an upgrade must not leave the old gateway
running); it runs as its own unprivileged user, answers on its control socket and serves DNS on a
high port, with everything it needs handed over (the test's directories are closed to that user,
like ``<data>`` is)."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import stat
from pathlib import Path

import pytest

from space.errors import Unavailable
from space.gateway.ca import CERT_FILE, KEY_FILE, ensure_ca
from space.node.network.gateway import (
    LOGFILE,
    PIDFILE,
    VERSIONFILE,
    GatewayProcess,
    default_python,
    gateway_user,
    proc_status,
)
from tests.gateway.harness import dns_query, free_port

pytestmark = pytest.mark.skipif(not default_python().exists(), reason="no gateway venv (make gateway)")

SANDBOX = "127.0.0.2"
PUBLIC = "203.0.113.7"  # a documentation address: the default policy does not block it


def make(tmp: Path, **kw: object) -> GatewayProcess:
    return GatewayProcess(tmp / "gw", tmp / "gw.sock", address="127.0.0.1", proxy_port=free_port(),
                          transparent_port=free_port(), dns_port=free_port(udp_too=True), ca_dir=tmp / "ca",
                          **kw)  # type: ignore[arg-type]


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


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the gateway user needs a root agent")
def test_runs_unprivileged_and_serves_dns_on_a_high_port(tmp_path: Path) -> None:
    user = gateway_user()
    assert user is not None, "no space-gw user: run `make setup` (scripts/setup-system.sh creates it)"
    control_group = grp.getgrnam("space").gr_gid if _group_exists("space") else user.gid
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"api.test": PUBLIC}))
    # The layout a root gateway left: its CA, root's; and links planted where the agent writes.
    ensure_ca(tmp_path / "ca")
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (tmp_path / "gw").mkdir()
    for name in (LOGFILE, PIDFILE):
        (tmp_path / "gw" / name).symlink_to(victim)
    gw = make(tmp_path, hosts_file=hosts, control_group=control_group)

    async def scenario() -> None:
        await gw.ensure()
        try:
            assert gw.pid is not None
            status = proc_status(gw.pid)
            assert status["Uid"].split() == [str(user.uid)] * 4
            assert status["Gid"].split() == [str(user.gid)] * 4
            assert status["Groups"] == ""
            assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == 0
            assert status["NoNewPrivs"] == "1"

            st = gw.control.stat()
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
            assert st.st_gid == control_group
            assert (await gw.client.call("stats"))["sandboxes"] == 0

            assert _owner_mode(gw.work_dir) == (user.uid, 0o700)
            assert _owner_mode(gw.work_dir / "journal") == (user.uid, 0o700)
            assert _owner_mode(gw.ca_dir) == (user.uid, 0o711)
            assert _owner_mode(gw.ca_dir / KEY_FILE) == (user.uid, 0o600)
            assert _owner_mode(gw.ca_dir / CERT_FILE)[1] == 0o644
            assert victim.read_text() == "untouched"
            assert not (gw.work_dir / LOGFILE).is_symlink() and not (gw.work_dir / PIDFILE).is_symlink()
            assert int((gw.work_dir / PIDFILE).read_text()) == gw.pid

            await gw.client.call("put", ip=SANDBOX, sandbox="sb-1", tenant="t1",
                                 policy={"allow": ["api.test"]}, secrets=[])
            server = ("127.0.0.1", gw.ports[2])
            assert gw.ports[2] >= 1024
            assert await asyncio.to_thread(dns_query, server, "api.test", src=SANDBOX) == ("NOERROR", [PUBLIC])
            assert await asyncio.to_thread(dns_query, server, "api.test", src=SANDBOX, tcp=True) == \
                ("NOERROR", [PUBLIC])
            assert (await asyncio.to_thread(dns_query, server, "api.test", src="127.0.0.9"))[0] == "REFUSED"
        finally:
            pid = gw.pid
            await gw.stop()
        assert pid is not None and not proc_status(pid)
        assert not gw.control.exists()

    asyncio.run(scenario())


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the gateway user needs a root agent")
def test_a_gateway_left_running_as_root_is_replaced_and_its_journal_kept(tmp_path: Path) -> None:
    user = gateway_user()
    assert user is not None, "no space-gw user: run `make setup` (scripts/setup-system.sh creates it)"
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"api.test": PUBLIC}))
    old = make(tmp_path, hosts_file=hosts, user=None)  # what an agent before the split ran

    async def scenario() -> None:
        await old.ensure()
        new = GatewayProcess(old.work_dir, old.control, address="127.0.0.1", proxy_port=old.ports[0],
                             transparent_port=old.ports[1], dns_port=old.ports[2], ca_dir=old.ca_dir,
                             hosts_file=hosts)
        try:
            assert old.pid is not None and proc_status(old.pid)["Uid"].split()[0] == "0"
            await old.client.call("put", ip=SANDBOX, sandbox="sb-1", tenant="t1",
                                  policy={"allow": ["api.test"]}, secrets=[])
            server = ("127.0.0.1", old.ports[2])
            assert (await asyncio.to_thread(dns_query, server, "evil.test", src=SANDBOX))[0] == "NXDOMAIN"
            before = (await old.client.call("audit", after=0))["records"]
            assert [r["action"] for r in before] == ["dns.deny"]
            await old.client.close()

            await new.ensure()
            assert new.pid is not None and new.pid != old.pid
            assert not proc_status(old.pid)
            assert proc_status(new.pid)["Uid"].split() == [str(user.uid)] * 4
            # What the root gateway journaled is still there, and the new one appends after it.
            assert (await new.client.call("audit", after=0))["records"] == before
            await new.client.call("put", ip=SANDBOX, sandbox="sb-1", tenant="t1",
                                  policy={"allow": ["api.test"]}, secrets=[])
            assert (await asyncio.to_thread(dns_query, server, "evil.test", src=SANDBOX))[0] == "NXDOMAIN"
            after = (await new.client.call("audit", after=0))["records"]
            assert [r["seq"] for r in after] == [before[0]["seq"], before[0]["seq"] + 1]
        finally:
            await new.stop()
            await old.stop()

    asyncio.run(scenario())


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the gateway user needs a root agent")
def test_a_privileged_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    gw = GatewayProcess(tmp_path / "gw", tmp_path / "gw.sock", address="127.0.0.1", proxy_port=free_port(),
                        transparent_port=free_port(), dns_port=53, ca_dir=tmp_path / "ca")
    assert gw.run_as is not None
    with pytest.raises(Unavailable, match=r"ports \[53\] need privileges"):
        asyncio.run(gw.ensure())
    assert not gw.work_dir.exists()


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _owner_mode(path: Path) -> tuple[int, int]:
    st = path.lstat()
    return st.st_uid, stat.S_IMODE(st.st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the gateway user needs a root agent")
def test_without_its_user_the_gateway_runs_as_the_agent_and_says_so() -> None:
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        assert gateway_user("space-no-such-user") is None
    assert [e["event"] for e in logs] == ["gateway.unprivileged_user_missing"]
    assert gateway_user(None) is None and gateway_user("root") is None
