"""The code interpreter's server: runs inside a sandbox of template ``code-interpreter-v1`` and
speaks, on port 49999, the HTTP protocol of the ``e2b-code-interpreter`` SDK over IPython kernels.

It is standalone: the template's system python runs it as a script with only ipykernel's own
dependencies (tornado for HTTP, jupyter_client for the kernels, no Jupyter server), never the
``space`` package; so it logs with the standard library, one line per event, to the start log.

Protocol (as the SDK sends and parses it):

``POST /execute`` ``{code, context_id?, language?, env_vars?}`` answers 200 and streams
newline-delimited JSON objects as the kernel's iopub messages arrive, each flushed on its own:
``stdout``/``stderr`` ``{text, timestamp}``, ``result`` (``text, html, markdown, svg, png, jpeg, pdf,
latex, json, javascript, data, chart, extra, is_main_result``), ``error`` ``{name, value, traceback}``,
``number_of_executions`` ``{execution_count}``, ``keepalive`` while the kernel is quiet, and last
``end_of_execution``. A failing cell is an ``error`` line, not an HTTP error; so is a kernel that dies
mid-execution (the context is restarted: its state is lost) and a context restarted or removed under
it. An unknown context is 404 (the SDK's NotFoundException); an unsupported language or a bad body
400. A client that leaves mid-execution has its cell interrupted (the kernel restarted if that fails).
``env_vars`` hold for that one execution (set and restored by silent executions around it).

``POST /contexts`` ``{language?, cwd?}`` -> ``{id, language, cwd}``, a new kernel; ``GET /contexts``;
``DELETE /contexts/{id}``; ``POST /contexts/{id}/restart``; ``GET /health``.

One kernel per context, one execution at a time per context (others queue); contexts run in
parallel. The default Python context (cwd ``/home/user``) is started before the port opens, so a
sandbox whose ready check is this port runs code at once. Kernels are child processes, so they run
as whoever runs this server: the template's user.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import signal
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

import tornado.httpserver
import tornado.iostream
import tornado.web
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager

PORT: Final = 49999
DEFAULT_CWD: Final = "/home/user"
LANGUAGES: Final = ("python",)
#: How often a quiet wait checks that the kernel lives and the client is still there.
POLL_S: Final = 1.0
#: A line every so often while the kernel is quiet: a client (or proxy) that left is noticed by
#: the failed write, and idle timeouts in between do not cut a long computation.
KEEPALIVE_S: Final = 5.0
#: After a client left, how long its interrupted cell may take to stop before the kernel restarts.
INTERRUPT_GRACE_S: Final = 10.0
#: How long the execute_reply may lag the kernel's idle status.
REPLY_WAIT_S: Final = 5.0
KERNEL_READY_S: Final = 60.0

log = logging.getLogger("code-interpreter")

Emit = Callable[[dict[str, Any]], Awaitable[None]]


class RequestError(Exception):
    """An HTTP error answer: status and a plain-text message (the SDK shows the text)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def normalize_language(language: Any) -> str:
    if language is None or (isinstance(language, str) and not language.strip()):
        return "python"
    if not isinstance(language, str):
        raise RequestError(400, "language must be a string")
    lang = language.strip().lower()
    if lang not in LANGUAGES:
        raise RequestError(400, f"language {language!r} is not supported here (supported: {', '.join(LANGUAGES)})")
    return lang


def to_result(data: dict[str, Any], *, is_main_result: bool) -> dict[str, Any]:
    """A ``result`` line from a display_data or execute_result bundle (MIME type -> data)."""
    data = dict(data)
    text = data.pop("text/plain", None)
    # The SDK's users expect the text of a string result without its repr quotes (E2B's server
    # strips them, so ``run_code("'a'").text == "a"``).
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    out: dict[str, Any] = {"type": "result", "text": text}
    for key, mime in (("html", "text/html"), ("markdown", "text/markdown"), ("svg", "image/svg+xml"),
                      ("png", "image/png"), ("jpeg", "image/jpeg"), ("pdf", "application/pdf"),
                      ("latex", "text/latex"), ("json", "application/json"),
                      ("javascript", "application/javascript"), ("data", "e2b/data"), ("chart", "e2b/chart")):
        value = data.pop(mime, None)
        if value is not None:
            out[key] = value
    out["extra"] = data
    out["is_main_result"] = is_main_result
    return out


