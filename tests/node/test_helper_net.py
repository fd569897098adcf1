"""The helper's network verbs, in-process as root, against the host's real netns/nftables."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from space.errors import InvalidRequest
from space.node.helper.backend import InProcess
from space.node.helper.verbs import HelperContext
from space.node.helper.verbs_net import NETNS_DIR


def sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True).stdout


@pytest.fixture
async def priv(tmp_path: Path) -> AsyncIterator[InProcess]:
    p = InProcess(HelperContext(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache",
                                gateway_ports=(13128, 13129, 13053)))
    (tmp_path / "data").mkdir()
    try:
        yield p
    finally:
        await p.call("net.teardown")


async def test_setup_create_remove_teardown(priv: InProcess) -> None:
    node = await priv.call("net.setup")
    assert node["ports"] == {"proxy": 13128, "transparent": 13129, "dns": 13053}
    table = f"space_{node['tag']}"
    ruleset = sh("nft", "list", "table", "inet", table)
    # DNS to any address is sent to the gateway's unprivileged DNS port.
    assert f"udp dport 53 dnat ip to {node['gateway_ip']}:13053" in ruleset
    assert f"{node['gateway_ip']}/32" in sh("ip", "-4", "addr", "show", "dev", "lo")
    assert await priv.call("net.setup") == node  # idempotent, same slot

    s = await priv.call("net.create", {"index": 7})
    assert s["netns"] == f"{node['ns_prefix']}7" and (NETNS_DIR / s["netns"]).exists()
    assert f"{s['sandbox_ip']}/30" in sh("ip", "-n", s["netns"], "-4", "addr", "show", "dev", "eth0")
    assert await priv.call("net.create", {"index": 7}) == s  # idempotent
    elements = sh("nft", "list", "set", "inet", table, "sandbox_src")
    assert f"\"{s['host_if']}\" . {s['sandbox_ip']}" in elements

    # A replaced table loses its elements; admit puts them back.
    await priv.call("net.setup")
    assert s["sandbox_ip"] not in sh("nft", "list", "set", "inet", table, "sandbox_src")
    await priv.call("net.admit", {"indexes": [7]})
    assert s["sandbox_ip"] in sh("nft", "list", "set", "inet", table, "sandbox_src")

    sh("ip", "-n", s["netns"], "addr", "flush", "dev", "eth0")  # what runsc does to the link
    await priv.call("net.prepare", {"index": 7})
    assert f"{s['sandbox_ip']}/30" in sh("ip", "-n", s["netns"], "-4", "addr", "show", "dev", "eth0")

    await priv.call("net.remove", {"index": 7})
    await priv.call("net.remove", {"index": 7})  # idempotent
    assert not (NETNS_DIR / s["netns"]).exists()
    assert s["host_if"] not in sh("ip", "-o", "link")

    await priv.call("net.create", {"index": 8})
    removed = (await priv.call("net.teardown"))["removed"]
    assert removed == [f"{node['ns_prefix']}8"]
    assert sh("nft", "list", "table", "inet", table) == ""
    assert f"{node['gateway_ip']}/32" not in sh("ip", "-4", "addr", "show", "dev", "lo")


@pytest.mark.parametrize("verb,args", [
    ("net.create", {"index": 0}),
    ("net.create", {"index": 1024}),
    ("net.create", {"index": "1"}),
    ("net.create", {"index": True}),
    ("net.create", {}),
    ("net.create", {"index": 1, "netns": "/proc/1/ns/net"}),
    ("net.admit", {"indexes": [1, -1]}),
    ("net.setup", {"table": "filter"}),
    ("net.run", {}),
])
async def test_bad_arguments_are_refused(priv: InProcess, verb: str, args: dict[str, Any]) -> None:
    before = sh("ip", "-o", "link")
    with pytest.raises(InvalidRequest):
        await priv.call(verb, args)
    assert sh("ip", "-o", "link") == before


async def test_verbs_before_setup_are_a_conflict(priv: InProcess, tmp_path: Path) -> None:
    from space.errors import Conflict
    with pytest.raises(Conflict, match=r"net\.setup first"):
        await priv.call("net.create", {"index": 1})
    assert not (tmp_path / "data" / "network.json").exists()
    await priv.call("net.setup")
    assert json.loads((tmp_path / "data" / "network.json").read_text())["slot"]


# In the namespace, a plain Linux process stands in for a sandbox's server (the rules see the same
# packets from gVisor's netstack): it prints "ready", then echoes what one connection sends.
_ECHO_ONCE = """
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen()
print("ready", flush=True)
conn, _ = srv.accept()
conn.sendall(conn.recv(100))
"""

_CONNECT = """
import socket, sys
s = socket.socket()
s.settimeout(10)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""


