"""The node agent's side of the egress gateway: keep the gateway process running, and talk to it.

The gateway (``python -m space.gateway``, run from its own virtualenv because mitmproxy pins
libraries the node agent needs newer) listens on the node's gateway address. Like a sandbox's shim
it lives in its own session, so a restarted node agent finds it still running, with its open
connections and the secrets it holds, and adopts it through its pid file and control socket.

It parses the sandboxes' traffic, so it gets no environment but a ``PATH`` (nothing of the
node's settings or secrets: :func:`space.childenv.build`) and runs as its own system user
(``space-gw``, made by ``scripts/setup-system.sh``) when the agent is root: dropped in the child
before exec (no supplementary groups, real/effective/saved ids, no capabilities, NoNewPrivs),
checked in ``/proc/<pid>/status`` once it runs. Nothing it does needs privileges: DNS listens on a
high port (``GatewayPorts.dns``; nftables redirects the sandboxes' port 53 to it).

``<data>`` is closed to that user (0710 root:space), so the gateway reaches what it needs through
descriptors the agent opens and hands over: its control socket already listening (0660, group
``control_group``), its journal and CA directories as ``/proc/self/fd/N`` paths (a magic link is
followed without searching the directories above it), and the test-only input files. It owns
``<data>/gateway/`` (0700) and the CA directory (0711; key 0600, certificate 0644). The agent's own
files there (log, pid, version) are written without following links: the gateway could plant them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import pwd
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from space import childenv
from space.errors import Unavailable
from space.node import unixsock
from space.node.network.gateway_client import GatewayClient

if TYPE_CHECKING:
    from space.node.helper.backend import Privileged
    from space.privdrop import ServiceUser

log = structlog.get_logger(__name__)

PIDFILE = "gateway.pid"
VERSIONFILE = "gateway.version"
LOGFILE = "gateway.log"
#: The system user the gateway runs as (``scripts/setup-system.sh`` creates it, group of the same name).
GATEWAY_USER = "space-gw"
CREATE_USER = f"useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {GATEWAY_USER}"

_O_NOFOLLOW_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a planted FIFO never blocks


def code_version() -> str:
    """A digest of the gateway's code: a running gateway of other code (an upgrade) is replaced."""
    import hashlib

    import space.egress_policy as rules
    import space.gateway as pkg

    h = hashlib.sha256()
    for f in [*sorted(Path(pkg.__file__).parent.glob("*.py")), Path(rules.__file__)]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def default_python() -> Path:
    """The gateway's interpreter: ``.venv-gateway`` next to the node agent's own virtualenv."""
    override = os.environ.get("SPACE_GATEWAY_PYTHON")
    if override:
        return Path(override)
    return Path(sys.prefix).parent / ".venv-gateway" / "bin" / "python"


def gateway_user(name: str | None = GATEWAY_USER) -> ServiceUser | None:
    """The user to run the gateway as; None to run it as the agent itself (the agent is not root,
    ``name`` is None or root, or the user does not exist: that one is logged)."""
    if name is None or os.geteuid() != 0:
        return None
    from space.privdrop import ServiceUser

    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        log.warning("gateway.unprivileged_user_missing", user=name, fix=CREATE_USER,
                    hint="the egress gateway parses sandbox traffic as root; `make setup` creates the user")
        return None
    if pw.pw_uid == 0:
        return None
    return ServiceUser(name=name, uid=pw.pw_uid, gid=pw.pw_gid, home=pw.pw_dir)


def proc_status(pid: int) -> dict[str, str]:
    """``/proc/<pid>/status`` as {field: value}; empty when the process is gone."""
    out: dict[str, str] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def dropped_problems(status: dict[str, str], user: ServiceUser) -> list[str]:
    """What about a process (its ``/proc/<pid>/status``) shows it is not ``user`` with no way back."""
    problems = []
    for key, want in (("Uid", user.uid), ("Gid", user.gid)):
        ids = status.get(key, "").split()
        if len(ids) != 4 or any(int(i) != want for i in ids):
            problems.append(f"{key} {ids} (want {want})")
    if set(status.get("Groups", "").split()) - {str(user.gid)}:
        problems.append(f"Groups {status.get('Groups')}")
    for key in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        if int(status.get(key, "0"), 16):
            problems.append(f"{key} {status[key]}")
    if status.get("NoNewPrivs") != "1":
        problems.append(f"NoNewPrivs {status.get('NoNewPrivs')}")
    return problems


