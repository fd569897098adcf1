"""CAP_SYS_RESOURCE: the daemon holds it, and no process it starts does.

gVisor checks RLIMIT_NPROC on every task it creates, threads included, against the count of the
creator's real uid, and a creator holding CAP_SYS_RESOURCE is exempt. The sandbox's OCI spec gives
the daemon that capability (``space/runtime/oci.py``) so that neither its worker threads nor the
commands it starts can meet EAGAIN because the tenant's root processes are many: a root fork bomb
must not leave the sandbox unable to run the ``kill`` that ends it.

No command may keep it (it would lift the command's rlimits). A root execve's permitted set is its
bounding set, and the bounding set belongs to each task (thread) alone, in Linux and in gVisor: so
each thread drops the capability from its own bounding set before it starts its first command
(``PR_CAPBSET_DROP``; the thread keeps it in its effective set). Where that is impossible (no
ctypes in the template), the caller routes the command through a wrapper that drops it.
"""

from __future__ import annotations

import threading

CAP_SYS_RESOURCE = 24
PR_CAPBSET_DROP = 24

_local = threading.local()
_held: list[bool] = []
_libc: list[object] = []


def load() -> None:
    """Import ctypes and open libc (~12-34 ms under gVisor): done off the critical path at boot."""
    if _libc:
        return
    try:
        import ctypes

        _libc.append(ctypes.CDLL(None, use_errno=True))
    except (ImportError, OSError):
        _libc.append(None)


def _bounding_holds() -> bool:
    """Whether this thread's bounding set has CAP_SYS_RESOURCE; unknown counts as yes."""
    try:
        with open("/proc/thread-self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("CapBnd:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True


def shed() -> bool:
    """Make sure no process this thread starts can hold CAP_SYS_RESOURCE: True when it is so
    (dropped now or before, or never held), False when the caller must use a wrapper that drops it."""
    if getattr(_local, "shed", False):
        return True
    if not _held:
        _held.append(_bounding_holds())  # the first spawning thread's view; every thread inherits it
    ok = not _held[0]
    if not ok:
        load()
        libc = _libc[0]
        if libc is not None:
            # Dropping a capability that is already gone succeeds: a thread made by a thread that
            # dropped it, or a second call, is no special case.
            ok = libc.prctl(PR_CAPBSET_DROP, CAP_SYS_RESOURCE, 0, 0, 0) == 0  # type: ignore[attr-defined]
    _local.shed = ok
    return ok
