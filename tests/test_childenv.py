"""``space.childenv``: children get their role's allowlist and what the caller names, the API wipes
its own environment, and the node agent's supervisor hands secrets over a pipe, not the environment."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from space import childenv
from space.cli.server import read_secrets
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
SECRET_ENV = {"SPACE_MASTER_KEY": "bWFzdGVy", "AWS_SECRET_ACCESS_KEY": "aws-secret", "SPACE_TEST_CANARY": "canary"}


def test_build_takes_only_the_allowed_names_and_defaults_path() -> None:
    source = {**SECRET_ENV, "SPACE_LOG_LEVEL": "debug", "SPACE_GATEWAY_PYTHON": "/x/python", "HOME": "/root"}
    assert childenv.build("helper", source=source) == {
        "PATH": childenv.DEFAULT_PATH, "SPACE_LOG_LEVEL": "debug", "SPACE_GATEWAY_PYTHON": "/x/python"}
    assert childenv.build("gateway", source={**source, "PATH": "/opt/bin", "SSLKEYLOGFILE": "/tmp/k"}) == {
        "PATH": "/opt/bin"}
    assert childenv.build("tool", {"LC_ALL": "C"}, source=source) == {"PATH": childenv.DEFAULT_PATH, "LC_ALL": "C"}


def test_an_explicit_name_outside_the_role_is_refused() -> None:
    with pytest.raises(childenv.EnvError, match="AWS_SECRET_ACCESS_KEY"):
        childenv.build("tool", {"AWS_SECRET_ACCESS_KEY": "x"})
    with pytest.raises(childenv.EnvError, match="unknown process role"):
        childenv.names("sandbox")


def test_no_allowlist_names_a_secret() -> None:
    for role in childenv.ALLOW:
        held = childenv.names(role)
        assert not held & {"SPACE_MASTER_KEY", "SPACE_VAULT_TOKEN", "SPACE_VAULT_TOKEN_FILE", "SSLKEYLOGFILE"}, role
        assert not [n for n in held if n.startswith("AWS_")], role


def test_confine_self_leaves_the_allowlist_and_wipes_proc_environ() -> None:
    probe = ("import json, os, subprocess\n"
             "from space import childenv\n"
             "childenv.confine_self('api')\n"
             "raw = open(f'/proc/{os.getpid()}/environ', 'rb').read()\n"
             "child = subprocess.run(['/usr/bin/env'], capture_output=True, text=True).stdout\n"  # libc's environ
             "print(json.dumps([raw.strip(b'\\0').decode(), sorted(os.environ),"
             " sorted(line.split('=')[0] for line in child.splitlines())]))")
    env = {**SECRET_ENV, "PATH": os.environ.get("PATH", childenv.DEFAULT_PATH), "SPACE_LOG_LEVEL": "debug"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    raw, mine, childs = json.loads(out.stdout)
    assert raw == ""  # the initial block is all zeros
    assert mine == childs
    # Python itself may add LC_CTYPE at startup (PEP 538 locale coercion): the API's allowlist has it.
    assert {"PATH", "SPACE_LOG_LEVEL"} <= set(mine) <= childenv.names("api")


# ---- the supervisor's secrets pipe -------------------------------------------------------------


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A stand-in node agent: writes its environment and what ``--secrets-fd`` holds, then waits."""
    out = tmp_path / "node.json"
    code = ("import json, os, signal, sys\n"
            "args = sys.argv[1:]\n"
            "fd = int(args[args.index('--secrets-fd') + 1]) if '--secrets-fd' in args else None\n"
            "secrets = os.read(fd, 65536).decode() if fd is not None else None\n"
            "raw = open('/proc/self/environ', 'rb').read().split(b'\\0')\n"
            "env = dict(i.decode().split('=', 1) for i in raw if i)\n"
            f"open({str(out)!r}, 'w').write(json.dumps({{'env': env, 'secrets': secrets, "
            "'pid': os.getpid()}))\n"
            "signal.pause()\n")
    yield out, [sys.executable, "-c", code]


def _supervise(doc: object) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "space.nodesup"], stdin=subprocess.PIPE, cwd=REPO,
                            stderr=subprocess.DEVNULL, env=childenv.build("nodesup"))
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(doc).encode() + b"\n")
    proc.stdin.flush()
    return proc


def test_the_supervisor_passes_the_allowed_env_and_secrets_on_a_pipe(stand_in: tuple[Path, list[str]]) -> None:
    out, argv = stand_in
    creds = {"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    proc = _supervise({"argv": argv, "env": {**SECRET_ENV, "SPACE_NODE_USER": "space-node"},
                       "secrets": {"object_store": creds}})
    seen: dict[str, Any] = {}

    def written() -> dict[str, Any] | None:
        text = out.read_text() if out.exists() else ""
        return json.loads(text) if text.endswith("}") else None

    try:
        got = wait_for(written, 30, "the stand-in node agent")
        seen = got or {}
        assert seen["env"] == {"PATH": childenv.DEFAULT_PATH, "SPACE_NODE_USER": "space-node"}
        assert json.loads(seen["secrets"]) == {"object_store": creds}
    finally:
        proc.kill()
        proc.wait()
        if seen:  # it follows its supervisor only through --die-with-parent, which it lacks
            with contextlib.suppress(ProcessLookupError):
                os.kill(seen["pid"], signal.SIGKILL)


def test_read_secrets_validates_and_closes_the_pipe() -> None:
    r, w = os.pipe()
    os.write(w, b'{"object_store": {"AWS_ACCESS_KEY_ID": "a"}}')
    os.close(w)
    assert read_secrets(r) == {"object_store": {"AWS_ACCESS_KEY_ID": "a"}}
    with pytest.raises(OSError):
        os.fstat(r)
    r, w = os.pipe()
    os.write(w, b'{"object_store": {"AWS_ACCESS_KEY_ID": 1}}')
    os.close(w)
    with pytest.raises(Exception, match="want"):
        read_secrets(r)


def test_every_environment_the_helper_gives_a_host_tool_is_a_tools() -> None:
    """What the helper gives the host's debootstrap passes the tool role (``container=lxc`` did not,
    and every base template build on a machine with no cached one failed)."""
    from space.node.helper import verbs_template

    assert childenv.tool(verbs_template.FIRST_STAGE_ENV)["container"] == "lxc"