def unprivileged_port_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    except (OSError, ValueError):
        return 1024


def _no_new_privs_fn() -> Callable[[], None]:
    """The child's last step before exec (after the uid switch): no exec may grant privileges.
    The libc function is looked up here, in the parent: the child only makes the call."""
    from space.privdrop import PR_SET_NO_NEW_PRIVS

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def no_new_privs() -> None:
        if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")

    return no_new_privs


class GatewayHandle:
    """The agent's view of the node's gateway: its control socket, its CA, and the helper's
    ``gateway.*`` verbs to start, watch and stop it (the helper runs the process)."""

    def __init__(self, priv: Privileged, control: Path, ca_dir: Path) -> None:
        self.priv = priv
        self.control = control
        self.ca_dir = ca_dir
        self.client = GatewayClient(control)
        self.pid: int | None = None

    async def ensure(self) -> None:
        await self.client.close()  # a restarted gateway listens on a new socket
        self.pid = (await self.priv.call("gateway.ensure"))["pid"]

    async def alive(self) -> bool:
        return bool((await self.priv.call("gateway.alive"))["alive"])

    async def stop(self) -> None:
        await self.client.close()
        await self.priv.call("gateway.stop")
        self.pid = None


class GatewayProcess:
    """Start the node's gateway or adopt the one already running; restart it if it dies.

    ``user``: the system user to run it as (None: as the agent). ``control_group``: the group that
    may connect to the control socket (default: the agent's own group).
    """

    def __init__(self, work_dir: Path, control: Path, *, address: str, proxy_port: int,
                 transparent_port: int, dns_port: int, ca_dir: Path, python: Path | None = None,
                 hosts_file: Path | None = None, upstream_dns: str | None = None,
                 upstream_ca: Path | None = None, user: str | None = GATEWAY_USER,
                 control_group: int | None = None, sandbox_networks: tuple[str, ...] = (),
                 private_ceiling: tuple[str, ...] = ()) -> None:
        self.work_dir = work_dir
        self.control = control
        self.address = address
        self.ports = (proxy_port, transparent_port, dns_port)
        self.ca_dir = ca_dir
        self.python = python or default_python()
        self.hosts_file = hosts_file
        self.upstream_dns = upstream_dns
        self.upstream_ca = upstream_ca
        #: Never destinations (every sandbox range of the host); the private ranges policies may open.
        self.sandbox_networks = sandbox_networks
        self.private_ceiling = private_ceiling
        self.run_as = gateway_user(user)
        self.control_group = control_group
        self.client = GatewayClient(control)
        self.pid: int | None = None

    def argv(self, fds: dict[str, int]) -> list[str]:
        """The gateway's command line; ``fds``: the descriptors it inherits (:meth:`_open_inputs`)."""
        proxy, transparent, dns = self.ports
        argv = [str(self.python), "-m", "space.gateway",
                "--proxy", f"{self.address}:{proxy}",
                "--transparent", f"{self.address}:{transparent}",
                "--dns", f"{self.address}:{dns}",
                "--control", str(self.control), "--control-fd", str(fds["control"]),
                "--confdir", _fd_path(fds["ca"]),
                "--journal", _fd_path(fds["journal"])]
        if "hosts" in fds:
            argv += ["--hosts-file", _fd_path(fds["hosts"])]
        if self.upstream_dns:
            argv += ["--upstream-dns", self.upstream_dns]
        if "upstream_ca" in fds:
            argv += ["--upstream-ca", _fd_path(fds["upstream_ca"])]
        for net in self.sandbox_networks:
            argv += ["--sandbox-network", net]
        for net in self.private_ceiling:
            argv += ["--private-ceiling", net]
        return argv

    def _alive_pid(self) -> int | None:
        try:
            pid = int(_read_nofollow(self.work_dir / PIDFILE))
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        try:  # a recycled pid is not our gateway
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        if b"space.gateway" not in cmdline or str(self.control).encode() not in cmdline:
            return None
        # The pid file is in the gateway's own directory: never take a process of another user for it.
        uid = int(proc_status(pid).get("Uid", "-1").split()[0])
        return pid if uid in (0, os.geteuid(), self.run_as.uid if self.run_as else 0) else None

    async def ensure(self, *, timeout: float = 30.0) -> None:
        """The gateway is running and answers on its control socket."""
        pid = self._alive_pid()
        version = code_version()
        if pid is not None:
            try:
                running = _read_nofollow(self.work_dir / VERSIONFILE).strip()
            except (OSError, ValueError):
                running = ""
            problems = dropped_problems(proc_status(pid), self.run_as) if self.run_as else []
            if running != version or problems:
                # Replacing it resets the sandboxes' open connections; their policies are given
                # back by the agent, their secrets by the control plane.
                log.warning("gateway.replaced", pid=pid, running=running, version=version,
                            privileges=problems or None)
                await self.stop()
            else:
                try:
                    await self.client.call("stats")
                    self.pid = pid
                    return
                except Unavailable:
                    log.warning("gateway.unresponsive", pid=pid)
                    await self.stop()
        if not self.python.exists():
            raise Unavailable(f"egress gateway interpreter {self.python} is missing: run `make setup`")
        if self.run_as is not None:
            low = [p for p in self.ports if p < unprivileged_port_start()]
            if low:
                raise Unavailable(f"egress gateway ports {low} need privileges, and it runs as "
                                  f"{self.run_as.name!r}: listen on high ports (nftables redirects "
                                  "the sandboxes' DNS to GatewayPorts.dns)")
        try:
            proc = self._spawn(version)
        except OSError as e:  # its directories, files or socket: the watcher retries a SpaceError
            raise Unavailable(f"cannot start the egress gateway: {e}") from e
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if proc.poll() is not None:
                raise Unavailable(f"egress gateway exited at start (exit {proc.returncode}): {self._log_tail()}")
            if self.control.exists():
                try:
                    await self.client.call("stats")
                    break
                except Unavailable:
                    pass
            if loop.time() > deadline:
                await self.stop()
                raise Unavailable(f"egress gateway did not come up within {timeout:g}s")
            await asyncio.sleep(0.05)
        log.info("gateway.started", pid=proc.pid, address=self.address,
                 user=self.run_as.name if self.run_as else None)

    def _spawn(self, version: str) -> subprocess.Popen[bytes]:
        self._prepare_dirs()
        fds: dict[str, int] = {}
        try:
            fds["log"] = _open_log(self.work_dir / LOGFILE, self.run_as)
            fds["ca"] = os.open(self.ca_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fds["journal"] = os.open(self.work_dir / "journal",
                                     os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if self.hosts_file is not None:  # TEST ONLY inputs: readable files (the inode is checked)
                fds["hosts"] = os.open(self.hosts_file, os.O_RDONLY | os.O_CLOEXEC)
            if self.upstream_ca is not None:
                fds["upstream_ca"] = os.open(self.upstream_ca, os.O_RDONLY | os.O_CLOEXEC)
            sock = self._bind_control()
            fds["control"] = sock.fileno()
            drop: dict[str, Any] = {}
            if self.run_as is not None:
                drop = {"user": self.run_as.uid, "group": self.run_as.gid, "extra_groups": [],
                        "preexec_fn": _no_new_privs_fn()}
            try:
                proc = subprocess.Popen(  # a fork+exec, quick enough inline
                    self.argv(fds), stdin=subprocess.DEVNULL, stdout=fds["log"], stderr=fds["log"],
                    pass_fds=[fd for k, fd in fds.items() if k != "log"], start_new_session=True,
                    cwd="/", env=childenv.build("gateway"), **drop,
                )
            finally:
                sock.close()
        finally:
            for k, fd in fds.items():
                if k != "control":
                    os.close(fd)
        self.pid = proc.pid
        _write_nofollow(self.work_dir / PIDFILE, str(proc.pid))
        _write_nofollow(self.work_dir / VERSIONFILE, version)
        if self.run_as is not None:
            # Popen returns once the child has exec'd: what it runs as is final.
            problems = dropped_problems(proc_status(proc.pid), self.run_as)
            if problems:
                proc.kill()
                proc.wait()
                from space.privdrop import PrivilegeError

                raise PrivilegeError(f"the egress gateway did not drop to {self.run_as.name!r}: "
                                     f"{'; '.join(problems)}", user=self.run_as.name)
        return proc

    def _bind_control(self) -> socket.socket:
        """The control socket, bound and listening at its place in the agent's directory: 0660,
        group ``control_group``. Never chowned or chmodded by that name, which the agent could
        have pointed anywhere meanwhile (:mod:`space.node.unixsock`)."""
        self.control.parent.mkdir(parents=True, exist_ok=True)
        return unixsock.bind_listening(self.control, mode=0o660, gid=self.control_group, flags=0)

    def _prepare_dirs(self) -> None:
        """The gateway's directories exist, and are the gateway user's (its CA and journal files
        made by a root gateway before it had a user of its own included)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.ca_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        journal = self.work_dir / "journal"
        if self.run_as is None:
            journal.mkdir(exist_ok=True, mode=0o700)
            return
        user = self.run_as
        _own_dir(self.work_dir, user, 0o700)
        with contextlib.suppress(FileExistsError):
            journal.mkdir(mode=0o700)
        _own_dir(journal, user, 0o700, files=True)
        # 0711: the agent (root today, unprivileged later) reads the certificate by its name.
        _own_dir(self.ca_dir, user, 0o711, files=True)

    def _log_tail(self) -> str:
        try:
            fd = os.open(self.work_dir / LOGFILE, os.O_RDONLY | _O_NOFOLLOW_FILE)
        except OSError as e:
            return f"(no log: {e})"
        try:
            size = os.fstat(fd).st_size
            return os.pread(fd, 1500, max(0, size - 1500)).decode(errors="replace")
        finally:
            os.close(fd)

    def alive(self) -> bool:
        return self._alive_pid() is not None

    async def stop(self) -> None:
        await self.client.close()
        pid = self._alive_pid() or self.pid
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while loop.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 -- WNOHANG never blocks
            await asyncio.sleep(0.05)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        (self.work_dir / PIDFILE).unlink(missing_ok=True)
        # The agent bound the control socket (the gateway could not remove it from here).
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.control.lstat().st_mode):
                self.control.unlink()
        self.pid = None


def _fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _own_dir(path: Path, user: ServiceUser, mode: int, *, files: bool = False) -> None:
    """``path`` (not a link) becomes ``user``'s with ``mode``; with ``files``, so do the regular
    files directly in it that are not yet, each opened without following links and skipped when
    hard-linked: the user may have planted either in a directory it owns."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, user.uid, user.gid)
        os.fchmod(fd, mode)
        if not files:
            return
        for name in os.listdir(fd):
            try:
                ffd = os.open(name, os.O_RDONLY | _O_NOFOLLOW_FILE, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOENT, errno.EISDIR, errno.ENXIO):
                    continue
                raise
            try:
                st = os.fstat(ffd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid != user.uid:
                    os.fchown(ffd, user.uid, user.gid)
            finally:
                os.close(ffd)
    finally:
        os.close(fd)


def _open_log(path: Path, user: ServiceUser | None) -> int:
    """The gateway's log for appending, never through a link or onto a file that is not a plain
    one of its own: anything else there is replaced."""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_NOFOLLOW_FILE, 0o600)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise
            _remove(path)
            continue
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            os.set_blocking(fd, True)
            if user is not None and st.st_uid != user.uid:
                os.fchown(fd, user.uid, user.gid)
            return fd
        os.close(fd)
        _remove(path)
    raise Unavailable(f"cannot open the egress gateway's log {path}: something keeps replacing it")


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except IsADirectoryError:
        import shutil

        shutil.rmtree(path)
    except FileNotFoundError:
        pass


def _read_nofollow(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW_FILE)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        return os.read(fd, 4096).decode()
    finally:
        os.close(fd)


def _write_nofollow(path: Path, text: str) -> None:
    """Replace ``path`` by a new file (the rename replaces a link, never follows one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
