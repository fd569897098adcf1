"""The CLI's output contract, against the fake API.

Aspects: ``sandbox create`` and ``apikey create`` print only the id / key on stdout; ``exec``
streams stdout and stderr apart and exits with the command's code (128+N for a signal); stdin is
forwarded; ``--json`` outputs parse (``sandbox get --json`` is the API's object verbatim);
tables are plain text off a terminal; errors are ``error: <code>: <message>`` with exit 1 and no
traceback; usage errors exit 2; files move both ways, also through stdin/stdout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import Result

from space.keyforms import e2b_spelling
from tests.sdk.fake_api import FakeAPI

Run = Callable[..., Result]


def test_sandbox_create_prints_only_the_id(fake: FakeAPI, space: Run) -> None:
    result = space("sandbox", "create", "--template", "base", "--cpu", "2", "--memory", "1024",
                   "--env", "A=1", "--env", "B=x=y", "--metadata", "team=ml")
    assert result.exit_code == 0, result.output
    [sandbox_id] = fake.sandboxes
    assert result.stdout == f"{sandbox_id}\n"
    assert fake.sandboxes[sandbox_id]["state"] == "running"
    assert fake.seen("POST", "/v1/sandboxes")[0].json() == {
        "template": "base", "cpu": 2.0, "memory_mb": 1024, "env": {"A": "1", "B": "x=y"},
        "metadata": {"team": "ml"}}


def test_sandbox_create_no_wait_and_failure(fake: FakeAPI, space: Run) -> None:
    result = space("sandbox", "create", "--no-wait")
    assert result.exit_code == 0 and fake.sandboxes[result.stdout.strip()]["state"] == "creating"
    failed = space("sandbox", "create", "--template", "broken")
    assert failed.exit_code == 1 and failed.stdout == ""
    assert "error: runtime_error: the guest did not start" in failed.stderr
    assert "Traceback" not in failed.output


def test_exec_streams_and_propagates_the_exit_code(space: Run, sandbox_id: str) -> None:
    result = space("exec", sandbox_id, "--", "emit", "out", "err", "7")
    assert (result.exit_code, result.stdout, result.stderr) == (7, "out", "err")
    assert space("exec", sandbox_id, "echo", "hello", "world").stdout == "hello world\n"
    assert space("exec", sandbox_id, "--", "killed", "9").exit_code == 128 + 9


def test_exec_options_reach_the_request(fake: FakeAPI, space: Run, sandbox_id: str) -> None:
    result = space("exec", "--env", "GREETING=hi", "--cwd", "/tmp", "--user", "root", "--timeout", "9",
                   sandbox_id, "--", "env", "GREETING")
    assert result.exit_code == 0 and result.stdout == "hi"
    body = fake.seen("POST", "/commands")[-1].json()
    assert body == {"cmd": ["env", "GREETING"], "env": {"GREETING": "hi"}, "cwd": "/tmp", "user": "root",
                    "timeout": 9.0}


def test_exec_tty_off_a_terminal_asks_for_a_pty_without_raw_mode(
    fake: FakeAPI, space: Run, sandbox_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LINES", "40")
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("TERM", "xterm-test")
    assert space("exec", "--tty", sandbox_id, "echo", "x").exit_code == 0
    body = fake.seen("POST", "/commands")[-1].json()
    assert body["pty"] == {"rows": 40, "cols": 120}
    assert body["env"] == {"TERM": "xterm-test"} and "stdin" not in body


def test_exec_forwards_stdin(fake: FakeAPI, space: Run, sandbox_id: str) -> None:
    result = space("exec", "--stdin", sandbox_id, "cat", input=b"from the pipe\n")
    assert result.exit_code == 0 and result.stdout == "from the pipe\n"
    assert fake.seen("POST", "/stdin")[-1].params == {"eof": "true"}


def test_exec_resumes_a_dropped_stream(fake: FakeAPI, space: Run, sandbox_id: str) -> None:
    fake.drop_events_after = 1
    result = space("exec", sandbox_id, "count", "3")
    assert result.stdout == "line 1\nline 2\nline 3\n"


def test_apikey_create_prints_only_the_key(fake: FakeAPI, space: Run) -> None:
    result = space("apikey", "create", "--tenant", "acme", "--role", "admin", "--name", "ci")
    assert result.exit_code == 0
    [key] = fake.apikeys.values()
    assert result.stdout == f"{key['key']}\n"
    listed = json.loads(space("apikey", "list", "--json").stdout)
    assert [k["id"] for k in listed] == [key["id"]]
    assert space("apikey", "delete", key["id"]).exit_code == 0
    assert fake.apikeys == {}


def test_apikey_in_e2b_spelling(fake: FakeAPI, space: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    result = space("apikey", "create", "--tenant", "acme", "--e2b")
    [key] = fake.apikeys.values()
    assert result.exit_code == 0 and result.stdout == f"{e2b_spelling(key['key'])}\n"
    assert space("apikey", "e2b", "sk_abc").stdout == f"{e2b_spelling('sk_abc')}\n"
    monkeypatch.setenv("SPACE_API_KEY", "sk_from_env")
    assert space("apikey", "e2b").stdout == f"{e2b_spelling('sk_from_env')}\n"
    monkeypatch.delenv("SPACE_API_KEY")
    refused = space("apikey", "e2b")
    assert refused.exit_code == 2 and refused.stdout == "" and "SPACE API key" in refused.stderr
    assert space("apikey", "e2b", "not-a-key").exit_code == 2


def test_template_build_from_a_dockerfile_or_an_image(fake: FakeAPI, space: Run, tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("ARG V=1\nFROM registry.example.com/team/app:$V\nENV A=1\nRUN make\n")
    result = space("template", "build", "base", "-f", str(tmp_path / "Dockerfile"), "--build-arg", "V=2")
    assert result.exit_code == 0, result.stderr
    [sent] = fake.seen("POST", "/v1/templates/base/build")
    spec = sent.json()["spec"]
    assert (spec["image"], spec["env"], spec["run"][-1].splitlines()[-1]) == (
        "registry.example.com/team/app:2", {"A": "1"}, "make")
    assert space("template", "build", "base", "--image", "registry.example.com/x:1").exit_code == 0
    assert fake.seen("POST", "/v1/templates/base/build")[-1].json()["spec"] == {"image": "registry.example.com/x:1"}
    (tmp_path / "Dockerfile").write_text("FROM base\nHEALTHCHECK CMD true\n")
    refused = space("template", "build", "base", "-f", str(tmp_path / "Dockerfile"))
    assert refused.exit_code != 0 and "Dockerfile line 2: HEALTHCHECK" in refused.stderr
    both = space("template", "build", "base", "-f", str(tmp_path / "Dockerfile"), "--image", "r.example.com/x:1")
    assert both.exit_code != 0 and "exclude each other" in both.stderr


def test_template_tags(fake: FakeAPI, space: Run) -> None:
    assert space("template", "build", "base", "--force").exit_code == 0
    assert "tags" not in fake.seen("POST", "/v1/templates/base/build")[-1].json()
    tagged = space("template", "build", "base", "--image", "r.example.com/x:1", "--tag", "v1", "-t", "prod")
    assert tagged.exit_code == 0, tagged.stderr
    assert fake.seen("POST", "/v1/templates/base/build")[-1].json()["tags"] == ["v1", "prod"]
    listed = space("template", "tags", "base")
    assert listed.exit_code == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["tag", "digest", "build", "tagged"]
    assert [r.split()[:2] for r in rows] == [["v1", "sha256:base1"], ["prod", "sha256:base1"]]
    assert [t["tag"] for t in json.loads(space("template", "tags", "base", "--json").stdout)] == ["v1", "prod"]


def test_json_outputs_parse(fake: FakeAPI, space: Run, sandbox_id: str) -> None:
    assert json.loads(space("sandbox", "get", sandbox_id, "--json").stdout) == fake.sandboxes[sandbox_id]
    assert [s["id"] for s in json.loads(space("sandbox", "list", "--json").stdout)] == [sandbox_id]
    assert [t["name"] for t in json.loads(space("template", "list", "--json").stdout)] == ["base", "broken"]
    op_id = next(iter(fake.operations))
    assert json.loads(space("operation", "get", op_id, "--json").stdout)["status"] == "succeeded"


def test_tables_are_plain_text(space: Run, sandbox_id: str) -> None:
    result = space("sandbox", "list")
    assert "\x1b[" not in result.stdout
    header, row = result.stdout.splitlines()
    assert header.split() == ["id", "state", "template", "cpu", "memory", "created"]
    assert row.split()[:3] == [sandbox_id, "running", "base"]


def test_errors_print_code_and_message_and_exit_1(space: Run) -> None:
    result = space("sandbox", "get", "sb-missing")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == "error: not_found: sandbox sb-missing not found\n"


def test_global_options_reach_the_client(space: Run) -> None:
    result = space("--api-key", "sk-wrong", "sandbox", "list")
    assert result.exit_code == 1 and result.stderr.startswith("error: unauthorized:")


def test_invalid_state_and_usage_errors(space: Run) -> None:
    sandbox_id = space("sandbox", "create", "--no-wait").stdout.strip()
    result = space("exec", sandbox_id, "echo")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: invalid_state: cannot exec a sandbox that is creating")
    assert space("sandbox", "create", "--env", "novalue").exit_code == 2
    assert space("exec").exit_code == 2


def test_sandbox_delete(fake: FakeAPI, space: Run, sandbox_id: str) -> None:
    assert space("sandbox", "delete", sandbox_id).exit_code == 0
    assert fake.sandboxes[sandbox_id]["state"] == "terminated"


def test_files_round_trip(fake: FakeAPI, space: Run, sandbox_id: str, tmp_path: Path) -> None:
    local = tmp_path / "in.bin"
    local.write_bytes(b"\x00\x01payload\n" * 1000)
    assert space("files", "put", sandbox_id, str(local), "/home/user/data/in.bin").exit_code == 0
    out = str(tmp_path / "out.bin")
    assert space("files", "get", sandbox_id, "/home/user/data/in.bin", out).exit_code == 0
    assert (tmp_path / "out.bin").read_bytes() == local.read_bytes()
    assert space("files", "put", sandbox_id, "-", "/home/user/piped", input=b"via stdin").exit_code == 0
    assert space("files", "get", sandbox_id, "/home/user/piped", "-").stdout_bytes == b"via stdin"
    missing = space("files", "put", sandbox_id, str(tmp_path / "nope"), "/x")
    assert missing.exit_code == 1 and missing.stderr.startswith("error: local_io: No such file or directory")


def test_files_ls_stat_mkdir_mv_rm(fake: FakeAPI, space: Run, sandbox_id: str) -> None:
    assert space("files", "mkdir", sandbox_id, "/home/user/dir").exit_code == 0
    space("files", "put", sandbox_id, "-", "/home/user/dir/a.txt", input=b"hello")
    listing = space("files", "ls", sandbox_id, "/home/user")
    rows = [line.split() for line in listing.stdout.splitlines()]
    assert rows[0] == ["type", "size", "mode", "mtime", "name"]
    assert rows[1][0] == "dir" and rows[1][2] == "drwxr-xr-x" and rows[1][-1] == "dir/"
    deep = json.loads(space("files", "ls", sandbox_id, "/home/user", "--depth", "2", "--json").stdout)
    assert [e["path"] for e in deep] == ["/home/user/dir", "/home/user/dir/a.txt"]
    stat = space("files", "stat", sandbox_id, "/home/user/dir/a.txt", "--json")
    assert json.loads(stat.stdout)["size"] == 5
    assert space("files", "mv", sandbox_id, "/home/user/dir/a.txt", "/home/user/b.txt").exit_code == 0
    assert "/home/user/b.txt" in fake.files[sandbox_id]
    assert space("files", "rm", sandbox_id, "/home/user/dir").exit_code == 0
    assert space("files", "rm", sandbox_id, "/home/user/nope").stderr.startswith("error: not_found:")


def test_template_build_streams_logs_and_prints_the_digest(space: Run) -> None:
    result = space("template", "build", "base", "--force")
    assert result.exit_code == 0
    assert result.stdout == "sha256:base1\n"
    assert "step 1/2: unpacking rootfs\nstep 2/2: snapshotting\n" in result.stderr
    failed = space("template", "build", "broken")
    assert failed.exit_code == 1 and "error: runtime_error: debootstrap failed" in failed.stderr
