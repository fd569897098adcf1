"""Where a sandbox instance's cgroup files are, and how they are written, on cgroup v1 and v2.

runsc makes each instance's cgroup from the OCI spec's ``cgroupsPath`` ``/space/<instance>``
(:mod:`space.runtime.oci`):

- v1 (a hierarchy per controller; also "hybrid" hosts, where a v2 tree is mounted beside the v1
  controllers at ``unified/`` and runsc still uses v1): ``<root>/<controller>/space/<instance>``;
- v2 (the unified hierarchy: kind, EKS AL2023, Bottlerocket): one ``<root>/space/<instance>``.

Callers ask one object (:class:`CgroupsV1` or :class:`CgroupsV2`) and never spell a file name.
The node agent freezes, thaws and re-weights instances itself (one synchronous write each: the claim
hot path cannot afford a helper round trip or a thread); the root helper removes the groups, thaws
an instance before a kill, asks whether a frozen one still has processes and hands the agent the
files it writes (:meth:`Cgroups.delegated_files`). Each of them detects the version once, at its
start (:func:`host`), so a host SPACE cannot run on stops the node there, saying why.

The OCI spec stays version-blind: runsc takes ``linux.resources.cpu.shares`` on both versions and
on v2 writes ``cpu.weight`` from it itself, with the formula of :func:`shares_to_weight` (gVisor's
``runsc/cgroup/cgroup_v2.go``: ``convertCPUSharesToCgroupV2Value``, ``1 + ((shares - 2) * 9999) /
262142``, the one runc uses), so a sandbox booted with a weight and one re-weighted here agree.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import os
from pathlib import Path
from typing import ClassVar

from space.errors import CgroupsUnsupported

ROOT = Path("/sys/fs/cgroup")
#: The parent group of every instance (``cgroupsPath`` is ``/space/<instance>``).
PARENT = "space"

#: cgroup v1 ``cpu.shares``: the range the kernel accepts, and its default.
MIN_SHARES, MAX_SHARES, DEFAULT_SHARES = 2, 262144, 1024
#: cgroup v2 ``cpu.weight``: the range the kernel accepts.
MIN_WEIGHT, MAX_WEIGHT = 1, 10000

#: The v1 hierarchies SPACE uses: the freezer (warm and paused sandboxes, fencing), cpu (weights),
#: cpuacct and memory (stats, OOM kills).
V1_CONTROLLERS = ("freezer", "cpu", "cpuacct", "memory")
#: The v2 controllers the ``space`` subtree needs: SPACE writes cpu and reads memory, and runsc
#: refuses to make a v2 group without any of cpu, cpuset, io, memory and pids (its "mandatory"
#: controllers in runsc/cgroup/cgroup_v2.go), so a host that lacks one fails here, once, instead
#: of at every sandbox start.
V2_CONTROLLERS = ("cpu", "cpuset", "io", "memory", "pids")
#: The first kernel with the v2 freezer (``cgroup.freeze``).
V2_FREEZER_KERNEL = (5, 2)


def shares_to_weight(shares: int) -> int:
    """v1 ``cpu.shares`` (2..262144, default 1024) as v2 ``cpu.weight`` (1..10000): the linear map
    runc, systemd's CPUShares compatibility and runsc (for the spec's shares) use, so that 1024
    becomes 39, not v2's default 100: every instance is re-weighted through this same map."""
    return max(MIN_WEIGHT, min(MAX_WEIGHT, 1 + ((shares - MIN_SHARES) * 9999) // 262142))


@dataclasses.dataclass(frozen=True)
class Usage:
    """What an instance's cgroups account for it; None where the host does not show it."""

    #: CPU time used so far, all of its tasks (nanoseconds).
    cpu_ns: int | None
    #: Memory charged to it now, page cache included (bytes).
    memory_bytes: int | None
    #: Its memory limit (bytes); None: none set.
    memory_limit: int | None
    #: The page cache part of ``memory_bytes``.
    cache_bytes: int | None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text.split()[0]) if text is not None else None
    except (ValueError, IndexError):
        return None


def _keyed(path: Path) -> dict[str, int]:
    """A flat keyed file (``memory.stat``, ``cpu.stat``, ``cgroup.events``, ...): ``key value`` lines."""
    out: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        value = value.strip()
        if value.isdigit():
            out[key] = int(value)
    return out


@dataclasses.dataclass(frozen=True)
class Cgroups(abc.ABC):
    """The cgroup files of instances under ``root`` (a parameter: tests use fake trees).

    Writes raise :class:`OSError` (the caller decides what a missing cgroup means: usually an
    instance already gone); reads answer "nothing" (False, 0, None) when a file cannot be read.
    """

    root: Path = ROOT
    version: ClassVar[int]

    # -- freezing ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def freeze_file(self, instance: str) -> Path:
        """The file whose write freezes (or thaws) every task of the instance."""

    @abc.abstractmethod
    def freeze_value(self, frozen: bool) -> str:
        """What to write into :meth:`freeze_file` to freeze (True) or thaw (False)."""

    def freeze(self, instance: str) -> None:
        """Ask the kernel to freeze the instance (one write). The kernel stops the tasks after the
        write returns, on either version: :meth:`is_frozen` is true at once, :meth:`fully_frozen`
        once every task stopped."""
        self.freeze_file(instance).write_text(self.freeze_value(True))

    def thaw(self, instance: str) -> None:
        self.freeze_file(instance).write_text(self.freeze_value(False))

    @abc.abstractmethod
    def is_frozen(self, instance: str) -> bool:
        """Frozen or on its way (a freeze was asked and not undone): either way nothing in it
        answers, so whoever wants an answer from the instance thaws it first. False when the
        instance has no cgroup."""

    @abc.abstractmethod
    def fully_frozen(self, instance: str) -> bool:
        """Every task of the instance stopped (the kernel finished the freeze)."""

    # -- CPU weight --------------------------------------------------------------------------------

    @abc.abstractmethod
    def cpu_weight_file(self, instance: str) -> Path: ...

    @abc.abstractmethod
    def cpu_weight_value(self, shares: int) -> str:
        """What :meth:`cpu_weight_file` takes for a weight given as v1 shares."""

    def set_cpu_weight(self, instance: str, shares: int) -> None:
        """The instance's relative CPU weight under contention, given as v1 ``cpu.shares`` (2..262144,
        :data:`DEFAULT_SHARES` the default) on both versions (one write)."""
        self.cpu_weight_file(instance).write_text(self.cpu_weight_value(shares))

    # -- accounting --------------------------------------------------------------------------------

    @abc.abstractmethod
    def oom_kills(self, instance: str) -> int:
        """How many tasks the kernel's OOM killer killed in the instance's memory cgroup (which
        outlives the instance until runsc deletes it)."""

    @abc.abstractmethod
    def usage(self, instance: str) -> Usage: ...

    # -- what the helper does ----------------------------------------------------------------------

    def delegated_files(self, instance: str) -> list[Path]:
        """The files the unprivileged node agent writes itself (the helper hands them over)."""
        return [self.freeze_file(instance), self.cpu_weight_file(instance)]

    @abc.abstractmethod
    def instance_groups(self, instance: str) -> list[Path]:
        """Every directory runsc may have made for the instance: what its removal rmdirs."""

    @abc.abstractmethod
    def has_processes(self, instance: str) -> bool:
        """Whether any task is still in the instance's cgroup (False when it has none)."""


@dataclasses.dataclass(frozen=True)
class CgroupsV1(Cgroups):
    version: ClassVar[int] = 1

    def group(self, controller: str, instance: str) -> Path:
        return self.root / controller / PARENT / instance

    def freeze_file(self, instance: str) -> Path:
        return self.group("freezer", instance) / "freezer.state"

    def freeze_value(self, frozen: bool) -> str:
        return "FROZEN" if frozen else "THAWED"

    def is_frozen(self, instance: str) -> bool:
        state = _read(self.freeze_file(instance))
        return state is not None and state.strip() != "THAWED"  # FREEZING or FROZEN

    def fully_frozen(self, instance: str) -> bool:
        return (_read(self.freeze_file(instance)) or "").strip() == "FROZEN"

    def cpu_weight_file(self, instance: str) -> Path:
        return self.group("cpu", instance) / "cpu.shares"

    def cpu_weight_value(self, shares: int) -> str:
        return str(shares)

    def oom_kills(self, instance: str) -> int:
        # ``oom_kill N`` since Linux 4.13; ``under_oom`` and ``oom_kill_disable`` beside it.
        return _keyed(self.group("memory", instance) / "memory.oom_control").get("oom_kill", 0)

    def usage(self, instance: str) -> Usage:
        memory = self.group("memory", instance)
        limit = _read_int(memory / "memory.limit_in_bytes")
        stat = _keyed(memory / "memory.stat")
        return Usage(
            cpu_ns=_read_int(self.group("cpuacct", instance) / "cpuacct.usage"),
            memory_bytes=_read_int(memory / "memory.usage_in_bytes"),
            # v1 shows "no limit" as a page-rounded LONG_MAX.
            memory_limit=limit if limit is not None and limit < 1 << 62 else None,
            cache_bytes=stat.get("total_cache", stat.get("cache")),
        )

    def instance_groups(self, instance: str) -> list[Path]:
        # Every hierarchy mounted here, not only the four SPACE uses: runsc makes the instance's
        # group in each controller it knows (pids, devices, blkio, ...).
        try:
            hierarchies = sorted(d for d in self.root.iterdir() if d.is_dir())
        except OSError:
            return []
        return [d / PARENT / instance for d in hierarchies]

    def has_processes(self, instance: str) -> bool:
        return bool((_read(self.group("freezer", instance) / "cgroup.procs") or "").strip())


@dataclasses.dataclass(frozen=True)
class CgroupsV2(Cgroups):
    version: ClassVar[int] = 2

    def group(self, instance: str) -> Path:
        return self.root / PARENT / instance

    def freeze_file(self, instance: str) -> Path:
        return self.group(instance) / "cgroup.freeze"

    def freeze_value(self, frozen: bool) -> str:
        return "1" if frozen else "0"

    def is_frozen(self, instance: str) -> bool:
        # What was asked (``cgroup.freeze``), not what the kernel finished (``cgroup.events``): a
        # group still freezing reads "frozen 0" there, and its sentry cannot answer either.
        return (_read(self.freeze_file(instance)) or "").strip() == "1"

    def fully_frozen(self, instance: str) -> bool:
        return _keyed(self.group(instance) / "cgroup.events").get("frozen") == 1

    def cpu_weight_file(self, instance: str) -> Path:
        return self.group(instance) / "cpu.weight"

    def cpu_weight_value(self, shares: int) -> str:
        return str(shares_to_weight(shares))

    def oom_kills(self, instance: str) -> int:
        return _keyed(self.group(instance) / "memory.events").get("oom_kill", 0)

    def usage(self, instance: str) -> Usage:
        group = self.group(instance)
        usec = _keyed(group / "cpu.stat").get("usage_usec")
        limit = (_read(group / "memory.max") or "").strip()  # "max": no limit
        stat = _keyed(group / "memory.stat")
        return Usage(
            cpu_ns=None if usec is None else usec * 1000,
            memory_bytes=_read_int(group / "memory.current"),
            memory_limit=int(limit) if limit.isdigit() else None,
            cache_bytes=stat.get("file"),
        )

    def instance_groups(self, instance: str) -> list[Path]:
        return [self.group(instance)]

    def has_processes(self, instance: str) -> bool:
        # "populated" counts the tasks of the whole subtree, and reads the same while frozen.
        return _keyed(self.group(instance) / "cgroup.events").get("populated") == 1


# -- detection -------------------------------------------------------------------------------------


def detect(root: Path = ROOT) -> Cgroups:
    """The cgroup layout under ``root``, or :class:`CgroupsUnsupported` naming what is missing and
    what the operator can do about it.

    v2 when ``root`` is a cgroup2 mount (only its root has ``cgroup.controllers``; runsc decides
    the same by the filesystem's type, ``IsOnlyV2``); otherwise v1 when the freezer, cpu, cpuacct
    and memory hierarchies are mounted under it (a hybrid host's ``unified/`` v2 tree beside them
    holds no controller SPACE uses, and runsc uses v1 there)."""
    if (root / "cgroup.controllers").exists():
        return _check_v2(root)
    missing = [c for c in V1_CONTROLLERS if not (root / c / "cgroup.procs").exists()]
    if not missing:
        return CgroupsV1(root)
    if len(missing) == len(V1_CONTROLLERS) and not (root / "unified" / "cgroup.controllers").exists():
        raise CgroupsUnsupported(
            f"no cgroup hierarchy at {root}: neither cgroup v2 (no {root}/cgroup.controllers) nor the v1 "
            f"controllers {', '.join(V1_CONTROLLERS)}. Mount the host's cgroup2 filesystem at {root} (a "
            "container: run it with the host's cgroup namespace and /sys/fs/cgroup mounted read-write).",
            root=str(root), missing=missing)
    raise CgroupsUnsupported(
        f"cgroup v1 at {root} lacks the {', '.join(missing)} controller hierarchy(s) "
        f"(nothing mounted at {', '.join(f'{root}/{c}' for c in missing)}); SPACE needs "
        f"{', '.join(V1_CONTROLLERS)} on v1. Mount each (mount -t cgroup -o <controller> cgroup "
        f"{root}/<controller>), or boot the host on cgroup v2 alone (systemd.unified_cgroup_hierarchy=1).",
        root=str(root), version=1, missing=missing)


def _check_v2(root: Path) -> CgroupsV2:
    available = (_read(root / "cgroup.controllers") or "").split()
    missing = [c for c in V2_CONTROLLERS if c not in available]
    if missing:
        raise CgroupsUnsupported(
            f"cgroup v2 at {root} does not offer the {', '.join(missing)} controller(s) to its groups "
            f"(its cgroup.controllers: {' '.join(available) or 'none'}); sandboxes need "
            f"{', '.join(V2_CONTROLLERS)}. A controller a v1 hierarchy still holds is not available on v2: "
            "boot the host on cgroup v2 alone (systemd.unified_cgroup_hierarchy=1, or cgroup_no_v1=all); "
            "under a parent cgroup (a container's), the parent must enable them in its cgroup.subtree_control.",
            root=str(root), version=2, missing=missing)
    enabled = (_read(root / "cgroup.subtree_control") or "").split()
    not_enabled = [c for c in V2_CONTROLLERS if c not in enabled]
    # runsc enables the controllers for the subtree itself (it writes ``+cpu +memory ...`` into
    # cgroup.subtree_control from the root down), which v2 refuses in a non-root group that holds
    # processes of its own ("no internal processes"): a container's cgroup namespace root with the
    # node agent in it. (The host's root group has no cgroup.type and is exempt.)
    if not_enabled and (root / "cgroup.type").exists() and (_read(root / "cgroup.procs") or "").strip():
        raise CgroupsUnsupported(
            f"cgroup v2 at {root} is a group with processes in it, and does not enable "
            f"{', '.join(not_enabled)} for its children (cgroup.subtree_control: {' '.join(enabled) or 'none'}): "
            "v2 lets only a group without processes of its own enable controllers, so runsc cannot give "
            f"{root}/{PARENT}/<instance> its limits. Run the node agent in the host's cgroup namespace "
            "(hostPID and the host's /sys/fs/cgroup), or move the processes of this group into a child "
            "group and enable the controllers in its cgroup.subtree_control.",
            root=str(root), version=2, missing=not_enabled)
    if not _v2_freezer(root):
        raise CgroupsUnsupported(
            f"cgroup v2 at {root} has no freezer: no cgroup.freeze in its groups. It needs Linux "
            f"{'.'.join(map(str, V2_FREEZER_KERNEL))} or newer (this kernel: {os.uname().release}); "
            "upgrade the kernel, or run the node on cgroup v1 with the freezer hierarchy mounted.",
            root=str(root), version=2, missing=["cgroup.freeze"])
    return CgroupsV2(root)


def _v2_freezer(root: Path) -> bool:
    """Whether groups under ``root`` can be frozen. ``cgroup.freeze`` is in every non-root group on
    a kernel with the v2 freezer (5.2+), never in the root group: look at the groups below ``root``
    and at ``root`` itself when it is not the root (a container's cgroup namespace root: it has
    ``cgroup.type``, which the root group lacks); with no group to look at, the kernel's version
    says."""
    candidates = [root] if (root / "cgroup.type").exists() else []
    with contextlib.suppress(OSError):
        candidates += sorted(d for d in root.iterdir() if d.is_dir())
    groups = [d for d in candidates if (d / "cgroup.procs").exists()]
    if groups:
        return any((d / "cgroup.freeze").exists() for d in groups)
    return _kernel() >= V2_FREEZER_KERNEL


def _kernel() -> tuple[int, int]:
    major, _, rest = os.uname().release.partition(".")
    minor = rest.split(".")[0].split("-")[0]
    try:
        return int(major), int(minor)
    except ValueError:
        return 0, 0


@functools.cache
def host() -> Cgroups:
    """This machine's layout (:data:`ROOT`), detected on the first call and kept: the node agent and
    the root helper call this at their start, so a host SPACE cannot run on stops them there with a
    :class:`~space.errors.CgroupsUnsupported` (the mounts never change under a running node)."""
    return detect(ROOT)