def error_line(name: str, value: str, traceback: str = "") -> dict[str, Any]:
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


def _timestamp(header: dict[str, Any]) -> str:
    date = header.get("date")
    if isinstance(date, datetime.datetime):
        return date.isoformat()
    return str(date) if date else datetime.datetime.now(datetime.UTC).isoformat()


#: The sandbox's own environment, as SPACE's node writes it once the sandbox has one (at its
#: create, or when it is claimed from the warm pool: after this server and its first kernel
#: started). E2B's server asks envd for the same (``GET /envs``).
sandbox_env_file = "/run/space/env.json"


def read_sandbox_env() -> tuple[str, dict[str, str]] | None:
    """The sandbox's environment file (its text, to tell a new one) and its variables; None when
    there is none or it is not a JSON object of strings."""
    try:
        with open(sandbox_env_file, encoding="utf-8") as f:
            text = f.read()
        env = json.loads(text)
    except (OSError, ValueError):
        return None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        log.warning("ignoring %s: not a JSON object of strings", sandbox_env_file)
        return None
    return text, env


def _env_code(env: dict[str, str]) -> tuple[str, str]:
    """Code that sets ``env`` in the kernel remembering what was there, and code that puts it back.

    Separate silent executions (not the user's cell: its line numbers and execution count stay
    its own); ``repr`` makes literals of arbitrary strings."""
    keys = sorted(env)
    apply = (f"__space_env_saved__ = {{k: __import__('os').environ.get(k) for k in {keys!r}}}\n"
             f"__import__('os').environ.update({env!r})")
    restore = ("for __space_k__, __space_v__ in __space_env_saved__.items():\n"
               "    if __space_v__ is None: __import__('os').environ.pop(__space_k__, None)\n"
               "    else: __import__('os').environ[__space_k__] = __space_v__\n"
               "del __space_env_saved__, __space_k__, __space_v__")
    return apply, restore


class Connection:
    """A client of a context's kernel. Tasks of its own read the iopub and shell channels into
    queues (only the messages of the execution being waited for), so a restart can close it at
    any time: a reader waiting on a queue is woken by a ``None``, never cancelled."""

    def __init__(self, kc: AsyncKernelClient) -> None:
        self.kc = kc
        self.iopub: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.shell: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        #: The msg_id whose messages are queued; the rest (housekeeping, an abandoned cell) drop.
        self.wanted: str | None = None
        self._tasks = [asyncio.create_task(self._pump(kc.get_iopub_msg, self.iopub)),
                       asyncio.create_task(self._pump(kc.get_shell_msg, self.shell))]

    async def _pump(self, get: Callable[[], Awaitable[dict[str, Any]]],
                    q: asyncio.Queue[dict[str, Any] | None]) -> None:
        try:
            while True:
                msg = await get()
                if self.wanted is not None and msg.get("parent_header", {}).get("msg_id") == self.wanted:
                    q.put_nowait(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("kernel channel read failed: %r", exc)
        finally:
            q.put_nowait(None)

    def execute(self, code: str, *, silent: bool) -> str:
        # stop_on_error would abort what is queued behind a failing cell: nothing is (one execution
        # at a time) but our own housekeeping, which must not be aborted.
        msg_id: str = self.kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False,
                                      stop_on_error=False)
        # Set before the next await: the pumps cannot have seen a message of it yet.
        self.wanted = msg_id
        for q in (self.iopub, self.shell):
            while not q.empty():
                q.get_nowait()
        return msg_id

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.kc.stop_channels()


