"""The registry of privileged verbs and the parsing of their arguments.

A verb is an async function ``(ctx, args, call) -> dict`` registered with :func:`verb` under a
dotted name, with the frozen dataclass its arguments parse into and a cap on its timeout. Parsing
(:func:`parse_args`) is strict: unknown keys, missing keys, wrong JSON types and values outside a
field's check are refused with ``invalid_request`` before the verb runs -- the same in-process and
over RPC, so a test of a verb is a test of what the helper accepts.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import types
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from space.egress_policy import DEFAULT_SANDBOX_NETWORK
from space.errors import InvalidRequest
from space.runtime.cgroups import Cgroups

ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

LineSink = Callable[[str], Awaitable[None]]


#: A build's bound unless the operator sets one (``$SPACE_BUILD_MAX_BYTES``).
DEFAULT_BUILD_MAX_BYTES: Final = 32 << 30


@dataclass(frozen=True)
class GatewayConfig:
    """How the helper runs the node's egress gateway (``space.node.network.gateway.GatewayProcess``)."""

    control: Path  # its control socket
    ca_dir: Path
    user: str | None = "space-gw"
    control_group: int | None = None  # the group that may use the control socket: the agent's
    hosts_file: Path | None = None  # test-only resolver
    upstream_ca: Path | None = None  # test-only upstream trust
    upstream_dns: str | None = None  # the resolver the gateway asks (IP[:PORT]; default: the system's)
    #: The private ranges (CIDRs) policies may open on this node: the deployment's egress ceiling.
    private_ceiling: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> GatewayConfig:
        def path(key: str) -> Path | None:
            return Path(doc[key]) if doc.get(key) is not None else None

        control, ca_dir = path("control"), path("ca_dir")
        if control is None or ca_dir is None:
            raise ValueError("a gateway config needs 'control' and 'ca_dir'")
        return cls(control=control, ca_dir=ca_dir, user=doc.get("user", "space-gw"),
                   control_group=doc.get("control_group"), hosts_file=path("hosts_file"),
                   upstream_ca=path("upstream_ca"), upstream_dns=doc.get("upstream_dns"),
                   private_ceiling=tuple(str(c) for c in doc.get("private_ceiling") or ()))


@dataclass(frozen=True)
class HelperContext:
    """What the helper fixed at its start: every verb resolves names under these roots."""

    data_dir: Path
    cache_dir: Path
    #: The btrfs pool's root (None: ``<data_dir>/pool``).
    pool_root: Path | None = None
    #: The guest daemon's directory, bind-mounted read-only into every sandbox (None: the package's).
    guest_dir: Path | None = None
    runsc: str = "runsc"
    platform: str = "systrap"
    #: The unprivileged node agent's uid (None: the agent is root): it gets the instance cgroup
    #: files it writes itself.
    agent_uid: int | None = None
    #: Where the instances' cgroups are (None: this host's, :func:`space.runtime.cgroups.host`,
    #: which the helper detects at its start).
    cgroups: Cgroups | None = None
    gateway: GatewayConfig | None = None
    #: The Debian mirrors template builds may debootstrap from (empty: the default one only).
    mirrors: tuple[str, ...] = ()
    #: The container registries template builds may pull images from, ``https://host[:port]``
    #: (``http://`` for one without TLS); empty: none.
    registries: tuple[str, ...] = ()
    #: What one template build may write into its tree (an image's layers unpacked, its steps),
    #: held by the pool's quota on the build's subvolume; an image whose layers are larger than
    #: this (compressed) is refused before it is pulled.
    build_max_bytes: int = DEFAULT_BUILD_MAX_BYTES
    #: The containers-policy.json(5) images are pulled under (None: any image of a listed registry)
    #: and the containers-registries.d(5) directory saying where their signatures are.
    image_policy: Path | None = None
    signatures: Path | None = None
    #: The deployment's sandbox address range; this node takes a /20 of it (net.setup).
    sandbox_network: ipaddress.IPv4Network = field(
        default_factory=lambda: ipaddress.IPv4Network(DEFAULT_SANDBOX_NETWORK))

    @property
    def pool(self) -> Path:
        return self.pool_root or self.data_dir / "pool"

    @property
    def guest(self) -> Path:
        if self.guest_dir is not None:
            return self.guest_dir
        from space import guest
        return Path(guest.__file__).resolve().parent
    #: Ports of the node's egress gateway, as the nftables rules redirect to them.
    gateway_ports: tuple[int, int, int] = (3128, 3129, 53)  # proxy, transparent, dns


