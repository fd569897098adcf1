"""Finding 3: root never chowns or chmods a socket by a name the agent can change.

The node's socket directory (``/run/space/<h>/``) is the agent's: it can rename anything in it, at
any moment, and put a symlink in its place. Root makes two sockets there: the gateway's control
socket (bound, then given the agent's group and mode 0660) and the helper's own (in ``helper/``,
whose mode and group root sets when it starts). A chown or chmod by name follows whatever symlink
is there by then: each test plants one (for the gateway, at the moment between the bind and the
chown: the seam is ``os.chown``) aimed at a root-only file or directory, which must stay as it was.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from space.node.helper.launch import HelperProcess
from space.node.helper.verbs import HelperContext
from space.node.network import gateway as gateway_mod
from space.node.network.gateway import GatewayProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root makes these sockets")

AGENT_GID = 65534


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    v = tmp_path / "root-only"
    v.write_text("root's\n")
    v.chmod(0o600)
    yield v
    st = v.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600), \
        f"root changed {v}: {st.st_uid}:{st.st_gid} {oct(stat.S_IMODE(st.st_mode))}"


def test_the_gateway_control_socket_swapped_for_a_symlink_before_its_chown(
        tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    channel = tmp_path / "channel"  # the agent's directory
    channel.mkdir()
    control = channel / "gateway.sock"
    gw = GatewayProcess(tmp_path / "gw", control, address="127.0.0.1", proxy_port=1, transparent_port=2,
                        dns_port=3, ca_dir=tmp_path / "ca", user=None, control_group=AGENT_GID)
    real_chown = os.chown

    def agent_wins_the_race(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.lexists(control) and not os.path.islink(control):
            os.rename(control, channel / "moved.sock")
            os.symlink(victim, control)
        real_chown(path, *args, **kwargs)

    monkeypatch.setattr(os, "chown", agent_wins_the_race)
    sock = gw._bind_control()
    try:
        st = control.lstat()
        assert stat.S_ISSOCK(st.st_mode) and st.st_gid == AGENT_GID and stat.S_IMODE(st.st_mode) == 0o660
    finally:
        sock.close()
    assert gateway_mod  # the module under test (its os.chown is the one patched)


def test_a_symlink_planted_as_the_helpers_socket_dir_is_not_followed(tmp_path: Path, victim: Path) -> None:
    channel = tmp_path / "channel"  # left by the agent's previous run
    channel.mkdir()
    target = tmp_path / "root-dir"
    target.mkdir(mode=0o700)
    os.symlink(target, channel / "helper")
    ctx = HelperContext(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    helper = HelperProcess(ctx, channel / "helper" / "helper.sock", agent_uid=AGENT_GID, socket_gid=AGENT_GID)

    import asyncio

    async def start_and_stop() -> None:
        await helper.start()
        await helper.stop()

    asyncio.run(start_and_stop())
    st = target.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o700), \
        f"root changed the symlink's target: {st.st_gid} {oct(stat.S_IMODE(st.st_mode))}"
    assert list(target.iterdir()) == [], "the helper's socket landed in the symlink's target"
    d = (channel / "helper").lstat()
    assert stat.S_ISDIR(d.st_mode) and (d.st_uid, d.st_gid, stat.S_IMODE(d.st_mode)) == (0, AGENT_GID, 0o750)
