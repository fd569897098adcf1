"""Template build commands inside a gVisor sandbox: what runs a template's own binaries.

A build step (apt, pip, a ``run`` command), the base configure and clean scripts and debootstrap's
second stage all execute binaries of the tree being built, and that tree may come from a tenant's
sandbox (a template saved from one, a base derived from such a template) or from object storage.
So none of them runs on the host: each is one ``runsc run`` (attached, so its output streams and its
exit code is the command's) with the same flags as sandboxes (``--platform`` of the node,
``--overlay2=none`` so writes land in the work tree), over the work subvolume handed to runsc by
descriptor exactly as a sandbox's root is (:data:`~.verbs_runtime.LAUNCHER`), under a runsc root
and bundle directory of their own that only root can read (``<data>/runsc-build``,
``<data>/build-bundles``). The helper writes the OCI spec here, from scalars: no caller names a
mount, a namespace or a capability.

Network: none (``--network=none``), unless the caller names one of the node's sandbox networks
by index. Then the command runs in that network namespace exactly like a sandbox (gVisor's own
network stack on the namespace's ``eth0``, ``/etc/resolv.conf`` pointing at the node's gateway):
its only way out is the egress gateway, where the agent registered the build's address with the
build egress policy (``space.node.network.build_net``). The gateway passes TLS through untouched, so what
the build meets upstream is what the host meets (a network that intercepts TLS, say): the host's
trust store is offered read-only at :data:`HOST_CA_IN_BUILD` (through ``SSL_CERT_FILE``,
``PIP_CERT``, ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE`` and ``GIT_SSL_CAINFO``), leaving the
template's own trust store as its packages made it. (runsc's gofer makes a bind mount's mount point
in the tree itself: it is in ``/dev``, which every sandbox covers with a tmpfs, and removed after.)

Inside, the command is root with the sandbox capabilities plus ``CAP_SYS_ADMIN`` (debootstrap's
second stage remounts ``/proc``): the capabilities of gVisor's kernel, not of the host's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from space.errors import Timeout
from space.node.helper import privileged, verbs_net
from space.node.helper.confine import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_XDEV, openat2
from space.node.helper.verbs import HelperContext
from space.node.helper.verbs_net import NodeNet
from space.node.helper.verbs_runtime import LAUNCHER, Runsc, kill_strays
from space.runtime import oci

log = structlog.get_logger(__name__)

#: Inside gVisor only: debootstrap's second stage umounts and mounts /proc.
CAPABILITIES = [*oci.CAPABILITIES, "CAP_SYS_ADMIN"]
MEMORY_LIMIT = 4 << 30
PIDS_LIMIT = 16384
#: Environment every build command starts from (nothing of the helper's own environment).
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
#: The host's trust store, and where a networked build command finds it.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_CA_IN_BUILD = "/dev/space-build-ca.crt"
CA_ENV = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")

LineSink = Callable[[str], Awaitable[None]]


class BuildRunsc(Runsc):
    """runsc for build containers: the node's flags, a state root and bundles of their own (so no
    sandbox verb ever lists, adopts or sweeps a build, and no build verb a sandbox)."""

    def __init__(self, ctx: HelperContext, *, network: bool = False) -> None:
        super().__init__(ctx)
        self.root = ctx.data_dir / "runsc-build"
        self.bundles = ctx.data_dir / "build-bundles"
        self.flags = [f"--root={self.root}", f"--platform={ctx.platform}", "--overlay2=none",
                      f"--network={'sandbox' if network else 'none'}"]


def new_container_id() -> str:
    """Fixed-length and random: never a prefix of another (runsc matches ids by unique prefix)."""
    return f"build{secrets.token_hex(6)}-{secrets.token_hex(3)[:5]}"


#: Where the guest daemon is bound in a sandbox, and in a build command that checks an image can run it.
GUEST_IN_BUILD = "/opt/space/guest"


def build_spec(cid: str, bundle: Path, argv: Sequence[str], env: Mapping[str, str], *, netns: Path | None,
               resolv: Path | None, host_ca: Path | None = None, guest: Path | None = None) -> dict[str, Any]:
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev",
                                                                                  "mode=1777"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
    ]
    if resolv is not None:
        # The resolver for this command only: the tree keeps its own file.
        mounts.append({"destination": "/etc/resolv.conf", "type": "bind", "source": str(resolv),
                       "options": ["rbind", "ro"]})
    if guest is not None:
        # Read-only, as in every sandbox: the command checks the tree's python can run the daemon.
        mounts.append({"destination": GUEST_IN_BUILD, "type": "bind", "source": str(guest), "options": ["rbind", "ro"]})
    if host_ca is not None:
        mounts.append({"destination": HOST_CA_IN_BUILD, "type": "bind", "source": str(host_ca),
                       "options": ["rbind", "ro"]})
        env = {**{k: HOST_CA_IN_BUILD for k in CA_ENV}, **env}
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "args": list(argv),
            "cwd": "/",
            "env": [f"{k}={v}" for k, v in {**BASE_ENV, **env}.items()],
            "user": {"uid": 0, "gid": 0},
            "capabilities": {k: CAPABILITIES for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": False,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576, "soft": 1048576}],
        },
        "root": {"path": str(bundle / "rootfs"), "readonly": False},
        "hostname": "space-build",
        "mounts": mounts,
        "linux": {
            "namespaces": [
                {"type": t} if t != "network" or netns is None else {"type": t, "path": str(netns)}
                for t in ("pid", "network", "ipc", "uts", "mount")
            ],
            "resources": {"memory": {"limit": MEMORY_LIMIT}, "pids": {"limit": PIDS_LIMIT}},
            "cgroupsPath": f"/space/{cid}",
        },
    }


async def run(ctx: HelperContext, work_fd: int, argv: Sequence[str], env: Mapping[str, str], *,
              on_line: LineSink, timeout: float, net: int | None = None, guest: bool = False) -> int:
    """Run ``argv`` in a build sandbox over the tree ``work_fd`` is open on; stream its merged
    output to ``on_line`` and return its exit code. A timeout, a cancellation or a failure of the
    helper's own leaves no process, container, cgroup or bundle behind."""
    r = BuildRunsc(ctx, network=net is not None)
    cid = new_container_id()
    bundle = r.bundles / cid
    try:
        netns = gateway_ip = None
        if net is not None:
            n = NodeNet(ctx)
            s = n.sandbox(net)
            netns = verbs_net.NETNS_DIR / s["netns"]
            gateway_ip = n.gateway_ip(n.slot())
            await verbs_net._prepare(s)  # runsc strips the address from the link it takes (and: it exists)
        host_ca = await asyncio.to_thread(_write_bundle, r, bundle, cid, argv, env, netns, gateway_ip,
                                          ctx.guest if guest else None)
        launcher = [*LAUNCHER, str(work_fd), str(bundle), *r.cmd("run", "--bundle", str(bundle), cid)]
        started = asyncio.get_running_loop().time()
        try:
            rc = await privileged.stream_lines(*launcher, on_line=on_line, timeout=timeout, pass_fds=(work_fd,))
        except Timeout:
            raise Timeout(f"build command timed out after {timeout:g}s: {argv[0]}", argv=list(argv)[:3]) from None
        finally:
            # runsc starts the sandbox in sessions of its own: killing the launcher's process group
            # does not reach it. Whatever runsc left, by id, under the build root only.
            await asyncio.shield(_remove(r, cid))
            if host_ca is not None:
                _remove_mount_point(work_fd, HOST_CA_IN_BUILD)
        log.info("build.command", container=cid, argv0=argv[0], net=net, rc=rc,
                 seconds=round(asyncio.get_running_loop().time() - started, 2))
        return rc
    finally:
        shutil.rmtree(bundle, ignore_errors=True)


