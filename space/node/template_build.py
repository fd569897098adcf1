"""Builds the templates of space/node/template_spec.py: a base, then apt, pip, files and commands.

The base is either debootstrap (the store's builder, as for ``base``) or a writable snapshot of
another template, materialized first with :meth:`TemplateStore.ensure` (from the pool, the cache,
object storage, or by building it). Every step that runs inside the new root runs in a private
mount and PID namespace (``unshare --mount --pid --fork``) with ``/proc``, ``/dev`` and the host's
``/etc/resolv.conf`` mounted for it (apt and pip need the network; see also :data:`HOST_CA`): the
mounts exist only in that
namespace and vanish with its last process, which the PID namespace guarantees is the step itself
(a daemon a postinst started dies with it). A leftover mount would make ``btrfs subvolume delete``
of the build fail, and a failed build must leave nothing behind.

Specs are admin-only: their commands run as root in the chroot with the host's network.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog

from space.errors import NotFound, RuntimeFailure, SpaceError
from space.node import privileged, template_spec

if TYPE_CHECKING:
    from space.node.templates import Progress, TemplateStore

log = structlog.get_logger(__name__)

#: Environment of every build step (nothing of the node agent's own environment leaks in).
BUILD_ENV: Final = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LC_ALL": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}
PIP_ENV: Final = {
    # bookworm's python is "externally managed" (PEP 668): a template owns its system python.
    "PIP_BREAK_SYSTEM_PACKAGES": "1",
    "PIP_ROOT_USER_ACTION": "ignore",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_PROGRESS_BAR": "off",
}
STEP_TIMEOUT: Final = 3600.0
#: The build host's trust store. Build steps use the host's network, so they trust what it trusts
#: (a TLS-intercepting egress proxy's CA, say): a copy is offered at /run/space-build/ (a tmpfs of
#: the step) through SSL_CERT_FILE, PIP_CERT, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE and GIT_SSL_CAINFO,
#: leaving the template's own trust store as its packages made it.
HOST_CA: Final = "/etc/ssl/certs/ca-certificates.crt"
TAIL_LINES: Final = 40

# Runs on the host inside the new namespaces: mount what the step needs, then chroot. The paths
# checked are inside the template; a symlink there must not redirect a mount onto the host.
_ENTER = r"""
set -eu
t="$1"; shift
for d in proc dev etc; do
    if [ -L "$t/$d" ] || [ ! -d "$t/$d" ]; then
        echo "space-build: /$d is not a directory in the template" >&2
        exit 97
    fi
done
mount -t proc proc "$t/proc"
mount --rbind /dev "$t/dev"
if [ -L "$t/etc/resolv.conf" ]; then rm -f "$t/etc/resolv.conf"; fi
[ -e "$t/etc/resolv.conf" ] || : > "$t/etc/resolv.conf"
mount --bind /etc/resolv.conf "$t/etc/resolv.conf"
if [ -f "$HOST_CA" ] && [ -d "$t/run" ] && [ ! -L "$t/run" ]; then
    mount -t tmpfs -o mode=0755,size=64m space-build "$t/run"
    mkdir -p "$t/run/lock" "$t/run/space-build"
    cp "$HOST_CA" "$t/run/space-build/ca-certificates.crt"
    ca=/run/space-build/ca-certificates.crt
    exec chroot "$t" /usr/bin/env -i SSL_CERT_FILE=$ca PIP_CERT=$ca REQUESTS_CA_BUNDLE=$ca CURL_CA_BUNDLE=$ca \
        GIT_SSL_CAINFO=$ca "$@"
