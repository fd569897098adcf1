"""The node agent starts its root helper (``python -m space.node.helper``) as a child while it is
still root, waits until it answers, and then talks to it only through :class:`HelperClient`.

The agent stops the helper by closing its end of a pipe (an unprivileged agent cannot signal a root
process) and waits for it: the helper first finishes what the verbs it cancels do on cancellation.
The helper also stops when the agent dies (the pipe closes; ``PR_SET_PDEATHSIG`` and a pidfd back
that up), and the agent exits when the helper dies (:meth:`HelperProcess.wait`): the supervisor
then restarts the agent, which starts a new helper. Sandboxes and the gateway live in their own
sessions and survive both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import structlog

from space import childenv
from space.errors import Unavailable
from space.node.helper.rpc import HelperClient
from space.node.helper.verbs import HelperContext

log = structlog.get_logger(__name__)

#: How long :meth:`HelperProcess.stop` waits for the helper, which first waits for its verbs'
#: cleanup (up to ``rpc.CLOSE_DEADLINE``, but about a second when a launch was cut short).
STOP_GRACE = 10.0


def prepare_socket_dir(d: Path, gid: int) -> None:
    """``d`` a directory of root's, mode 0750, group ``gid``: its parent (the node's socket
    directory) is the agent's, which may have left anything under that name. What is not a
    directory root owns is removed (never followed) and made anew; then owner and mode are set
    through the directory's own descriptor."""
    d.parent.mkdir(parents=True, exist_ok=True)
    parent = os.open(d.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            st = os.stat(d.name, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(d.name, dir_fd=parent)
            elif st.st_uid != 0:
                shutil.rmtree(d.name, dir_fd=parent)  # fd-based: follows no link inside
        except FileNotFoundError:
            pass
        with contextlib.suppress(FileExistsError):
            os.mkdir(d.name, 0o750, dir_fd=parent)
        fd = os.open(d.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            os.fchown(fd, 0, gid)
            os.fchmod(fd, 0o750)
        finally:
            os.close(fd)
    finally:
        os.close(parent)


class HelperProcess:
    def __init__(self, ctx: HelperContext, socket_path: Path, *, agent_uid: int, socket_gid: int) -> None:
        self.ctx = ctx
        self.socket_path = socket_path
        self.agent_uid = agent_uid
        self.socket_gid = socket_gid
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = HelperClient(socket_path)
        #: Our end of the stop pipe: closing it stops the helper.
        self._stop_w: int | None = None

    def argv(self) -> list[str]:
        c = self.ctx
        argv = [sys.executable, "-m", "space.node.helper", "--data-dir", str(c.data_dir),
                "--cache-dir", str(c.cache_dir), "--pool-root", str(c.pool), "--guest-dir", str(c.guest),
                "--gateway-ports", ",".join(map(str, c.gateway_ports)), "--runsc", c.runsc,
                "--socket", str(self.socket_path), "--agent-uid", str(self.agent_uid),
                "--socket-group", str(self.socket_gid), "--parent-pid", str(os.getpid()),
                "--sandbox-network", str(c.sandbox_network)]
        # Root may call too: the agent pings it before dropping, and root gains nothing by it.
        argv.append("--allow-root")
        if c.gateway is not None:
            argv += ["--gateway-config", json.dumps(c.gateway.to_json())]
        for mirror in c.mirrors:
            argv += ["--mirror", mirror]
        for registry in c.registries:
            argv += ["--registry", registry]
        argv += ["--build-max-bytes", str(c.build_max_bytes)]
        if c.image_policy is not None:
            argv += ["--image-policy", str(c.image_policy)]
        if c.signatures is not None:
            argv += ["--signatures", str(c.signatures)]
        return argv

    async def start(self, *, timeout: float = 30.0) -> HelperClient:
        """Start the helper and return its client once it answers ``helper.ping``."""
        prepare_socket_dir(self.socket_path.parent, self.socket_gid)
        stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        try:
            self.proc = subprocess.Popen([*self.argv(), "--stop-fd", str(stop_r)],  # noqa: ASYNC220
                                         stdin=subprocess.DEVNULL, cwd="/", pass_fds=(stop_r,),
                                         env=childenv.build("helper"))
        finally:
            os.close(stop_r)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise Unavailable(f"the root helper exited at start (exit {self.proc.returncode})")
            if self.socket_path.exists():
                with contextlib.suppress(Unavailable):
                    res = await self.client.call("helper.ping", timeout=5)
                    log.info("helper.ready", pid=res["pid"], verbs=len(res["verbs"]))
                    return self.client
            if loop.time() > deadline:
                await self.stop()
                raise Unavailable(f"the root helper did not answer within {timeout:g}s")
            await asyncio.sleep(0.02)

    async def wait(self) -> int:
        """Until the helper exits; its exit code."""
        assert self.proc is not None
        proc = self.proc
        while (code := proc.poll()) is None:
            await asyncio.sleep(0.5)
        return code

    async def stop(self) -> None:
        """Ask the helper to stop and wait until it has exited (a parent may wait for a child of
        another uid, though it may not signal it)."""
        if self._stop_w is not None:
            os.close(self._stop_w)
            self._stop_w = None
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), STOP_GRACE)
        except TimeoutError:
            log.warning("helper.stop_overdue", pid=proc.pid, after_s=STOP_GRACE)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                proc.kill()
