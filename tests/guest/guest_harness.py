"""Run the guest daemon behind the real shim: as a host child process, or as PID 1 under runsc.

Shared by the tests in this directory and by ``bench/guest_bench.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from space.node.sandboxes.guest_client import GuestConnection
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
GUEST_DIR = REPO / "space" / "guest"
DAEMON = GUEST_DIR / "daemon.py"
RUNSC_FLAGS = ["--platform=systrap", "--overlay2=none", "--network=none"]


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class _Channel:
    """The guest's two pipes, with the host ends held by a shim process."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.socket = str(workdir / "guest.sock")
        self.pidfile = workdir / "shim.pid"
        self.shim: subprocess.Popen[bytes] | None = None
        self.to_r, self.to_w = os.pipe()
        self.from_r, self.from_w = os.pipe()

    def start_shim(self) -> None:
        env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        with open(self.workdir / "shim.log", "ab") as log:
            self.shim = subprocess.Popen(
                [sys.executable, "-m", "space.runtime.shim", "--socket", self.socket,
                 "--to-guest-fd", str(self.to_w), "--from-guest-fd", str(self.from_r),
                 "--pidfile", str(self.pidfile)],
                pass_fds=(self.to_w, self.from_r), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log, env=env, cwd="/")

    def close_fds(self) -> None:
        for fd in (self.to_r, self.to_w, self.from_r, self.from_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def stop_shim(self) -> None:
        if self.shim is not None and self.shim.poll() is None:
            self.shim.send_signal(signal.SIGTERM)
        if self.shim is not None:
            _wait(self.shim, 10)


#: Starts the daemon from the state runsc gives PID 1 (every disposition default, nothing blocked),
#: then the way a parent that ignores or blocks signals would (``nohup``, ``cmd &`` in a
#: non-interactive shell, CI runners): dispositions set to SIG_IGN and the signal mask survive exec.
#: The reset is a raw rt_sigaction: GNU make starts its recipes with glibc's own signals (32 and 33)
#: ignored, and no libc call, so no Python code (the daemon's included), can change those.
_INHERIT_SIGNALS = (
    "import ctypes, os, signal, sys; ignore, block = sys.argv[1], sys.argv[2]\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "dfl = (ctypes.c_ulong * 4)()  # struct kernel_sigaction {handler=SIG_DFL, flags, restorer, mask}\n"
    "for s in range(1, 65):\n"
    "    if s not in (signal.SIGKILL, signal.SIGSTOP): libc.syscall(13, s, dfl, None, 8)  # x86_64 rt_sigaction\n"
    "signal.pthread_sigmask(signal.SIG_SETMASK, [])\n"
    "for s in filter(None, ignore.split(',')): signal.signal(int(s), signal.SIG_IGN)\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, [int(s) for s in filter(None, block.split(','))])\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])\n"
)


class HostGuest:
    """daemon.py as a plain child process of the test (not PID 1), stdio pipes held by the shim.

    ``ignored`` / ``blocked``: signals the daemon inherits as ignored / blocked from its parent."""

    def __init__(self, env: dict[str, str] | None = None, *, ignored: tuple[int, ...] = (),
                 blocked: tuple[int, ...] = ()) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="guestd-"))
        self.chan = _Channel(self.workdir)
        self.daemon: subprocess.Popen[bytes] | None = None
        self.env = {**os.environ, **(env or {})}
        self.ignored = ignored
        self.blocked = blocked

    @property
    def socket(self) -> str:
        return self.chan.socket

    def start(self) -> HostGuest:
        try:
            with open(self.workdir / "guest.log", "ab") as log:
                argv = [sys.executable, "-c", _INHERIT_SIGNALS, ",".join(map(str, self.ignored)),
                        ",".join(map(str, self.blocked)), "-I", "-S", str(DAEMON)]
                self.daemon = subprocess.Popen(
                    argv, stdin=self.chan.to_r,
                    stdout=self.chan.from_w, stderr=log, cwd="/", env=self.env)
            self.chan.start_shim()
        finally:
            self.chan.close_fds()
        return self

    def stop(self) -> None:
        # The shim's exit closes the daemon's stdin; a non-PID-1 daemon then kills its commands and exits.
        self.chan.stop_shim()
        if self.daemon is not None:
            _wait(self.daemon, 10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def runtime_skip_reason(template: Path | None = None) -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("runsc", "btrfs"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    if template is not None and not (template / "usr" / "bin" / "python3").exists():
        return f"template rootfs {template} missing"
    return None


@contextlib.asynccontextmanager
async def connected(socket: str, timeout: float) -> AsyncIterator[GuestConnection]:
    """A GuestConnection to ``socket`` (ready: hello answered), closed on exit."""
    conn = await GuestConnection.connect(socket, timeout=timeout)
    try:
        yield conn
    finally:
        await conn.close()


class RunscGuest:
    """daemon.py as PID 1 of a real runsc sandbox on a btrfs snapshot of ``template`` (a read-only
    subvolume), the snapshot made in ``scratch`` (a directory on the same btrfs filesystem)."""

    def __init__(self, template: Path, scratch: Path) -> None:
        token = uuid.uuid4().hex[:12]
        self.id = f"guestd-{token}"
        self.template = template
        self.workdir = Path(tempfile.mkdtemp(prefix="guestd-"))
        self.root = self.workdir / "runsc"
        self.rootfs = scratch / f"guestd-{token}"
        self.chan = _Channel(self.workdir)
        self.created = False

    @property
    def socket(self) -> str:
        return self.chan.socket

    def runsc(self, *args: str, check: bool = True,
              timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["runsc", f"--root={self.root}", *RUNSC_FLAGS, *args], check=check,
                              capture_output=True, timeout=timeout)

    def spec(self) -> dict[str, object]:
        return {
            "ociVersion": "1.0.2",
            "process": {"terminal": False, "cwd": "/", "user": {"uid": 0, "gid": 0},
                        "args": ["/usr/bin/python3", "-I", "-S", "/opt/space/guest/daemon.py"],
                        "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
            "root": {"path": str(self.rootfs), "readonly": False},
            "hostname": "guestd",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                 "options": ["nosuid", "mode=755"]},
                {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
                 "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
                {"destination": "/sys", "type": "sysfs", "source": "sysfs",
                 "options": ["nosuid", "noexec", "nodev", "ro"]},
                {"destination": "/opt/space/guest", "type": "bind", "source": str(GUEST_DIR),
                 "options": ["rbind", "ro"]},
            ],
            "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
        }

    def start(self) -> RunscGuest:
        self.root.mkdir()
        subprocess.run(["btrfs", "subvolume", "snapshot", str(self.template), str(self.rootfs)], check=True,
                       capture_output=True)
        bundle = self.workdir / "bundle"
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(self.spec()))
        try:
            self.chan.start_shim()
            with open(self.workdir / "guest.log", "ab") as log:
                rc = subprocess.run(
                    ["runsc", f"--root={self.root}", *RUNSC_FLAGS, "run", "--detach", "--bundle",
                     str(bundle), self.id],
                    stdin=self.chan.to_r, stdout=self.chan.from_w, stderr=log, timeout=60).returncode
            self.created = True
            if rc != 0:
                raise RuntimeError(f"runsc run failed ({rc}): {self.log()[-2000:]}")
        finally:
            self.chan.close_fds()
        return self

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "guest.log").read_text(errors="replace")
        return ""

    def stop(self) -> None:
        if self.created:
            self.runsc("delete", "-force", self.id, check=False)
        self.chan.stop_shim()
        if self.rootfs.exists():
            # The sandbox's gofer may still hold the root for a moment.
            wait_for(lambda: subprocess.run(["btrfs", "subvolume", "delete", str(self.rootfs)],
                                            capture_output=True).returncode == 0,
                     5, f"btrfs to release {self.rootfs}", interval=0.1)
        shutil.rmtree(self.workdir, ignore_errors=True)