@dataclass
class Call:
    """One invocation: the fds passed with it (by role) and where a streaming verb's lines go."""

    fds: Mapping[str, int] = field(default_factory=dict)
    emit: LineSink | None = None
    #: The calling process, as the kernel named it (``SO_PEERCRED``; this process in-process).
    peer_pid: int = field(default_factory=os.getpid)

    async def line(self, text: str) -> None:
        if self.emit is not None:
            await self.emit(text[:8192])


A = TypeVar("A")
VerbFn = Callable[[HelperContext, Any, Call], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Verb:
    name: str
    args: type
    fn: VerbFn
    cap: float  # seconds: the most a caller may ask for as its timeout
    fds: tuple[str, ...] = ()  # roles of the fds it accepts
    streaming: bool = False
    #: Logged at info (the node's record of privileged operations); False for polled read-only
    #: verbs (a gateway liveness check every 2 s), which are logged at debug.
    audit: bool = True


REGISTRY: dict[str, Verb] = {}


VerbImpl = Callable[[HelperContext, A, Call], Awaitable[dict[str, Any]]]


def verb(name: str, args: type[A], *, cap: float, fds: tuple[str, ...] = (), streaming: bool = False,
         audit: bool = True) -> Callable[[VerbImpl[A]], VerbImpl[A]]:
    def register(fn: VerbImpl[A]) -> VerbImpl[A]:
        if name in REGISTRY:
            raise RuntimeError(f"verb {name} registered twice")
        REGISTRY[name] = Verb(name, args, _full_is_storage(name, fn), cap, fds, streaming, audit)
        return fn
    return register


def _full_is_storage(name: str, fn: VerbImpl[A]) -> VerbImpl[A]:
    """A verb that meets a full pool (ENOSPC) or a disk limit (EDQUOT: a sandbox root's, or the
    share all sandbox roots may take) says so: ``insufficient_storage`` (507), not an internal error."""
    import errno
    import functools

    from space.errors import InsufficientStorage

    @functools.wraps(fn)
    async def wrapped(ctx: HelperContext, args: A, call: Call) -> dict[str, Any]:
        try:
            return await fn(ctx, args, call)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise InsufficientStorage(f"{name}: no room in the node's pool ({os.strerror(exc.errno)})",
                                      verb=name) from None
    return wrapped


def lookup(name: str) -> Verb:
    load_all()
    found = REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise InvalidRequest(f"unknown privileged verb {name!r}", verb=str(name)[:64])
    return found


def load_all() -> None:
    """Import every verb module (each registers itself)."""
    from space.node.helper import (  # noqa: F401
        verbs_core,
        verbs_gateway,
        verbs_net,
        verbs_oci,
        verbs_pool,
        verbs_runtime,
        verbs_stream,
        verbs_template,
    )


# -- argument parsing ---------------------------------------------------------------------------


def check(pred: Callable[[Any], bool], what: str) -> Any:
    """Field metadata: ``x: int = field(metadata=check(lambda v: 1 <= v <= 9, "1..9"))``."""
    return {"check": (pred, what)}


def is_id(value: str) -> bool:
    return ID_RE.fullmatch(value) is not None


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str) and "\x00" not in value
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return isinstance(value, list | tuple) and all(_matches(v, item) for v in value)
    return False


def parse_args(cls: type[A], raw: Any) -> A:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise InvalidRequest("verb arguments must be an object")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(raw) - set(fields)
    if unknown:
        raise InvalidRequest(f"unknown arguments: {sorted(unknown)}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise InvalidRequest(f"argument {name!r} is required")
            continue
        value = raw[name]
        if not _matches(value, hints[name]):
            raise InvalidRequest(f"argument {name!r} has the wrong type")
        if isinstance(value, list):
            value = tuple(value)
        checked = f.metadata.get("check")
        if checked is not None and value is not None:
            pred, what = checked
            items = value if isinstance(value, tuple) else (value,)
            if not all(pred(v) for v in items):
                raise InvalidRequest(f"argument {name!r} must be {what}")
        values[name] = value
    return cls(**values)
