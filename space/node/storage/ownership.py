"""What the unprivileged node agent owns, given to it by the root agent before it drops root.

The agent writes its own state: sandbox directories (``state.json``, ``net.json``, logs, shim pid
files, downloads), template manifests, the warm pool's file, the host cache of template streams and
the directory of its sockets. Subvolume roots (a sandbox's ``rootfs``, a template) stay as they are:
their contents belong to the guest, and only the helper acts on them. The pool's ``tmp/`` is the
helper's (build work trees, receive staging; see ``space.node.helper.verbs_template``): root's,
0750 with the agent's group (which may look, never write), and emptied at every start (whatever is
there was left by a helper or an agent that died, and a tree the agent made while an older layout
let it write there must never become a build). The walk never follows a
symlink, never enters a subvolume or another filesystem and skips files with several links (a hard
link could point anywhere on the filesystem). Idempotent: it runs at every start.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

_SUBVOLUME_INO = 256
#: The pool's plain areas; a sandbox's or template's subvolumes inside them are skipped.
AGENT_AREAS = ("templates", "sandboxes", "trash")
#: The pool's area only root writes.
HELPER_AREA = "tmp"
#: The host cache's parts the agent writes (``debootstrap`` is the helper's).
AGENT_CACHE = ("templates", "locks", "blobs")


def node_state_dir(data_dir: Path) -> Path:
    """The agent's own files outside the pool (the warm pool's record)."""
    return data_dir / "node"


def _give(fd: int, st: os.stat_result, uid: int, gid: int) -> None:
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.fchown(fd, uid, gid)


def _give_tree(path: Path, uid: int, gid: int) -> int:
    """``path`` and the plain entries beneath it to uid:gid; returns how many changed owner."""
    changed = 0
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError, OSError):
        return 0
    stack = [top]
    top_dev = os.fstat(top).st_dev
    try:
        while stack:
            fd = stack.pop()
            try:
                st = os.fstat(fd)
                if (st.st_uid, st.st_gid) != (uid, gid):
                    os.fchown(fd, uid, gid)
                    changed += 1
                for name in os.listdir(fd):
                    est = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if est.st_dev != top_dev or stat.S_ISLNK(est.st_mode):
                        continue
                    if stat.S_ISDIR(est.st_mode):
                        if est.st_ino == _SUBVOLUME_INO:
                            continue  # a subvolume: the guest's, or a template
                        stack.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                             dir_fd=fd))
                    elif stat.S_ISREG(est.st_mode) and est.st_nlink == 1 and (est.st_uid, est.st_gid) != (uid, gid):
                        os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
                        changed += 1
            finally:
                os.close(fd)
    finally:
        for fd in stack:
            os.close(fd)
    return changed


def give_node_state(data_dir: Path, pool_root: Path, cache_dir: Path, uid: int, gid: int) -> None:
    """Hand the agent's state to ``uid``:``gid`` (the root agent calls this right before dropping)."""
    state = node_state_dir(data_dir)
    state.mkdir(mode=0o700, exist_ok=True)
    old = data_dir / "warm-pool.json"
    if old.exists() and not (state / old.name).exists():
        os.replace(old, state / old.name)  # the layout before the agent dropped root
    changed = _give_tree(state, uid, gid)
    for area in AGENT_AREAS:
        (pool_root / area).mkdir(exist_ok=True)
        os.chmod(pool_root / area, 0o750)
        changed += _give_tree(pool_root / area, uid, gid)
    reclaim_helper_area(pool_root, gid)
    cache_dir.mkdir(parents=True, exist_ok=True)
    for part in AGENT_CACHE:
        (cache_dir / part).mkdir(exist_ok=True)
        changed += _give_tree(cache_dir / part, uid, gid)
    log.info("node.state_given", uid=uid, gid=gid, changed=changed)


def reclaim_helper_area(pool_root: Path, gid: int) -> None:
    """``tmp/`` root's (0750, group ``gid``) and empty: taken back first, so that nobody but root
    can add to it while it is emptied; each entry then removed by the helper's own confined delete
    (never following a link, never leaving the pool)."""
    from space.node.helper.verbs_pool import delete_entry  # root-only code, imported by root only

    area = pool_root / HELPER_AREA
    area.mkdir(mode=0o750, exist_ok=True)
    fd = os.open(area, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, 0, gid)
        os.fchmod(fd, 0o750)
        names = os.listdir(fd)
    finally:
        os.close(fd)
    for name in names:
        delete_entry(pool_root, HELPER_AREA, name)
    if names:
        log.info("node.helper_area_emptied", entries=len(names))
