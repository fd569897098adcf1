"""The root supervisor of the all-in-one node agent (``python -m space.nodesup``).

``space serve`` starts it, as root, before dropping its own privileges (:mod:`space.privdrop`): an
unprivileged parent can neither restart a root node agent nor signal it. The supervisor reads what
to run (one JSON line) on stdin: ``{"argv": [...], "env": {...}, "secrets": {...}}`` (a bare argv list
means no env and no secrets). The node agent gets the ``env`` names :mod:`space.childenv` allows it
and nothing else; ``secrets`` (the object store's credentials) it reads from a pipe whose read end
it inherits as ``--secrets-fd N``, written anew for every start, so that they never sit in any
process's environment. The supervisor runs the node agent, and, once the parent has written a line saying
it is ready, starts it again whenever it exits (at once after a long run, backing off up to 30 s
while it keeps dying young); a node agent that dies before that ends the supervisor with its exit
status, so that a node that cannot start fails ``space serve`` at once. It stops the node agent
(SIGTERM, then SIGKILL after 15 s) and exits when stdin reaches EOF (the server stopping or dying),
on SIGTERM or SIGINT, or when its parent dies (``PR_SET_PDEATHSIG``). The node agent dies with the
supervisor in turn (``--die-with-parent``). Standard library and structlog only: it starts fast and
has nothing to parse but its own parent's one line.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time

import structlog

from space import childenv

log = structlog.get_logger("space.nodesup")

PR_SET_PDEATHSIG = 1
STOP_GRACE = 15.0
#: A node agent that ran this long before exiting is restarted at once.
HEALTHY_RUN = 10.0
MAX_BACKOFF = 30.0
#: The secrets go through a pipe written before the node agent starts: they must fit its buffer.
MAX_SECRETS = 60 * 1024


class Supervisor:
    def __init__(self, argv: list[str], control_fd: int = 0, *, env: dict[str, str] | None = None,
                 secrets: dict[str, dict[str, str]] | None = None) -> None:
        self.argv = argv
        self.env = env or {}
        self.secrets = json.dumps(secrets).encode() if secrets else None
        if self.secrets is not None and len(self.secrets) > MAX_SECRETS:
            raise SystemExit(f"space.nodesup: the node agent's secrets exceed {MAX_SECRETS} bytes")
        self.control_fd = control_fd
        self.stopping = False
        #: The parent saw the node agent answer: from now on an exit is a crash to recover from.
        self.ready = False
        self.sel = selectors.DefaultSelector()

    def run(self) -> int:
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.sel.register(self.control_fd, selectors.EVENT_READ, "control")
        self.sel.register(wake_r, selectors.EVENT_READ, "wake")
        backoff = 0.0
        while not self.stopping:
            started = time.monotonic()
            proc = self._start()
            log.info("node.started", pid=proc.pid)
            pidfd = os.pidfd_open(proc.pid)
            self.sel.register(pidfd, selectors.EVENT_READ, "node")
            try:
                exited = self._wait(None, want_node=True)
            finally:
                self.sel.unregister(pidfd)
                os.close(pidfd)
            if not exited:  # asked to stop
                self._stop(proc)
                break
            code = proc.wait()
            if not self.ready:
                log.error("node.failed_to_start", pid=proc.pid, returncode=code)
                return 128 - code if code < 0 else code or 1  # a signal as a shell reports it
            ran = time.monotonic() - started
            backoff = 0.0 if ran >= HEALTHY_RUN else min(MAX_BACKOFF, max(1.0, backoff * 2))
            log.error("node.exited", pid=proc.pid, returncode=code, ran_s=round(ran, 1), restart_in_s=backoff)
            if backoff:
                self._wait(backoff, want_node=False)
        return 0

    def _start(self) -> subprocess.Popen[bytes]:
        """The node agent, with its allowed environment and, on a fresh pipe, its secrets."""
        argv, fds = list(self.argv), []
        if self.secrets is not None:
            r, w = os.pipe()
            try:
                os.write(w, self.secrets)  # fits the pipe's buffer (MAX_SECRETS): never blocks
            finally:
                os.close(w)
            argv += ["--secrets-fd", str(r)]
            fds.append(r)
        try:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=fds,
                                    env=childenv.build("node", source=self.env))
        finally:
            for fd in fds:
                os.close(fd)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def _wait(self, timeout: float | None, *, want_node: bool) -> bool:
        """Until the node agent exits (True), a stop is asked for or ``timeout`` passes (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.stopping:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            events = {key.data: key.fd for key, _ in self.sel.select(left)}
            # The parent's word first: a "ready" that came with the node agent's exit counts.
            if "control" in events:
                if os.read(self.control_fd, 4096):
                    self.ready = True
                else:
                    self.stopping = True
            if "wake" in events:
                os.read(events["wake"], 4096)
            if "node" in events and want_node and not self.stopping:
                return True
        return False

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                log.warning("node.kill", pid=proc.pid, after_s=STOP_GRACE)
                proc.kill()
                proc.wait()
        log.info("node.stopped", pid=proc.pid, returncode=proc.returncode)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def main() -> None:
    from space import logs

    logs.configure(os.environ.get("SPACE_LOG_LEVEL", "info"))
    _die_with_parent()
    # The parent may have died before prctl: then stdin is at EOF already and nothing starts.
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 1)
        if not chunk:
            return
        line += chunk
    sys.exit(_supervisor(json.loads(line)).run())


def _supervisor(doc: object) -> Supervisor:
    """What the parent's line asks for; SystemExit saying what is wrong with it."""
    if isinstance(doc, list):
        doc = {"argv": doc}
    if not isinstance(doc, dict):
        raise SystemExit("space.nodesup: stdin must start with a JSON object (argv, env, secrets)")
    argv, env, secrets = doc.get("argv"), doc.get("env") or {}, doc.get("secrets") or {}
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise SystemExit("space.nodesup: 'argv' must be a list of strings (the node's argv)")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise SystemExit("space.nodesup: 'env' must map names to strings")
    if not (isinstance(secrets, dict) and all(
            isinstance(group, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in group.items())
            for group in secrets.values())):
        raise SystemExit("space.nodesup: 'secrets' must map groups to {name: string}")
    return Supervisor(argv, env=env, secrets=secrets)


if __name__ == "__main__":
    main()