async def test_host_opened_connections_get_replies_sandbox_opened_ones_do_not(priv: InProcess) -> None:
    import asyncio
    import socket

    node = await priv.call("net.setup")
    s = await priv.call("net.create", {"index": 3})
    server = await asyncio.create_subprocess_exec("ip", "netns", "exec", s["netns"], "python3", "-c", _ECHO_ONCE,
                                                  "8000", stdout=subprocess.PIPE)
    listener = socket.socket()
    try:
        assert server.stdout is not None
        assert (await asyncio.wait_for(server.stdout.readline(), 30)).strip() == b"ready"
        # The host opens a connection into the sandbox: the replies come back (conntrack: reply
        # direction of the host's connection).
        with socket.create_connection((s["sandbox_ip"], 8000), timeout=10) as c:
            c.sendall(b"ping")
            assert c.recv(100) == b"ping"
            # A closed port answers at once with a reset, which gets through as well.
            try:
                socket.create_connection((s["sandbox_ip"], 8001), timeout=10).close()
                raise AssertionError("a closed port in the sandbox accepted a connection")
            except ConnectionRefusedError:
                pass
            # While the host's connection is open, the sandbox still cannot open one to a host
            # port that is not the gateway's: refused by the input chain, never accepted.
            listener.bind((node["gateway_ip"], 0))
            listener.listen()
            listener.setblocking(False)
            out = sh("ip", "netns", "exec", s["netns"], "python3", "-c", _CONNECT,
                     node["gateway_ip"], str(listener.getsockname()[1]))
            assert out.strip() == "ConnectionRefusedError"
            try:
                listener.accept()
                raise AssertionError("a sandbox reached a host port")
            except BlockingIOError:
                pass
    finally:
        listener.close()
        if server.returncode is None:
            server.kill()
        await server.wait()


async def test_the_gateways_user_cannot_open_a_connection_to_a_sandbox(tmp_path: Path) -> None:
    """The second wall behind the gateway's fence (issue 13, finding 1): the gateway runs in the host's
    namespace, where replies to host-opened connections into a sandbox are accepted; its user may
    open none (the port proxy, another user, still may)."""
    import asyncio
    import pwd

    from space.node.helper.verbs import GatewayConfig

    try:
        gw = pwd.getpwnam("space-gw")
    except KeyError:
        pytest.skip("no space-gw user (make setup)")
    (tmp_path / "data").mkdir()
    p = InProcess(HelperContext(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache",
                                gateway_ports=(13128, 13129, 13053),
                                gateway=GatewayConfig(control=tmp_path / "gw.sock", ca_dir=tmp_path / "ca")))
    try:
        await p.call("net.setup")
        s = await p.call("net.create", {"index": 5})
        server = await asyncio.create_subprocess_exec("ip", "netns", "exec", s["netns"], "python3", "-c", _ECHO_ONCE,
                                                      "8000", stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None
            assert (await asyncio.wait_for(server.stdout.readline(), 30)).strip() == b"ready"
            as_gateway = await asyncio.to_thread(
                subprocess.run, ["setpriv", f"--reuid={gw.pw_uid}", f"--regid={gw.pw_gid}", "--clear-groups",
                                 "python3", "-c", _CONNECT, s["sandbox_ip"], "8000"],
                capture_output=True, text=True, timeout=60)
            assert as_gateway.stdout.strip() == "ConnectionRefusedError", as_gateway
            # Root (the port proxy's side of the host) still gets in, and the server echoes.
            out = sh("python3", "-c", _CONNECT, s["sandbox_ip"], "8000")
            assert out.strip() == "connected", out
        finally:
            if server.returncode is None:
                server.kill()
            await server.wait()
    finally:
        await p.call("net.teardown")


async def test_the_sandbox_network_is_the_deployments_choice(tmp_path: Path) -> None:
    """--sandbox-network: the node's /20 slot, its gateway and each sandbox's address come from the
    range given (a cluster whose VPC or pods use 10.208.0.0/12 picks another); changing it while
    sandboxes use the old slot is refused, with nothing there it moves."""
    import ipaddress

    data = tmp_path / "data"
    data.mkdir()
    custom = ipaddress.IPv4Network("172.29.0.0/16")
    p = InProcess(HelperContext(data_dir=data, cache_dir=tmp_path / "cache", gateway_ports=(13128, 13129, 13053),
                                sandbox_network=custom))
    try:
        node = await p.call("net.setup")
        slot = ipaddress.IPv4Network(node["slot"])
        assert slot.subnet_of(custom) and slot.prefixlen == 20, node
        assert ipaddress.IPv4Address(node["gateway_ip"]) in slot
        s = await p.call("net.create", {"index": 3})
        assert ipaddress.IPv4Address(s["sandbox_ip"]) in slot

        moved = InProcess(HelperContext(data_dir=data, cache_dir=tmp_path / "cache",
                                        gateway_ports=(13128, 13129, 13053),
                                        sandbox_network=ipaddress.IPv4Network("100.72.0.0/16")))
        with pytest.raises(Exception, match="drain the node before changing it"):
            await moved.call("net.setup")
        await p.call("net.remove", {"index": 3})
        again = await moved.call("net.setup")
        assert ipaddress.IPv4Network(again["slot"]).subnet_of(ipaddress.IPv4Network("100.72.0.0/16")), again
        await moved.call("net.teardown")
    finally:
        await p.call("net.teardown")
