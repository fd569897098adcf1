"""The guest daemon's files as every sandbox mounts them (read-only): bytecode compiled and the
exec wrapper ``space-spawn`` built ahead of time, so that nothing is written into the install tree
while a node runs (an image's root filesystem is read-only).

``space node prepare-guest`` prepares the installed package in place: ``make setup`` runs it, and so
does the node image's build. A node started on a package nobody prepared (a development checkout
edited since) prepares a copy in its own data directory instead, owned by root like the rest of
it, and mounts that.
"""

from __future__ import annotations

import compileall
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog

from space import childenv
from space import guest as guest_pkg

log = structlog.get_logger(__name__)

#: Holds the digest of the sources a directory was prepared from.
STAMP = ".prepared"
SPAWN_SOURCE, SPAWN = "spawn.c", "space-spawn"
#: The sandbox's ``sudo`` (the base template's /usr/bin/sudo links to it): a script, executable.
SUDO = "sudo"


def package_dir() -> Path:
    return Path(guest_pkg.__file__).resolve().parent


def _sources(d: Path) -> list[Path]:
    return sorted([*d.glob("*.py"), d / SPAWN_SOURCE, d / SUDO])


def sources_digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in _sources(d):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def prepared_from(d: Path) -> str | None:
    try:
        return (d / STAMP).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def prepare(d: Path) -> None:
    """Compile ``d``'s modules and build its ``space-spawn`` (without a C compiler the guest falls
    back to setpriv: slower, same behaviour), then stamp it with its sources' digest."""
    if not compileall.compile_dir(str(d), quiet=1, maxlevels=0, force=True):
        raise RuntimeError(f"the guest's modules in {d} do not compile")
    _build_spawn(d)
    tmp = d / f".{STAMP}.{os.getpid()}"
    tmp.write_text(sources_digest(d) + "\n")
    os.replace(tmp, d / STAMP)


def _build_spawn(d: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("guest.spawn_helper_unavailable", reason="no C compiler")
        return
    tmp = d / f".{SPAWN}.{os.getpid()}"
    res = subprocess.run([cc, "-O2", "-static", "-o", str(tmp), str(d / SPAWN_SOURCE)], capture_output=True,
                         text=True, env=childenv.tool())
    if res.returncode != 0:
        log.warning("guest.spawn_helper_build_failed", stderr=res.stderr[-500:])
        tmp.unlink(missing_ok=True)
        return
    os.replace(tmp, d / SPAWN)


def guest_dir(data_dir: Path) -> Path:
    """The directory to mount into sandboxes: the installed package if it was prepared from its
    current sources, else a prepared copy under ``data_dir`` (made or refreshed now)."""
    pkg = package_dir()
    digest = sources_digest(pkg)
    if prepared_from(pkg) == digest:
        return pkg
    copy = data_dir / "guest"
    if prepared_from(copy) == digest:
        return copy
    log.info("guest.preparing_copy", source=str(pkg), dest=str(copy))
    work = Path(tempfile.mkdtemp(prefix=".guest-", dir=data_dir))
    try:
        work.chmod(0o755)
        for f in _sources(pkg):
            shutil.copy2(f, work / f.name)
        prepare(work)
        old = data_dir / f".guest-old-{os.getpid()}"
        if copy.exists():
            os.replace(copy, old)
        os.replace(work, copy)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return copy
