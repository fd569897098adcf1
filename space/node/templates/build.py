"""Builds the templates of space/node/templates/spec.py: a base, then apt, pip, files and commands.

The base is either debootstrap (the store's builder, as for ``base``) or a writable snapshot of
another template, materialized first with :meth:`TemplateStore.ensure` (from the pool, the cache,
object storage, or by building it). The steps are the root helper's ``template.*`` verbs
(:mod:`space.node.helper.verbs_template`, where the scripts live) on the work tree the helper made
for this build (``template.begin``). Every step that executes the template's own binaries runs in
a gVisor sandbox (:mod:`space.node.helper.build_sandbox`), never on the host; the apt, pip and run
steps get a network whose only way out is the node's egress gateway, under the build egress
policy (:mod:`space.node.network.build_net`: the Debian mirror, PyPI and what the operator adds). A failed
build leaves nothing behind.

Specs are admin-only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog

from space.errors import NotFound, RuntimeFailure, SpaceError
from space.node.helper.backend import Privileged
from space.node.storage import shipping
from space.node.templates import spec as template_spec
from space.node.templates.logins import Logins, logins_fd

if TYPE_CHECKING:
    from space.node.templates.store import Progress, TemplateStore

log = structlog.get_logger(__name__)

STEP_TIMEOUT: Final = 3600.0
TAIL_LINES: Final = 40

Step = tuple[str, Callable[[], Awaitable[None]]]


async def build_custom(store: TemplateStore, spec: dict[str, Any], work: Path, emit: Progress, *,
                       registry_auth: Logins | None = None) -> None:
    """Populate ``work`` (which must not exist yet) from ``spec``, emitting ``[n/N] step`` lines;
    ``registry_auth``: the logins its images (its own, its bases') are pulled with."""
    steps: list[Step] = []

    async def indented(line: str) -> None:
        await emit(f"    {line}")

    if template_spec.is_derived(spec):
        base = spec["base_template"]

        async def from_template() -> None:
            info = await store.ensure(base["spec"], on_progress=indented, registry_auth=registry_auth)
            if info.digest != base["digest"]:
                raise RuntimeFailure(f"base template {base['name']} materialized as {info.digest[:16]}, "
                                     f"not {base['digest'][:16]}")
            await store.pool.begin_build(work, info.path)

        steps.append((f"base: template {base['name']}@{base['digest'][:16]}", from_template))
    elif template_spec.is_image(spec):
        image = str(spec["image"])

        async def from_image() -> None:
            await store.pool.begin_build(work)
            rel = shipping.pool_rel(store.pool, work)
            tail: deque[str] = deque(maxlen=TAIL_LINES)

            async def line(text: str) -> None:
                tail.append(text)
                await indented(text)

            started = time.monotonic()
            with logins_fd(registry_auth) as fds:
                await store.pool.priv.call("template.oci", {"work": rel, "image": image}, fds=fds, on_line=line,
                                           timeout=STEP_TIMEOUT)
            pulled = time.monotonic()
            await _run_script(store.pool.priv, rel, "image_configure", [])
            configured = time.monotonic()
            # The image runs the guest daemon and has the template's user, or the build says what it lacks.
            await _run_script(store.pool.priv, rel, "image_check", [str(spec.get("user") or "")])
            log.info("template.image_steps", image=image, pull_unpack_s=round(pulled - started, 2),
                     configure_s=round(configured - pulled, 2), check_s=round(time.monotonic() - configured, 2))

        steps.append((f"base: image {image}", from_image))
    else:
        async def from_debootstrap() -> None:
            await store.pool.begin_build(work)
            await store._builder(spec, work, store.cache_dir, indented)

        steps.append((f"base: debootstrap {spec['suite']}", from_debootstrap))

    rel = shipping.pool_rel(store.pool, work)
    # The network of the apt, pip and run steps (leased below, once the base is there).
    net = _StepNet()
    step = functools.partial(_in_root, store.pool.priv, rel, net, emit)
    # The spec's env applies to its run commands (the helper adds its fixed build environment).
    env = [f"{k}={v}" for k, v in (spec.get("env") or {}).items()]
    if spec.get("apt"):
        pkgs = list(spec["apt"])
        steps.append((f"apt install {' '.join(pkgs)}", functools.partial(step, "apt", pkgs, [], "apt install")))
    if spec.get("pip"):
        reqs = list(spec["pip"])
        steps.append((f"pip install {' '.join(reqs)}", functools.partial(step, "pip", reqs, [], "pip install")))
    if spec.get("files"):
        files = list(spec["files"])
        steps.append((f"copy {len(files)} file(s)", lambda: _copy_files(store, rel, files, emit)))
    for cmd in spec.get("run") or []:
        if isinstance(cmd, dict):  # a copy of an uploaded archive's files
            title = f"copy {_short(cmd['src'] or '.', 40)} to {_short(cmd['dest'], 40)}"
            steps.append((title, functools.partial(_copy_archive, store, rel, dict(cmd), emit)))
            continue
        title = f"run: {_short(cmd)}"
        steps.append((title, functools.partial(step, "run", [cmd], env, title)))
    priv = store.pool.priv
    user, workdir = spec.get("user") or "", spec.get("workdir") or ""
    if workdir or (template_spec.is_derived(spec) and user):
        steps.append((f"configure: user {user or '-'}, workdir {workdir or '-'}",
                      lambda: _run_script(priv, rel, "configure", [user, workdir])))
    networked = bool(spec.get("apt") or spec.get("pip") or template_spec.run_commands(spec))
    if networked:
        steps.append(("clean apt lists and caches", lambda: _run_script(priv, rel, "clean", [])))

    total = len(steps) + 1
    async with contextlib.AsyncExitStack() as stack:
        for i, (title, run_step) in enumerate(steps, 1):
            if i == 2 and networked and store.build_net is not None:
                net.index = await stack.enter_async_context(store.build_net.lease(work.name, spec))
            await emit(f"[{i}/{total}] {title}")
            started = time.monotonic()
            await run_step()
            log.info("template.build_step", step=title, seconds=round(time.monotonic() - started, 2))
    await emit(f"[{total}/{total}] publish {work.name.removeprefix('build-')}")


class _StepNet:
    """The sandbox network index the steps run on (None: no network)."""

    index: int | None = None


def _short(cmd: str, limit: int = 70) -> str:
    one = " ".join(cmd.split())
    return one if len(one) <= limit else one[: limit - 1] + "…"


async def _in_root(priv: Privileged, work: str, net: _StepNet, emit: Progress, kind: str, args: list[str],
                   env: list[str], what: str) -> None:
    """A ``template.step`` (apt, pip or one run command in a build sandbox over the work tree, on
    the build's network if it has one), streaming its output; a failure raises with the output's
    tail."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)

    async def line(text: str) -> None:
        tail.append(text)
        await emit(f"    {text}")

    res = await priv.call("template.step", {"work": work, "kind": kind, "args": args, "env": env, "net": net.index},
                          on_line=line, timeout=STEP_TIMEOUT)
    rc = int(res["returncode"])
    if rc != 0:
        last = next((t for t in reversed(tail) if t.strip()), "no output")
        raise RuntimeFailure(f"template build step {what!r} failed (exit {rc}): {last}",
                             step=what, returncode=rc, output="\n".join(tail))


async def _run_script(priv: Privileged, work: str, script: str, args: list[str]) -> None:
    """A step that needs no network: one of the helper's scripts, in a build sandbox."""
    try:
        await priv.call("template.script", {"work": work, "script": script, "args": args}, timeout=600)
    except RuntimeFailure as exc:
        raise RuntimeFailure(f"template build step {script!r} failed: {exc.message}", step=script,
                             output=exc.details.get("stderr", "")) from None


async def _blob(store: TemplateStore, sha256: str, what: str) -> Path:
    """The node's copy of the blob ``sha256`` (fetched from object storage and checked if missing)."""
    blobs = store.cache_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    local = blobs / sha256
    if not local.exists():
        if store.objects is None:
            raise RuntimeFailure("the template has files but this node has no object store to fetch them from")
        try:
            # Checked against its name: a blob is its sha256.
            await store.objects.get_to_file(template_spec.blob_key(sha256), local, expected_sha256=sha256)
        except NotFound:
            raise NotFound(f"{what} (blob {sha256[:16]}) is not in object storage; "
                           "upload it with PUT /v1/templates/blobs/{sha256}", blob=sha256) from None
    return local


async def _copy_archive(store: TemplateStore, work: str, copy: dict[str, str], emit: Progress) -> None:
    """A copy of ``run``: the archive written at the tree's top, then unpacked and placed by the
    ``copy_archive`` script in a build sandbox (the archive is the template author's, as a run
    step is)."""
    local = await _blob(store, copy["archive"], f"the files to copy to {copy['dest']}")
    staged = f"/.space-copy-{copy['archive'][:16]}.tar"
    fd = os.open(local, os.O_RDONLY | os.O_CLOEXEC)
    try:
        await store.pool.priv.call("template.write_file", {"work": work, "dest": staged, "mode": "0600"},
                                   fds={"stdin": fd}, timeout=600)
    finally:
        os.close(fd)
    await _run_script(store.pool.priv, work, "copy_archive",
                      [staged, copy["src"], copy["dest"], copy["owner"], copy["mode"], copy["workdir"], copy["user"]])
    await emit(f"    {copy['src'] or '.'} → {copy['dest']} ({local.stat().st_size} bytes archived)")


async def _copy_files(store: TemplateStore, work: str, files: list[dict[str, str]], emit: Progress) -> None:
    for f in files:
        local = await _blob(store, f["sha256"], f"the file for {f['dest']}")
        # Opened here, as the agent: the helper only gets the descriptor.
        fd = os.open(local, os.O_RDONLY | os.O_CLOEXEC)
        try:
            await store.pool.priv.call("template.write_file", {"work": work, "dest": f["dest"], "mode": f["mode"]},
                                       fds={"stdin": fd}, timeout=600)
        except SpaceError as exc:
            raise RuntimeFailure(f"copying {f['dest']} into the template failed: {exc.message}",
                                 dest=f["dest"]) from None
        finally:
            os.close(fd)
        await emit(f"    {f['dest']} ({local.stat().st_size} bytes, mode {f['mode']})")
