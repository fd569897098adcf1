"""The runtime driver interface (prepare, start, pause, resume, checkpoint, restore, stop, guest
channel). Nothing above it may know which driver runs a sandbox."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """Everything a driver needs to boot one runtime instance of a sandbox."""

    sandbox_id: str
    instance_id: str
    rootfs: Path
    #: Per-instance working directory (bundle, sockets, logs); the driver owns its contents.
    workdir: Path
    guest_dir: Path
    #: Directory for the shim's channel socket (kept short: unix socket paths max 107 bytes).
    channel_dir: Path
    cpu: float
    memory_mb: int
    hostname: str
    #: Relative CPU weight under contention (cgroup ``cpu.shares``; None: the default 1024). Warm
    #: pool sandboxes boot and wait with a low weight so they never slow down claimed ones.
    cpu_shares: int | None = None
    #: Network namespace to run in (its ``eth0`` becomes the guest's only link); None: loopback only.
    netns: Path | None = None
    #: The node's index of that namespace (how the root helper names it).
    net_index: int | None = None


@dataclasses.dataclass(frozen=True)
class InstanceHandle:
    instance_id: str
    #: Unix socket of the per-instance shim that holds the guest channel.
    channel: Path
    shim_pid: int


class RuntimeDriver(Protocol):
    name: str

    async def start(self, spec: InstanceSpec) -> InstanceHandle:
        """Boot the instance with the guest daemon as PID 1; return once the runtime started it."""

    async def restore(self, spec: InstanceSpec, image: Path) -> InstanceHandle:
        """Boot a new instance from a checkpoint image (memory) over ``spec.rootfs`` (the disk the
        image was taken with); the instance id must be new."""

    async def pause(self, instance_id: str) -> None:
        """Stop the instance through the runtime (its sentry answers, its guest runs nothing) and
        freeze it as well (no CPU), memory kept: what a checkpoint of a paused instance needs."""

    async def resume(self, instance_id: str) -> None:
        """Undo :meth:`pause`."""

    async def hold(self, instance_id: str) -> None:
        """Stop every thread of the instance where it stands (the cgroup freezer, as
        :meth:`freeze`) and return once all have stopped: a pause that costs no CPU, undone by
        :meth:`thaw`. The runtime does not know: whatever needs its sentry (a checkpoint) must
        :meth:`thaw` and :meth:`pause` first."""

    async def checkpoint(self, instance_id: str, image: Path) -> None:
        """Write the instance's memory state to ``image``, leaving it running (or paused) as it was."""

    def set_cpu_shares(self, instance_id: str, shares: int) -> None:
        """Change the instance's relative CPU weight now (see :attr:`InstanceSpec.cpu_shares`)."""

    def freeze(self, instance_id: str) -> None:
        """Stop every thread of the instance where it stands (cgroup freezer): it costs no CPU at
        all until :meth:`thaw`. Nothing may talk to it meanwhile; kill and stop thaw it first."""

    def take_fence_mark(self, workdir: Path) -> bool:
        """Whether the instance was frozen outside the agent because the node's lease ran out
        (reading the mark consumes it)."""

    def thaw(self, instance_id: str) -> None:
        """Undo :meth:`freeze` (idempotent: a thawed instance stays as it is)."""

    async def kill(self, instance_id: str, workdir: Path) -> None:
        """Kill every process of the instance at once; it still needs :meth:`stop`. Whatever
        the driver keeps beside the instance (its shim) goes first."""

    async def stop(self, instance_id: str, workdir: Path) -> None:
        """Kill and remove the instance; idempotent (an unknown instance is not an error)."""

    async def state(self, instance_id: str) -> str | None:
        """The runtime's view: "running", "paused", "stopped", ... or None when unknown."""

    async def death_cause(self, instance_id: str) -> str | None:
        """Why a stopped instance ended, when the runtime knows: "oom" or None."""

    async def list_instances(self) -> dict[str, str]:
        """Every instance this driver knows on the node: id -> state."""

    async def sweep(self, keep: set[str]) -> list[str]:
        """Kill what is left running of instances the runtime keeps no record of (a start cut
        short), except ``keep``; the instances it found."""

    async def version(self) -> str: ...