class Context:
    """A context: one IPython kernel with its working directory."""

    def __init__(self, language: str, cwd: str, runtime_dir: str) -> None:
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        # Named, or jupyter_client makes a temp file in /tmp for it: the server's, not the user's.
        self.km = AsyncKernelManager(kernel_name="python3",
                                     connection_file=os.path.join(runtime_dir, f"kernel-{self.id}.json"))
        self.conn: Connection | None = None
        #: One execution at a time.
        self.lock = asyncio.Lock()
        #: Bumped by every restart: an execution that sees it change was cut off.
        self.generation = 0
        #: Set while the context is usable or removed; cleared while it restarts.
        self.ready = asyncio.Event()
        self.removed = False
        self._restarting = asyncio.Lock()
        #: (generation, file text) of the sandbox environment this context's kernel has.
        self.sandbox_env: tuple[int, str] | None = None

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self) -> None:
        await self.km.start_kernel(cwd=self.cwd)
        await self._connect()
        log.info("context %s started (kernel pid %s, cwd %s)", self.id, self._pid(), self.cwd)

    def _pid(self) -> Any:
        return getattr(self.km.provisioner, "pid", None)

    async def _connect(self) -> None:
        kc = self.km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=KERNEL_READY_S)
        except BaseException:
            kc.stop_channels()
            raise
        self.conn = Connection(kc)
        self.ready.set()

    async def _disconnect(self) -> None:
        self.generation += 1
        self.ready.clear()
        conn, self.conn = self.conn, None
        if conn is not None:
            await conn.close()

    async def restart(self, why: str) -> None:
        """A fresh kernel (same cwd); a running execution ends with a ``ContextRestarting`` error."""
        async with self._restarting:
            await self._disconnect()
            log.info("context %s restarting: %s", self.id, why)
            try:
                await self.km.restart_kernel(now=True)
                await self._connect()
            finally:
                # Even when it failed: executions waiting for it must not wait forever (they find
                # no connection and say so; another restart may do better).
                self.ready.set()
            log.info("context %s restarted (kernel pid %s)", self.id, self._pid())

    async def shutdown(self) -> None:
        self.removed = True
        await self._disconnect()
        self.ready.set()  # wakes executions queued behind it: they answer 404
        with contextlib.suppress(Exception):
            await self.km.shutdown_kernel(now=True)

    async def execute(self, code: str, env: dict[str, str] | None, emit: Emit, gone: asyncio.Event) -> None:
        """Run ``code``, emitting its output lines; returns once the kernel is idle again (or the
        kernel died, the context restarted, or the client left and the cell was stopped)."""
        async with self.lock:
            if gone.is_set():
                return
            await self.ready.wait()
            if self.removed:  # while this waited; nothing was sent yet
                raise RequestError(404, f"Context {self.id} not found")
            generation = self.generation
            found = read_sandbox_env()
            if found is not None and self.sandbox_env != (generation, found[0]):
                # The sandbox's own variables, for good (a kernel started before it had them);
                # the execution's own go on top and are put back after it.
                failed = await self._silent(f"__import__('os').environ.update({found[1]!r})", gone)
                if failed is not None:
                    await emit(failed)
                    return
                self.sandbox_env = (generation, found[0])
            if env:
                apply, restore = _env_code(env)
                failed = await self._silent(apply, gone)
                if failed is not None:
                    await emit(failed)
                    return
            try:
                await self._run(code, emit, gone)
            finally:
                if env and self.generation == generation:  # a restarted kernel has none of it
                    await self._silent(restore, asyncio.Event())

    async def _silent(self, code: str, gone: asyncio.Event) -> dict[str, Any] | None:
        """Run server-side housekeeping code quietly; an error line if it failed."""
        found: list[dict[str, Any]] = []

        async def keep_errors(line: dict[str, Any]) -> None:
            if line["type"] == "error":
                found.append(line)

        await self._run(code, keep_errors, gone, silent=True)
        if found:
            log.warning("context %s: housekeeping code failed: %s", self.id, found[0])
        return found[0] if found else None

    async def _run(self, code: str, emit: Emit, gone: asyncio.Event, *, silent: bool = False) -> None:
        conn, generation = self.conn, self.generation
        if conn is None:
            await emit(error_line("ContextRestarting", "the context has no kernel: its restart failed; "
                                  "restart it again or create another"))
            return
        loop = asyncio.get_running_loop()
        conn.execute(code, silent=silent)
        errored = False
        quiet_since = loop.time()
        interrupted_at: float | None = None
        while True:
            if self.generation != generation:
                what = "removed" if self.removed else "restarted"
                await emit(error_line("ContextRestarting", f"the context was {what} during the execution"))
                return
            if gone.is_set() and interrupted_at is None:
                # The client left: stop the cell so the next execution is not stuck behind it.
                interrupted_at = loop.time()
                log.info("context %s: client left during an execution, interrupting", self.id)
                with contextlib.suppress(Exception):
                    await self.km.interrupt_kernel()
            if interrupted_at is not None and loop.time() - interrupted_at > INTERRUPT_GRACE_S:
                await self.restart("an abandoned execution did not stop when interrupted")
                return
            try:
                msg = await asyncio.wait_for(conn.iopub.get(), POLL_S)
            except TimeoutError:
                if not await self.km.is_alive():
                    await emit(error_line("DeadKernelError", "the kernel died during the execution; the context "
                                          "was restarted and its state is lost"))
                    await self.restart("its kernel died")
                    return
                if loop.time() - quiet_since >= KEEPALIVE_S:
                    quiet_since = loop.time()
                    await emit({"type": "keepalive"})
                continue
            if msg is None:  # the connection closed: a restart (checked above), else a broken channel
                if self.generation == generation:
                    await emit(error_line("DeadKernelError", "the connection to the kernel was lost; the context "
                                          "was restarted and its state is lost"))
                    await self.restart("its connection broke")
                continue
            quiet_since = loop.time()
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                name = content.get("name")
                if name in ("stdout", "stderr"):
                    await emit({"type": name, "text": content.get("text", ""), "timestamp": _timestamp(msg["header"])})
            elif kind == "execute_input":
                await emit({"type": "number_of_executions", "execution_count": content.get("execution_count")})
            elif kind in ("execute_result", "display_data"):
                await emit(to_result(content.get("data", {}), is_main_result=kind == "execute_result"))
            elif kind == "error" and not errored:
                errored = True
                await emit(error_line(content.get("ename", ""), content.get("evalue", ""),
                                      "\n".join(content.get("traceback", []))))
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        reply = await self._reply(conn)
        status = reply.get("status")
        if status == "error" and not errored:
            await emit(error_line(reply.get("ename", ""), reply.get("evalue", ""),
                                  "\n".join(reply.get("traceback", []))))
        elif status == "aborted":
            await emit(error_line("ExecutionAborted", "the execution was aborted"))

    async def _reply(self, conn: Connection) -> dict[str, Any]:
        """The execute_reply's content (sent before the idle status, so about to arrive), or {}."""
        with contextlib.suppress(TimeoutError):
            msg = await asyncio.wait_for(conn.shell.get(), REPLY_WAIT_S)
            if msg is not None:
                content: dict[str, Any] = msg["content"]
                return content
        log.warning("context %s: no execute_reply for %s", self.id, conn.wanted)
        return {}


