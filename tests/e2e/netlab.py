"""A stand-in network on this machine for the egress tests: upstream servers, a "private" host and a
"metadata" host, all inside one network namespace the test creates, so that nothing a test does,
even with a broken block, sends a packet off the machine.

The namespace gets the addresses the hosts imitate (169.254.169.254 as well) and the host routes
them into it for the duration of the test. A server there answers HTTP on port 80 and HTTPS on 443
(a certificate for the test names from a throwaway CA) and writes every request it sees, with the
address it arrived at, to a JSON-lines file: "the metadata host was never reached" is then a fact
the test reads, not an inference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.e2e.harness import REPO, wait_for
from tests.gateway.harness import make_pki

#: name → address inside the lab. ``api.test`` is the allowed upstream; the others are what a
#: sandbox must never reach unless its policy says so.
HOSTS = {
    "api.test": "10.250.1.10",
    "evil.test": "10.250.3.11",
    "db.internal": "10.250.2.10",
    "metadata.test": "169.254.169.254",
}
LINK_NET = ("10.250.0.1", "10.250.0.2")
ROUTES = ("10.250.1.0/24", "10.250.2.0/24", "10.250.3.0/24", "169.254.169.254/32")


@dataclasses.dataclass
class NetLab:
    root: Path
    netns: str
    host_if: str
    hits_file: Path
    hosts_file: Path
    upstream_ca: Path
    proc: subprocess.Popen[bytes] | None = None

    def hits(self, address: str | None = None) -> list[dict[str, Any]]:
        try:
            lines = self.hits_file.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = [json.loads(line) for line in lines if line.strip()]
        return [h for h in out if address is None or h["local"] == address]


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


@contextlib.contextmanager
def netlab(root: Path) -> Iterator[NetLab]:
    tag = secrets.token_hex(2)
    root.mkdir(parents=True, exist_ok=True)
    pki = make_pki(root / "pki")
    hosts_file = root / "hosts.json"
    hosts_file.write_text(json.dumps(HOSTS))
    lab = NetLab(root=root, netns=f"spacelab-{tag}", host_if=f"slab{tag}", hits_file=root / "hits.jsonl",
                 hosts_file=hosts_file, upstream_ca=pki.ca_cert)
    try:
        _ip("netns", "add", lab.netns)
        _ip("link", "add", lab.host_if, "type", "veth", "peer", "name", "eth0", "netns", lab.netns)
        _ip("addr", "add", f"{LINK_NET[0]}/30", "dev", lab.host_if)
        _ip("link", "set", lab.host_if, "up")
        _ip("-n", lab.netns, "addr", "add", f"{LINK_NET[1]}/30", "dev", "eth0")
        for addr in HOSTS.values():
            _ip("-n", lab.netns, "addr", "add", f"{addr}/32", "dev", "eth0")
        _ip("-n", lab.netns, "link", "set", "eth0", "up")
        _ip("-n", lab.netns, "link", "set", "lo", "up")
        _ip("-n", lab.netns, "route", "add", "default", "via", LINK_NET[0])
        for net in ROUTES:
            # Another test may route a stand-in address for a while (the egress probes' metadata
            # host, another lab): wait for it rather than fail.
            wait_for(lambda n=net: subprocess.run(["ip", "route", "show", n], capture_output=True, text=True)
                     .stdout.strip() == "", 600, f"the route to {net} to be free")
            _ip("route", "add", net, "via", LINK_NET[1], "dev", lab.host_if)
        log = open(root / "upstream.log", "ab")  # noqa: SIM115 -- owned by the child
        lab.proc = subprocess.Popen(
            ["ip", "netns", "exec", lab.netns, sys.executable, "-m", "tests.e2e.netlab_upstream",
             "--hits", str(lab.hits_file), "--cert", str(pki.leaf_cert), "--key", str(pki.leaf_key)],
            cwd=REPO, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        ready = root / "hits.jsonl"
        wait_for(lambda: ready.exists(), 30, "the lab's upstream server")
        yield lab
    finally:
        if lab.proc is not None and lab.proc.poll() is None:
            os.kill(lab.proc.pid, signal.SIGTERM)
            try:
                lab.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(lab.proc.pid, signal.SIGKILL)
                lab.proc.wait(timeout=10)
        for net in ROUTES:
            _ip("route", "del", net, "via", LINK_NET[1], check=False)
        _ip("netns", "del", lab.netns, check=False)
        _ip("link", "del", lab.host_if, check=False)