fi
exec chroot "$t" /usr/bin/env -i "$@"
"""

# No service may start during a build (there is no init; and the PID namespace would kill it).
_APT = r"""
set -eu
if [ ! -e /usr/sbin/policy-rc.d ]; then
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 0755 /usr/sbin/policy-rc.d
fi
apt-get -q update
apt-get -q install -y --no-install-recommends -o Dpkg::Progress-Fancy=0 "$@"
"""

_PIP = r"""
set -eu
if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "installing python3-pip"
    # The apt step's lists are still there (the clean step comes last).
    ls /var/lib/apt/lists/*_Packages >/dev/null 2>&1 || apt-get -q update
    apt-get -q install -y --no-install-recommends -o Dpkg::Progress-Fancy=0 python3-pip
fi
python3 -m pip install "$@"
"""

_WRITE = r"""
set -eu
dest="$1" mode="$2"
mkdir -p -- "$(dirname -- "$dest")"
cat > "$dest"
chmod "$mode" "$dest"
"""

_CONFIGURE = r"""
set -eu
user="$1" workdir="$2"
if [ -n "$user" ] && ! getent passwd "$user" >/dev/null; then
    useradd --create-home --shell /bin/bash --user-group "$user"
fi
if [ -n "$workdir" ] && [ ! -d "$workdir" ]; then
    mkdir -p "$workdir"
    if [ -n "$user" ]; then chown "$user:" "$workdir"; fi
fi
"""

_CLEAN = r"""
set -eu
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old /var/lib/dpkg/*-old
rm -rf /var/log/apt/* /tmp/* /var/tmp/* /root/.cache
"""

Step = tuple[str, Callable[[], Awaitable[None]]]


async def build_custom(store: TemplateStore, spec: dict[str, Any], work: Path, emit: Progress) -> None:
    """Populate ``work`` (which must not exist yet) from ``spec``, emitting ``[n/N] step`` lines."""
    steps: list[Step] = []

    async def indented(line: str) -> None:
        await emit(f"    {line}")

    if template_spec.is_derived(spec):
        base = spec["base_template"]

        async def from_template() -> None:
            info = await store.ensure(base["spec"], on_progress=indented)
            if info.digest != base["digest"]:
                raise RuntimeFailure(f"base template {base['name']} materialized as {info.digest[:16]}, "
                                     f"not {base['digest'][:16]}")
            await store.pool.snapshot(info.path, work)

        steps.append((f"base: template {base['name']}@{base['digest'][:16]}", from_template))
    else:
        async def from_debootstrap() -> None:
            await store.pool.create_subvolume(work)
            await store._builder(spec, work, store.cache_dir, indented)

        steps.append((f"base: debootstrap {spec['suite']}", from_debootstrap))

    env = {**BUILD_ENV, **(spec.get("env") or {})}
    if spec.get("apt"):
        pkgs = list(spec["apt"])
        steps.append((f"apt install {' '.join(pkgs)}",
                      lambda: _in_root(work, _APT, pkgs, BUILD_ENV, emit, "apt install")))
    if spec.get("pip"):
        reqs = list(spec["pip"])
        steps.append((f"pip install {' '.join(reqs)}",
                      lambda: _in_root(work, _PIP, reqs, {**BUILD_ENV, **PIP_ENV}, emit, "pip install")))
    if spec.get("files"):
        files = list(spec["files"])
        steps.append((f"copy {len(files)} file(s)", lambda: _copy_files(store, work, files, emit)))
    for cmd in spec.get("run") or []:
        title = f"run: {_short(cmd)}"
        steps.append((title, _bind_run(work, cmd, env, emit, title)))
    user, workdir = spec.get("user") or "", spec.get("workdir") or ""
    if workdir or (template_spec.is_derived(spec) and user):
        steps.append((f"configure: user {user or '-'}, workdir {workdir or '-'}",
                      lambda: _run_chroot(work, _CONFIGURE, [user, workdir], "configure")))
    if spec.get("apt") or spec.get("pip") or spec.get("run"):
        steps.append(("clean apt lists and caches", lambda: _run_chroot(work, _CLEAN, [], "clean")))

    total = len(steps) + 1
    for i, (title, step) in enumerate(steps, 1):
        await emit(f"[{i}/{total}] {title}")
        started = time.monotonic()
        await step()
        log.info("template.build_step", step=title, seconds=round(time.monotonic() - started, 2))
    await emit(f"[{total}/{total}] publish {work.name.removeprefix('build-')}")


def _short(cmd: str, limit: int = 70) -> str:
    one = " ".join(cmd.split())
    return one if len(one) <= limit else one[: limit - 1] + "…"


def _bind_run(work: Path, cmd: str, env: dict[str, str], emit: Progress, title: str) -> Callable[[], Awaitable[None]]:
    return lambda: _in_root(work, "set -e\n" + cmd, [], env, emit, title)


async def _in_root(target: Path, script: str, args: list[str], env: dict[str, str], emit: Progress,
                   what: str) -> None:
    """Run ``script`` with ``/bin/sh -c`` inside ``target`` (namespaced, mounts as described above),
    streaming its output; a failure raises with the output's tail."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)

    async def line(text: str) -> None:
        tail.append(text)
        await emit(f"    {text}")

    argv = [
        "unshare", "--mount", "--pid", "--fork", "--propagation", "private", "--",
        "/bin/sh", "-c", _ENTER, "space-build", str(target),
        *(f"{k}={v}" for k, v in env.items()),
        "/bin/sh", "-c", script, "space-step", *args,
    ]
    rc = await privileged.stream_lines(*argv, on_line=line, timeout=STEP_TIMEOUT, env={"HOST_CA": HOST_CA})
    if rc != 0:
        last = next((t for t in reversed(tail) if t.strip()), "no output")
        raise RuntimeFailure(f"template build step {what!r} failed (exit {rc}): {last}",
                             step=what, returncode=rc, output="\n".join(tail))


async def _run_chroot(target: Path, script: str, args: list[str], what: str) -> None:
    """A step that needs neither the network nor /proc: a plain chroot."""
    try:
        await privileged.run("chroot", str(target), "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in BUILD_ENV.items()),
                             "/bin/sh", "-c", script, what, *args, timeout=600)
    except RuntimeFailure as exc:
        raise RuntimeFailure(f"template build step {what!r} failed: {exc.message}", step=what,
                             output=exc.details.get("stderr", "")) from None


async def _copy_files(store: TemplateStore, target: Path, files: list[dict[str, str]], emit: Progress) -> None:
    blobs = store.cache_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for f in files:
        local = blobs / f["sha256"]
        if not local.exists():
            if store.objects is None:
                raise RuntimeFailure("the template has files but this node has no object store to fetch them from")
            key = template_spec.blob_key(f["sha256"])
            try:
                # Checked against its name: a blob is its sha256.
                await store.objects.get_to_file(key, local, expected_sha256=f["sha256"])
            except NotFound:
                raise NotFound(f"the file for {f['dest']} (blob {f['sha256'][:16]}) is not in object storage; "
                               "upload it with PUT /v1/templates/blobs/{sha256}", dest=f["dest"]) from None
        try:
            await privileged.pipeline(["chroot", str(target), "/bin/sh", "-c", _WRITE, "write", f["dest"], f["mode"]],
                                      stdin=local, timeout=600)
        except SpaceError as exc:
            raise RuntimeFailure(f"copying {f['dest']} into the template failed: {exc.message}",
                                 dest=f["dest"]) from None
        await emit(f"    {f['dest']} ({local.stat().st_size} bytes, mode {f['mode']})")