class Interpreter:
    """The contexts, and which one is the default for Python."""

    def __init__(self, default_cwd: str, runtime_dir: str) -> None:
        self.default_cwd = default_cwd
        #: Where the kernels' connection files go (they hold the kernels' keys): private to us.
        self.runtime_dir = runtime_dir
        self.contexts: dict[str, Context] = {}
        self.default_id: str | None = None
        self._default_lock = asyncio.Lock()

    async def create(self, language: str, cwd: str) -> Context:
        if not os.path.isabs(cwd):
            raise RequestError(400, f"cwd must be an absolute path, not {cwd!r}")
        if not os.path.isdir(cwd):  # noqa: ASYNC240 -- one stat, not worth a thread
            raise RequestError(400, f"cwd {cwd} is not a directory")
        ctx = Context(language, cwd, self.runtime_dir)
        try:
            await ctx.start()
        except Exception as exc:
            log.exception("context %s: its kernel did not start", ctx.id)
            await ctx.shutdown()
            raise RequestError(500, f"the kernel did not start: {exc}") from exc
        self.contexts[ctx.id] = ctx
        return ctx

    async def default(self) -> Context:
        async with self._default_lock:
            ctx = self.contexts.get(self.default_id or "")
            if ctx is None:  # never made, or deleted: a new one
                ctx = await self.create("python", self.default_cwd)
                self.default_id = ctx.id
            return ctx

    def get(self, context_id: str) -> Context:
        ctx = self.contexts.get(context_id)
        if ctx is None:
            raise RequestError(404, f"Context {context_id} not found")
        return ctx

    async def remove(self, context_id: str) -> None:
        ctx = self.get(context_id)
        del self.contexts[context_id]
        await ctx.shutdown()
        log.info("context %s removed", context_id)

    async def close(self) -> None:
        contexts, self.contexts = list(self.contexts.values()), {}
        await asyncio.gather(*(c.shutdown() for c in contexts), return_exceptions=True)


# -- HTTP ---------------------------------------------------------------------------------------------


