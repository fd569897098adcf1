"""The README walkthrough with the real ``space`` CLI, and the SDK (sync and async) against a real
server: the output contract of each command, exit codes, streaming files, errors as classes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from space import AsyncClient, Client
from space.errors import InvalidState, NotFound, Unauthorized
from tests.e2e.harness import SPACE, Server

pytestmark = pytest.mark.runtime


def cli(server: Server, *args: str, key: str | None = None, check: bool = True,
        stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "SPACE_URL": server.url, "SPACE_API_KEY": key or server.admin_key}
    p = subprocess.run([SPACE, *args], env=env, capture_output=True, input=stdin, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"space {' '.join(args)} -> {p.returncode}\n{p.stderr.decode()}")
    return p


def test_readme_walkthrough(server: Server, tmp_path: Path) -> None:
    sid = cli(server, "sandbox", "create", "--template", "base").stdout.decode().strip()
    assert sid.startswith("s") and len(sid) == 20 and "\n" not in sid
    try:
        p = cli(server, "exec", sid, "--", "python3", "-c", "print(6*7)")
        assert p.stdout == b"42\n"
        p = cli(server, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7", check=False)
        assert (p.returncode, p.stdout, p.stderr) == (7, b"out\n", b"err\n")

        big = tmp_path / "big.bin"
        big.write_bytes(os.urandom(5 * 1024 * 1024))
        cli(server, "files", "put", sid, str(big), "/home/user/big.bin")
        cli(server, "files", "get", sid, "/home/user/big.bin", str(tmp_path / "copy.bin"))
        assert (tmp_path / "copy.bin").read_bytes() == big.read_bytes()
        ls = cli(server, "files", "ls", sid, "/home/user").stdout.decode()
        assert "big.bin" in ls and "-rw-" in ls
        entries = json.loads(cli(server, "files", "ls", sid, "/home/user", "--json").stdout)
        assert any(e["name"] == "big.bin" and e["size"] == 5 * 1024 * 1024 for e in entries)

        assert sid in cli(server, "sandbox", "list").stdout.decode()
        got = json.loads(cli(server, "sandbox", "get", sid, "--json").stdout)
        assert got["id"] == sid and got["state"] == "running" and got["template"] == "base"

        key = cli(server, "apikey", "create", "--tenant", "acme").stdout.decode().strip()
        assert key.startswith("sk_") and "\n" not in key
        p = cli(server, "sandbox", "get", sid, key=key, check=False)
        assert p.returncode == 1 and b"not_found" in p.stderr

        tl = cli(server, "template", "list").stdout.decode()
        assert "base" in tl and "ready" in tl
        build = cli(server, "template", "build", "base")
        digest = build.stdout.decode().strip().splitlines()[-1]
        assert digest == json.loads(cli(server, "template", "list", "--json").stdout)[0]["digest"]
    finally:
        cli(server, "sandbox", "delete", sid)
    assert json.loads(cli(server, "sandbox", "get", sid, "--json").stdout)["state"] == "terminated"


def test_sync_sdk(server: Server) -> None:
    with Client(server.url, server.admin_key) as client:
        sb = client.sandboxes.create("base", env={"GREETING": "hi"})
        try:
            res = sb.exec("echo $GREETING; echo oops >&2; exit 3")
            assert (res.exit_code, res.stdout, res.stderr) == (3, b"hi\n", b"oops\n")
            chunks: list[bytes] = []
            res = sb.exec(["python3", "-c", "print('streamed')"], on_stdout=chunks.append)
            assert b"".join(chunks) == b"streamed\n" and res.exit_code == 0
            sb.files.write("/home/user/note.txt", b"note")
            assert sb.files.read("/home/user/note.txt") == b"note"
            assert sb.files.exists("/home/user/note.txt")
            cmd = sb.start(["cat"], stdin=True)
            cmd.send_stdin(b"piped", eof=True)
            assert cmd.wait().stdout == b"piped"
            with pytest.raises(NotFound):
                sb.files.read("/nope")
        finally:
            sb.delete()
        with pytest.raises(InvalidState) as exc:
            sb.exec("true")
        assert exc.value.state == "terminated"
    with Client(server.url, "sk_wrong") as bad, pytest.raises(Unauthorized):
        bad.sandboxes.list()


@pytest.mark.anyio
async def test_async_sdk(server: Server) -> None:
    async with AsyncClient(server.url, server.admin_key) as client:
        sb = await client.sandboxes.create("base")
        try:
            res = await sb.exec("uname -r")
            assert res.exit_code == 0 and res.stdout.strip()
            seen = [e async for e in (await sb.start("printf a; printf b >&2")).events()]
            assert seen[-1].type == "exit" and {e.type for e in seen[:-1]} <= {"stdout", "stderr"}
            listed = await sb.files.list("/home/user")
            assert isinstance(listed, list)
        finally:
            await sb.delete()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
