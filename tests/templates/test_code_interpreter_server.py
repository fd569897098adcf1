"""The code interpreter's server (space/templates/code_interpreter/server.py) run on the host, as the
template runs it in a sandbox, against real IPython kernels of this venv (the dev extra pins the
template's ipykernel and jupyter-client).

Aspects: the NDJSON lines of an execution (stdout, results, the error of a failing cell with its
traceback, execution_count, end_of_execution last) and that they stream as the kernel produces them;
contexts (own kernel, state and cwd; list, delete, restart, 404 when unknown); env_vars for one
execution only; a kernel dying mid-execution, or its context restarted or removed, ends the stream
with an error line (and a restarted context works again); a client leaving interrupts its cell; the
server leaves no kernel and no file behind; the e2b-code-interpreter SDK itself drives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.templates.code_interpreter import server as ci_server
from tests.e2e.harness import free_port
from tests.waiting import wait_for

SERVER = Path(ci_server.__file__)
#: Generous: the machine is small and shared; nothing here waits this long when things work.
TIMEOUT = 120.0


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ci-home")


@pytest.fixture(scope="module")
def url(workdir: Path) -> Iterator[str]:
    port = free_port()
    tmp = workdir / "tmp"  # the server's TMPDIR: what it keeps there must go with it
    tmp.mkdir()
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 -- closed below
    proc = subprocess.Popen([sys.executable, str(SERVER), "--host", "127.0.0.1", "--port", str(port),
                             "--cwd", str(workdir), "--sandbox-env-file", str(workdir / "sandbox-env.json")],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=workdir,
                            env={**os.environ, "TMPDIR": str(tmp)})
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}): {(workdir / 'server.log').read_text()}")
        try:
            return httpx.get(f"{base}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    kernels: set[int] = set()
    try:
        wait_for(healthy, TIMEOUT, "the code interpreter server to answer /health", interval=0.1)
        yield base
        kernels = _children(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        left = [pid for pid in kernels if not _gone(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, (workdir / "server.log").read_text()[-3000:]
    assert not left, f"the server left kernels running: {left}"
    assert list(tmp.iterdir()) == []


@pytest.fixture
def api(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        yield c


def execute(api: httpx.Client, code: str, **body: Any) -> list[dict[str, Any]]:
    with api.stream("POST", "/execute", json={"code": code, **body}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1] == {"type": "end_of_execution"}, lines
    return [line for line in lines if line["type"] != "keepalive"]


def of(lines: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [line for line in lines if line["type"] == kind]


def main_text(lines: list[dict[str, Any]]) -> Any:
    return next(r["text"] for r in of(lines, "result") if r["is_main_result"])


def new_context(api: httpx.Client, **body: Any) -> str:
    r = api.post("/contexts", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def test_an_execution_streams_its_count_stdout_result_and_end(api: httpx.Client) -> None:
    lines = execute(api, "print('hi')\nprint('err', file=__import__('sys').stderr)\nx = 41\nx + 1")
    assert lines[0]["type"] == "number_of_executions"
    first = lines[0]["execution_count"]
    assert [line["text"] for line in of(lines, "stdout")] == ["hi\n"]
    assert [line["text"] for line in of(lines, "stderr")] == ["err\n"]
    assert all(isinstance(line["timestamp"], str) for line in of(lines, "stdout"))
    assert main_text(lines) == "42"
    assert of(lines, "error") == []
    assert execute(api, "x")[0] == {"type": "number_of_executions", "execution_count": first + 1}


def test_a_failing_cell_is_an_error_line_with_its_traceback(api: httpx.Client) -> None:
    lines = execute(api, "def boom():\n    return 1 / 0\n\nboom()")
    [err] = of(lines, "error")
    assert (err["name"], err["value"]) == ("ZeroDivisionError", "division by zero")
    assert "boom()" in err["traceback"] and "ZeroDivisionError" in err["traceback"]
    assert of(lines, "result") == []
    # A syntax error too, and the kernel goes on.
    [err] = of(execute(api, "def ("), "error")
    assert err["name"] == "SyntaxError"
    assert main_text(execute(api, "1 + 1")) == "2"


def test_display_data_and_the_main_result_carry_their_formats(api: httpx.Client) -> None:
    lines = execute(api, "from IPython.display import display, HTML, Markdown\n"
                         "display(HTML('<b>bold</b>'))\ndisplay(Markdown('*md*'))\n'a string'")
    results = of(lines, "result")
    assert [(r["is_main_result"], r.get("html"), r.get("markdown")) for r in results] == [
        (False, "<b>bold</b>", None), (False, None, "*md*"), (True, None, None)]
    # As E2B's server does: a string result's text has no repr quotes.
    assert results[-1]["text"] == "a string"


def test_output_streams_while_the_cell_runs(api: httpx.Client, workdir: Path) -> None:
    """The first line must reach the client while the cell still runs: the cell waits for a file
    the test creates only once it has read that line (a buffering server would never show it)."""
    flag = workdir / "go-on"
    code = ("import os, time\nprint('first', flush=True)\ndeadline = time.monotonic() + 60\n"
            f"while not os.path.exists({str(flag)!r}) and time.monotonic() < deadline:\n    time.sleep(0.02)\n"
            f"print('second' if os.path.exists({str(flag)!r}) else 'gave up')")
    seen: list[str] = []
    with api.stream("POST", "/execute", json={"code": code}) as r:
        for raw in r.iter_lines():
            line = json.loads(raw)
            if line["type"] == "stdout":
                seen.append(line["text"])
                if line["text"] == "first\n":
                    flag.touch()
    assert seen == ["first\n", "second\n"]


def test_a_created_context_has_its_own_state_and_cwd(api: httpx.Client, workdir: Path) -> None:
    sub = workdir / "ctx-cwd"
    sub.mkdir()
    cid = new_context(api, cwd=str(sub), language="python")
    try:
        assert {"id": cid, "language": "python", "cwd": str(sub)} in api.get("/contexts").json()
        execute(api, "only_here = 5", context_id=cid)
        assert main_text(execute(api, "import os\n(only_here, os.getcwd())", context_id=cid)) == f"(5, '{sub}')"
        # Its own kernel: the default context knows nothing of it, and has its own cwd.
        [err] = of(execute(api, "only_here"), "error")
        assert err["name"] == "NameError"
        assert main_text(execute(api, "import os; os.getcwd()")) == str(workdir)
    finally:
        assert api.delete(f"/contexts/{cid}").status_code == 200
    assert cid not in [c["id"] for c in api.get("/contexts").json()]
    r = api.post("/execute", json={"code": "1", "context_id": cid})
    assert (r.status_code, r.text) == (404, f"Context {cid} not found")


def test_env_vars_hold_for_one_execution(api: httpx.Client) -> None:
    odd = "quote ' double \" backslash \\ newline \n end"
    execute(api, "import os; os.environ['SPACE_CI_KEEP'] = 'original'; os.environ.pop('SPACE_CI_NEW', None)")
    lines = execute(api, "import os, subprocess\n"
                         "(os.environ['SPACE_CI_KEEP'], os.environ['SPACE_CI_NEW'],"
                         " subprocess.check_output(['printenv', 'SPACE_CI_KEEP'], text=True))",
                    env_vars={"SPACE_CI_KEEP": "for-now", "SPACE_CI_NEW": odd})
    count = lines[0]["execution_count"]
    assert main_text(lines) == repr(("for-now", odd, "for-now\n"))
    after = execute(api, "import os; (os.environ.get('SPACE_CI_KEEP'), os.environ.get('SPACE_CI_NEW'), "
                         "'__space_env_saved__' in globals())")
    assert main_text(after) == "('original', None, False)"
    # Setting and restoring them are not executions of their own.
    assert after[0]["execution_count"] == count + 1


def test_bad_requests(api: httpx.Client) -> None:
    r = api.post("/execute", json={"code": "1", "context_id": "no-such-context"})
    assert (r.status_code, r.text) == (404, "Context no-such-context not found")
    assert api.post("/contexts/no-such-context/restart").status_code == 404
    assert api.delete("/contexts/no-such-context").status_code == 404
    assert api.post("/execute", json={"code": "1", "language": "cobol"}).status_code == 400
    assert api.post("/execute", json={"code": 1}).status_code == 400
    assert api.post("/execute", json={"code": "1", "env_vars": {"A": 1}}).status_code == 400
    assert api.post("/contexts", json={"cwd": "/no/such/dir"}).status_code == 400
    assert api.get("/health").json() == "OK"


def test_a_kernel_dying_mid_execution_ends_the_stream_and_the_context_recovers(api: httpx.Client) -> None:
    cid = new_context(api)
    try:
        execute(api, "state = 1", context_id=cid)
        lines = execute(api, "import os, signal\nprint('dying', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)",
                        context_id=cid)
        [err] = of(lines, "error")
        assert err["name"] == "DeadKernelError", lines
        assert main_text(execute(api, "'state' in globals()", context_id=cid)) == "False"
    finally:
        api.delete(f"/contexts/{cid}")


def spin_until(url: str, cid: str, then: Callable[[], None]) -> list[dict[str, Any]]:
    """The lines of a never-ending cell in context ``cid``, calling ``then`` once it runs."""
    running = threading.Event()
    lines: list[dict[str, Any]] = []

    def spin() -> None:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c, \
                c.stream("POST", "/execute", json={"code": "import time\nprint('spinning', flush=True)\n"
                                                   "while True: time.sleep(0.02)", "context_id": cid}) as r:
            for raw in r.iter_lines():
                lines.append(json.loads(raw))
                if lines[-1]["type"] == "stdout":
                    running.set()

    t = threading.Thread(target=spin)
    t.start()
    try:
        assert running.wait(TIMEOUT)
        then()
    finally:
        t.join(TIMEOUT)
    assert not t.is_alive()
    assert lines[-1] == {"type": "end_of_execution"}
    return lines


def test_restart_ends_a_running_execution_and_clears_the_state(api: httpx.Client, url: str) -> None:
    cid = new_context(api)
    try:
        execute(api, "state = 1", context_id=cid)
        lines = spin_until(url, cid, lambda: api.post(f"/contexts/{cid}/restart").raise_for_status() and None)
        [err] = of(lines, "error")
        assert (err["name"], err["value"]) == ("ContextRestarting", "the context was restarted during the execution")
        assert main_text(execute(api, "'state' in globals()", context_id=cid)) == "False"
    finally:
        api.delete(f"/contexts/{cid}")


def test_removing_a_context_ends_its_running_execution(api: httpx.Client, url: str) -> None:
    cid = new_context(api)
    lines = spin_until(url, cid, lambda: api.delete(f"/contexts/{cid}").raise_for_status() and None)
    [err] = of(lines, "error")
    assert err["value"] == "the context was removed during the execution"
    assert api.post("/execute", json={"code": "1", "context_id": cid}).status_code == 404


def test_a_client_leaving_interrupts_its_cell(api: httpx.Client, url: str) -> None:
    """A cell that never ends, abandoned by its client, must not block the context: the next
    execution there runs (it would wait forever behind the cell if the server did not stop it)."""
    cid = new_context(api)
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c, \
                c.stream("POST", "/execute", json={"code": "import time\nprint('spinning', flush=True)\n"
                                                   "while True: time.sleep(0.02)", "context_id": cid}) as r:
            for raw in r.iter_lines():
                if json.loads(raw)["type"] == "stdout":
                    break  # leaving closes the connection
        assert main_text(execute(api, "'still here'", context_id=cid)) == "still here"
    finally:
        api.delete(f"/contexts/{cid}")


def test_the_e2b_sdk_drives_it(url: str, workdir: Path) -> None:
    """The e2b-code-interpreter SDK's own requests and parsing, pointed at this server."""
    pytest.importorskip("e2b_code_interpreter")
    from e2b import ConnectionConfig, NotFoundException
    from e2b_code_interpreter import Sandbox  # type: ignore[import-untyped]
    from packaging.version import Version

    cfg = ConnectionConfig(sandbox_url=url, api_key="e2b_unused", api_url="http://127.0.0.1:9")
    sbx = Sandbox(sandbox_id="local", sandbox_domain=None, envd_version=Version("0.4.0"), envd_access_token=None,
                  traffic_access_token=None, connection_config=cfg)
    seen: list[str] = []
    ex = sbx.run_code("print('from sdk')\n6 * 7", on_stdout=lambda m: seen.append(m.line))
    assert (ex.text, ex.logs.stdout, seen, ex.error) == ("42", ["from sdk\n"], ["from sdk\n"], None)
    assert isinstance(ex.execution_count, int)
    ex = sbx.run_code("raise ValueError('nope')")
    assert ex.error is not None and (ex.error.name, ex.error.value) == ("ValueError", "nope")
    ctx = sbx.create_code_context(cwd=str(workdir))
    assert ctx.cwd == str(workdir) and ctx.language == "python"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    assert sbx.run_code("import os; os.environ['V']", context=ctx, envs={"V": "sdk-env"}).text == "sdk-env"
    sbx.restart_code_context(ctx)
    sbx.remove_code_context(ctx)
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=ctx)


def _value(api: httpx.Client, expr: str, **body: Any) -> Any:
    results = [line for line in execute(api, expr, **body) if line["type"] == "result"]
    return results[0]["text"] if results else None


def test_the_sandbox_env_reaches_running_and_new_kernels(api: httpx.Client, workdir: Path) -> None:
    """The node writes the sandbox's env once it has one (a claimed warm sandbox: after the kernels
    started); every context picks it up at its next execution, under the execution's own env_vars."""
    env_file = workdir / "sandbox-env.json"
    read = "__import__('os').environ.get('FROM_SANDBOX')"
    assert _value(api, read) is None
    env_file.write_text(json.dumps({"FROM_SANDBOX": "yes"}))
    try:
        assert _value(api, read) == "yes"
        assert _value(api, read, env_vars={"FROM_SANDBOX": "this run"}) == "this run"
        assert _value(api, read) == "yes"  # put back to the sandbox's, not removed
        ctx = api.post("/contexts", json={}).json()["id"]
        try:
            assert _value(api, read, context_id=ctx) == "yes"
        finally:
            api.delete(f"/contexts/{ctx}")
    finally:
        env_file.unlink()