class Handler(tornado.web.RequestHandler):
    interp: Interpreter

    def initialize(self, interp: Interpreter) -> None:
        self.interp = interp

    def body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            doc = json.loads(self.request.body)
        except ValueError:
            raise RequestError(400, "the body is not JSON") from None
        if not isinstance(doc, dict):
            raise RequestError(400, "the body must be a JSON object")
        return doc

    def answer(self, value: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(value))

    async def _guarded(self, method: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await method(*args)
        except RequestError as exc:
            self.set_status(exc.status)
            self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.finish(exc.message)


class Health(Handler):
    def get(self) -> None:
        self.answer("OK")


class Execute(Handler):
    gone: asyncio.Event

    def prepare(self) -> None:
        self.gone = asyncio.Event()

    def on_connection_close(self) -> None:
        self.gone.set()

    async def post(self) -> None:
        await self._guarded(self._post)

    async def _post(self) -> None:
        doc = self.body()
        code, context_id, env = doc.get("code"), doc.get("context_id"), doc.get("env_vars")
        if not isinstance(code, str):
            raise RequestError(400, "code must be a string")
        if context_id is not None and not isinstance(context_id, str):
            raise RequestError(400, "context_id must be a string")
        if env is not None and (not isinstance(env, dict)
                                or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise RequestError(400, "env_vars must map names to strings")
        if context_id and doc.get("language"):
            raise RequestError(400, "Only one of context_id or language can be provided")
        if context_id:
            ctx = self.interp.get(context_id)
        else:
            normalize_language(doc.get("language"))
            ctx = await self.interp.default()
        self.set_header("Content-Type", "application/x-ndjson")
        await ctx.execute(code, env or None, self.emit, self.gone)
        await self.emit({"type": "end_of_execution"})
        if not self.gone.is_set():
            with contextlib.suppress(tornado.iostream.StreamClosedError):
                await self.finish()

    async def emit(self, line: dict[str, Any]) -> None:
        if self.gone.is_set():
            return
        self.write(json.dumps(line) + "\n")
        try:
            await self.flush()
        except tornado.iostream.StreamClosedError:
            self.gone.set()


class Contexts(Handler):
    async def post(self) -> None:
        await self._guarded(self._post)

    async def _post(self) -> None:
        doc = self.body()
        language = normalize_language(doc.get("language"))
        cwd = doc.get("cwd") or self.interp.default_cwd
        if not isinstance(cwd, str):
            raise RequestError(400, "cwd must be a string")
        ctx = await self.interp.create(language, cwd)
        self.answer(ctx.describe())

    def get(self) -> None:
        self.answer([c.describe() for c in self.interp.contexts.values()])


class OneContext(Handler):
    async def delete(self, context_id: str) -> None:
        await self._guarded(self._delete, context_id)

    async def _delete(self, context_id: str) -> None:
        await self.interp.remove(context_id)
        self.answer(None)


class Restart(Handler):
    async def post(self, context_id: str) -> None:
        await self._guarded(self._post, context_id)

    async def _post(self, context_id: str) -> None:
        await self.interp.get(context_id).restart("asked to")
        self.answer(None)


def make_app(interp: Interpreter) -> tornado.web.Application:
    args = {"interp": interp}
    return tornado.web.Application([
        (r"/health", Health, args),
        (r"/execute", Execute, args),
        (r"/contexts", Contexts, args),
        (r"/contexts/([^/]+)", OneContext, args),
        (r"/contexts/([^/]+)/restart", Restart, args),
    ])


async def serve(host: str, port: int, default_cwd: str) -> None:
    interp = Interpreter(default_cwd, tempfile.mkdtemp(prefix="code-interpreter-"))  # mode 0700
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        # Before the port opens: a sandbox whose ready check is the port runs code at once.
        log.info("starting the default context")
        await interp.default()
        server = tornado.httpserver.HTTPServer(make_app(interp))
        server.listen(port, address=host)
        log.info("listening on %s:%d", host, port)
        await stop.wait()
        server.stop()
    finally:
        await interp.close()
        with contextlib.suppress(OSError):
            os.rmdir(interp.runtime_dir)


def main(argv: list[str] | None = None) -> None:
    global sandbox_env_file
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--cwd", default=DEFAULT_CWD, help="working directory of the default context")
    p.add_argument("--sandbox-env-file", default=sandbox_env_file,
                   help="where the sandbox's own environment is (JSON), once it has one")
    args = p.parse_args(argv)
    sandbox_env_file = args.sandbox_env_file
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve(args.host, args.port, args.cwd))


if __name__ == "__main__":
    main()
