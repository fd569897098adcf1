"""The lifecycle commands against a real server (real runsc and btrfs), run in-process.

Aspects: ``sandbox create`` with idle and lifetime flags shows them in ``sandbox get --json``;
pause and resume round-trip and a second pause is ``error: invalid_state`` with exit 1;
``snapshot create`` prints the id last (disk, and full with ``--memory``); ``snapshot list`` as a
table and as JSON; ``sandbox rollback`` brings a deleted file back; ``snapshot delete``;
``sandbox events``; ``sandbox fork --count 2`` prints two running sandboxes' ids last;
``sandbox suspend`` then ``restore --node``. Data goes to stdout, progress and notes to stderr.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from space.cli.main import app
from tests.e2e.harness import Server

pytestmark = pytest.mark.runtime

Cli = Callable[..., Result]


@pytest.fixture
def cli(server: Server) -> Cli:
    runner = CliRunner()
    env = {"SPACE_URL": server.url, "SPACE_API_KEY": server.admin_key}

    def run(*args: str, check: bool = True) -> Result:
        result = runner.invoke(app, list(args), env=env, catch_exceptions=False)
        if check:
            assert result.exit_code == 0, f"space {' '.join(args)} -> {result.exit_code}\n{result.stderr}"
        return result

    return run


@pytest.fixture
def sandbox(cli: Cli) -> Iterator[str]:
    sid = cli("sandbox", "create", "--template", "base", "--idle-pause", "600", "--idle-suspend", "7200",
              "--lifetime", "3600").stdout.strip()
    yield sid
    # Forks too, also those a failed fork left behind (failed sandboxes are deleted all the same).
    children = [s["id"] for s in json.loads(cli("sandbox", "list", "--json").stdout) if s["parent_id"] == sid]
    for child in children:
        cli("sandbox", "delete", child, check=False)
    cli("sandbox", "delete", sid)


def get(cli: Cli, sid: str) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(cli("sandbox", "get", sid, "--json").stdout)
    return info


def sh(cli: Cli, sid: str, script: str) -> str:
    return str(cli("exec", sid, "--", "sh", "-c", script).stdout)


def test_pause_snapshots_rollback_and_events(cli: Cli, sandbox: str) -> None:
    sid = sandbox
    info = get(cli, sid)
    assert (info["idle_pause_s"], info["idle_suspend_s"]) == (600, 7200) and info["expires_at"]

    paused = cli("sandbox", "pause", sid)
    assert paused.stdout == "" and f"{sid} paused" in paused.stderr
    assert get(cli, sid)["state"] == "paused"
    again = cli("sandbox", "pause", sid, check=False)
    assert again.exit_code == 1 and again.stdout == ""
    assert again.stderr.startswith("error: invalid_state: cannot pause a sandbox that is paused")
    cli("sandbox", "resume", sid)
    assert get(cli, sid)["state"] == "running"

    sh(cli, sid, "mkdir -p /home/user/project && echo precious > /home/user/project/a.txt")
    disk = cli("snapshot", "create", sid).stdout.splitlines()[-1]
    full = cli("snapshot", "create", sid, "--memory").stdout.splitlines()[-1]
    assert disk.startswith("snap-") and full.startswith("snap-") and disk != full

    listed = {s["id"]: s for s in json.loads(cli("snapshot", "list", sid, "--json").stdout)}
    assert (listed[disk]["kind"], listed[full]["kind"]) == ("disk", "full")
    for snap in (listed[disk], listed[full]):
        assert snap["restorable"] is True and snap["created_at"] and "size_bytes" in snap
    table = cli("snapshot", "list", sid).stdout.splitlines()
    assert table[0].split() == ["id", "kind", "created", "size", "restorable"]
    rows = {r.split()[0]: r.split() for r in table[1:]}
    assert rows[disk][1] == "disk" and rows[full][1] == "full" and rows[full][-1] == "yes"

    sh(cli, sid, "rm -rf /home/user/project")
    assert "rolled back" in cli("sandbox", "rollback", sid, disk).stderr
    assert sh(cli, sid, "cat /home/user/project/a.txt") == "precious\n"

    cli("snapshot", "delete", sid, full)
    assert full not in {s["id"] for s in json.loads(cli("snapshot", "list", sid, "--json").stdout)}
    gone = cli("sandbox", "rollback", sid, full, check=False)
    assert gone.exit_code == 1 and gone.stderr.startswith(f"error: not_found: snapshot {full} was deleted")

    events = json.loads(cli("sandbox", "events", sid, "--json").stdout)
    kinds = [e["kind"] for e in events]
    for kind in ("paused", "resumed", "rolled_back"):
        assert kind in kinds, kinds
    assert kinds.index("paused") < kinds.index("resumed") < kinds.index("rolled_back")
    assert all({"id", "at", "kind", "message", "data"} <= e.keys() for e in events)
    table = cli("sandbox", "events", sid).stdout.splitlines()
    assert table[0].split() == ["id", "at", "kind", "message"] and len(table) == len(events) + 1


def test_fork_then_suspend_and_restore(cli: Cli, sandbox: str) -> None:
    sid = sandbox
    sh(cli, sid, "echo origin > /home/user/who")
    forked = cli("sandbox", "fork", sid, "--count", "2")
    forks = forked.stdout.splitlines()[-2:]
    assert len(set(forks)) == 2 and sid not in forks and "forked" in forked.stderr
    for f in forks:
        info = get(cli, f)
        assert info["state"] == "running" and info["parent_id"] == sid
    assert sh(cli, forks[0], "cat /home/user/who") == "origin\n"
    for f in forks:
        cli("sandbox", "delete", f)

    node = get(cli, sid)["node_id"]
    cli("sandbox", "suspend", sid)
    info = get(cli, sid)
    assert info["state"] == "suspended" and info["node_id"] is None and info["snapshot_id"]
    restored = cli("sandbox", "restore", sid, "--node", node)
    assert restored.stdout == "" and f"on node {node}" in restored.stderr
    assert get(cli, sid)["state"] == "running"
    assert sh(cli, sid, "cat /home/user/who") == "origin\n"


def test_update_changes_and_turns_off_policies(cli: Cli, sandbox: str) -> None:
    before = get(cli, sandbox)
    out = json.loads(cli("sandbox", "update", sandbox, "--idle-pause", "900", "--lifetime", "off",
                         "--snapshot-policy", '{"disk_every": "5m"}', "--json").stdout)
    assert (out["idle_pause_s"], out["idle_suspend_s"], out["expires_at"]) == (900, before["idle_suspend_s"], None)
    assert out["snapshot_policy"]["disk_every"] == 300
    assert get(cli, sandbox)["idle_pause_s"] == 900  # stored, not only echoed
    bad = cli("sandbox", "update", sandbox, "--idle-pause", "soon", check=False)
    assert bad.exit_code != 0 and "--idle-pause" in bad.stderr
