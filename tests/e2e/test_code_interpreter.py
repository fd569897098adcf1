"""The built-in ``code-interpreter-v1`` template end to end: built through the CLI
(``space template build code-interpreter-v1 --builtin``) on the shared server, a sandbox of it is
ready only once its server answers on port 49999, and that server, driven from inside the sandbox
(the port proxy is tested elsewhere), runs code as the template's user: stdout, results, an error
with its traceback, execution counts, a created context keeping its state, env_vars.

The template is built once per module (minutes on a small machine; a machine that built it
before receives it from its template cache instead). Timings are printed (``-s``), not asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.harness import SPACE, Server, create_sandbox, run, wait_operation

pytestmark = pytest.mark.runtime

TEMPLATE = "code-interpreter-v1"

# Runs inside the sandbox: one request to the server, the answer as JSON on stdout.
CLIENT = r"""
import json, sys, urllib.error, urllib.request
method, path, body = sys.argv[1:4]
req = urllib.request.Request("http://127.0.0.1:49999" + path, method=method,
                             data=body.encode() if body else None, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=300) as r:
        status, text = r.status, r.read().decode()
except urllib.error.HTTPError as e:
    status, text = e.code, e.read().decode()
print(json.dumps({"status": status, "body": text}))
"""


@pytest.fixture(scope="module")
def built(server: Server) -> str:
    env = {**os.environ, "SPACE_URL": server.url, "SPACE_API_KEY": server.admin_key}
    started = time.monotonic()
    p = subprocess.run([SPACE, "template", "build", TEMPLATE, "--builtin"], env=env, capture_output=True,
                       text=True, timeout=3600)
    took = time.monotonic() - started
    assert p.returncode == 0, f"{p.stderr[-3000:]}\n{server.log_tail()}"
    steps = [line.strip() for line in p.stderr.splitlines() if line.startswith("[") or " built in " in line]
    print(f"\n{TEMPLATE}: template build {took:.1f}s through the CLI; steps: {steps}")
    return p.stdout.strip()


@pytest.fixture(scope="module")
def sandbox(server: Server, built: str) -> Iterator[str]:
    with server.client(timeout=600) as c:
        started = time.monotonic()
        sid = create_sandbox(c, template=TEMPLATE)
        print(f"\n{TEMPLATE}: sandbox create-to-ready {time.monotonic() - started:.1f}s (includes the server "
              "starting its default kernel)")
        try:
            yield sid
        finally:
            d = c.delete(f"/v1/sandboxes/{sid}")
            assert d.status_code == 202, d.text
            assert wait_operation(c, d.json()["operation"]["id"], timeout=300)["status"] == "succeeded"


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=600) as c:
        yield c


def call(api: httpx.Client, sid: str, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    code, out, err = run(api, sid, {"cmd": ["python3", "-c", CLIENT, method, path,
                                             json.dumps(body) if body is not None else ""]})
    assert code == 0, (out, err)
    answer = json.loads(out)
    return int(answer["status"]), str(answer["body"])


def execute(api: httpx.Client, sid: str, code: str, **body: Any) -> list[dict[str, Any]]:
    status, text = call(api, sid, "POST", "/execute", {"code": code, **body})
    assert status == 200, text
    lines = [json.loads(line) for line in text.splitlines() if line]
    assert lines[-1] == {"type": "end_of_execution"}, lines
    return [line for line in lines if line["type"] != "keepalive"]


def main_text(lines: list[dict[str, Any]]) -> Any:
    return next(r["text"] for r in lines if r["type"] == "result" and r["is_main_result"])


def test_the_template_is_ready_and_runs_code_as_its_user(api: httpx.Client, sandbox: str, built: str) -> None:
    assert api.get(f"/v1/templates/{TEMPLATE}").json()["digest"] == built
    assert call(api, sandbox, "GET", "/health") == (200, '"OK"')
    started = time.monotonic()
    lines = execute(api, sandbox, "import getpass, os\nprint('hello')\n(getpass.getuser(), os.getcwd())")
    print(f"\n{TEMPLATE}: first execution {time.monotonic() - started:.2f}s (one exec through the SPACE API)")
    assert [line["text"] for line in lines if line["type"] == "stdout"] == ["hello\n"]
    assert main_text(lines) == "('user', '/home/user')"
    # The server itself runs as the template's user too.
    server_pid = "$(pgrep -f '^python3 /opt/code-interpreter/server[.]py')"
    code, out, _ = run(api, sandbox, {"shell": f"ps -o user= -p {server_pid}"})
    assert (code, out.decode().split()) == (0, ["user"])


def test_results_errors_and_execution_counts(api: httpx.Client, sandbox: str) -> None:
    first = execute(api, sandbox, "x = 20\nx * 2 + 2")
    assert main_text(first) == "42"
    lines = execute(api, sandbox, "def boom():\n    return 1 / 0\n\nboom()")
    [err] = [line for line in lines if line["type"] == "error"]
    assert (err["name"], err["value"]) == ("ZeroDivisionError", "division by zero")
    assert "boom()" in err["traceback"]
    counts = [line["execution_count"] for line in first + lines if line["type"] == "number_of_executions"]
    assert len(counts) == 2 and counts[1] == counts[0] + 1


def test_a_created_context_keeps_its_state(api: httpx.Client, sandbox: str) -> None:
    status, text = call(api, sandbox, "POST", "/contexts", {"cwd": "/tmp"})
    assert status == 200, text
    ctx = json.loads(text)
    assert (ctx["language"], ctx["cwd"]) == ("python", "/tmp")
    try:
        execute(api, sandbox, "kept = 'across executions'", context_id=ctx["id"])
        assert main_text(execute(api, sandbox, "import os\n(kept, os.getcwd())",
                                 context_id=ctx["id"])) == "('across executions', '/tmp')"
        assert ctx["id"] in [c["id"] for c in json.loads(call(api, sandbox, "GET", "/contexts")[1])]
    finally:
        assert call(api, sandbox, "DELETE", f"/contexts/{ctx['id']}")[0] == 200
    assert call(api, sandbox, "POST", "/execute", {"code": "1", "context_id": ctx["id"]})[0] == 404


def test_env_vars_hold_for_one_execution(api: httpx.Client, sandbox: str) -> None:
    lines = execute(api, sandbox, "import os, subprocess\n(os.environ['SPACE_CI'], "
                                  "subprocess.check_output(['printenv', 'SPACE_CI'], text=True))",
                    env_vars={"SPACE_CI": "only-now"})
    assert main_text(lines) == "('only-now', 'only-now\\n')"
    assert main_text(execute(api, sandbox, "import os; repr(os.environ.get('SPACE_CI'))")) == "None"


# -- the official e2b-code-interpreter SDK, through the facade's port routing ---------------------


@pytest.fixture
def ci_sdk(server: Server, built: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from tests.e2e import e2b_env

    e2b_env.point_sdk_at(monkeypatch, server)
    ci = pytest.importorskip("e2b_code_interpreter")
    made = e2b_env.Sandboxes()
    try:
        yield ci, made
    finally:
        made.kill_all()


def test_sdk_run_code(ci_sdk: Any) -> None:
    ci, made = ci_sdk
    sbx = ci.Sandbox.create(envs={"FROM_CREATE": "here"})  # the SDK's default template: code-interpreter-v1
    made.add(sbx.sandbox_id)
    # The sandbox's own variables reach the kernel that started before it had them.
    assert sbx.run_code("import os; os.environ.get('FROM_CREATE')").text == "here"
    out: list[str] = []
    execution = sbx.run_code("import os\nprint('hello'); x = 40\nx + 2", on_stdout=lambda m: out.append(m.line))
    assert execution.error is None
    assert execution.text == "42"
    assert execution.logs.stdout == ["hello\n"]
    assert [line.strip() for line in out] == ["hello"]
    assert execution.execution_count is not None
    # State stays in the default context; errors come back parsed, not raised.
    assert sbx.run_code("x * 2").text == "80"
    failed = sbx.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert "ZeroDivisionError" in failed.error.traceback
    # Per-run environment variables, gone again afterwards.
    assert sbx.run_code("import os; os.environ.get('CI_VAR')", envs={"CI_VAR": "set"}).text == "set"
    assert sbx.run_code("import os; os.environ.get('CI_VAR')").text is None
    # Contexts are separate interpreters.
    ctx = sbx.create_code_context()
    sbx.run_code("y = 'in ctx'", context=ctx)
    assert sbx.run_code("y", context=ctx).text == "in ctx"
    assert sbx.run_code("'y' in dir()").text == "False"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(ctx)
    assert sbx.run_code("'y' in dir()", context=ctx).text == "False"  # a restart forgets
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    # The same sandbox serves plain E2B calls too.
    assert sbx.commands.run("whoami").stdout.strip() == "user"


async def test_sdk_run_code_async(ci_sdk: Any) -> None:
    ci, made = ci_sdk
    sbx = await ci.AsyncSandbox.create()
    made.add(sbx.sandbox_id)
    execution = await sbx.run_code("sum(range(10))")
    assert execution.text == "45"
    failed = await sbx.run_code("raise ValueError('nope')")
    assert failed.error is not None and failed.error.name == "ValueError" and failed.error.value == "nope"