def _remove_mount_point(tree: int, path: str) -> None:
    """The empty file runsc's gofer made in the tree as a mount point, gone (resolved inside the
    tree: its symlinks never lead out)."""
    head, _, name = path.strip("/").rpartition("/")
    try:
        parent = openat2(tree, head, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,
                         RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)
    except OSError:
        return
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_size == 0:
            os.unlink(name, dir_fd=parent)
    except OSError:
        pass
    finally:
        os.close(parent)


def _write_bundle(r: BuildRunsc, bundle: Path, cid: str, argv: Sequence[str], env: Mapping[str, str],
                  netns: Path | None, gateway_ip: str | None, guest: Path | None = None) -> Path | None:
    """The bundle (root's alone): the work tree's mount point, the resolver of a networked command,
    the spec; the host trust store the command gets (None: none)."""
    for d in (r.root, r.bundles):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)
    bundle.mkdir(mode=0o700)
    (bundle / "rootfs").mkdir(mode=0o700)  # the mount point of the work tree (see LAUNCHER)
    resolv = host_ca = None
    if netns is not None:
        resolv = bundle / "resolv.conf"
        resolv.write_text(f"nameserver {gateway_ip}\noptions timeout:2 attempts:3\n")
        host_ca = HOST_CA if HOST_CA.is_file() else None
    spec = build_spec(cid, bundle, argv, env, netns=netns, resolv=resolv, host_ca=host_ca, guest=guest)
    (bundle / "config.json").write_text(json.dumps(spec))
    return host_ca


async def _remove(r: BuildRunsc, cid: str) -> None:
    if r.exists(cid):
        await privileged.run(*r.cmd("delete", "--force", cid), check=False, timeout=60)
    await kill_strays(r, only={cid})


async def sweep(ctx: HelperContext) -> list[str]:
    """Every build container under this node's build root, gone (no build outlives its helper
    call: what is here was left by a helper that died mid-build); the ids found."""
    r = BuildRunsc(ctx)
    found = sorted(r.known())
    for cid in found:
        await privileged.run(*r.cmd("delete", "--force", cid), check=False, timeout=60)
    found += [c for c in await kill_strays(r) if c not in found]
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(r.bundles):
            shutil.rmtree(entry.path, ignore_errors=True)
    if found:
        log.warning("build.swept", containers=found)
    return found
