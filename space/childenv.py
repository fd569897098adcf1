"""The environment of every process SPACE starts, built here from an allowlist and never copied.

``space serve`` starts with whatever its operator's shell holds: the deployment's master key, the
object store's ``AWS_*`` credentials, a Vault token, and anything else. Copied into children, those
would reach the egress gateway (which parses the sandboxes' hostile traffic) and runsc (which runs
them). So no spawn site passes its own environment on: each asks :func:`build` for the one its
role is allowed, made of

- the names :data:`ALLOW` gives the role, taken from the parent's environment when set there (no
  secret among them: settings such as ``SPACE_LOG_LEVEL``, and ``PATH``, which defaults to
  :data:`DEFAULT_PATH`);
- and what the caller passes explicitly, by name (``extra``): e.g. the shim's ``PYTHONPATH`` or
  debootstrap's locale. Those names must be among the role's :data:`EXPLICIT` ones.

Secrets a child needs go by descriptor, never by environment: the node agent gets the object
store's credentials on a pipe from its supervisor (:mod:`space.nodesup`, ``--secrets-fd``).

The API process of ``space serve`` is started by its operator, not by SPACE: once it has read what
it needs (:func:`snapshot`), :func:`confine_self` cuts its own environment down to its role's and
wipes the block the kernel shows as ``/proc/<pid>/environ``.

``tests/security/test_secret_env_guard.py`` fails when a spawn site in ``space/`` does not pass
``env=`` built here; ``tests/security/test_secret_env.py`` reads every process of a real server.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from typing import Final, Literal

Role = Literal["tool", "shim", "helper", "gateway", "nodesup", "node", "api", "runsc"]

DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: Settings (never secrets) every Python process of SPACE reads from its environment.
_LOGGING: Final = ("SPACE_LOG_LEVEL",)
#: The node agent's settings (``NodeSettings``, failpoints, the gateway's interpreter for its helper).
_NODE_SETTINGS: Final = ("SPACE_NODE_USER", "SPACE_SSE_KEEPALIVE", "SPACE_GATEWAY_HOSTS_FILE",
                         "SPACE_GATEWAY_UPSTREAM_CA", "SPACE_GATEWAY_UPSTREAM_DNS", "SPACE_GATEWAY_PYTHON",
                         "SPACE_FAILPOINTS", "SPACE_BUILD_MIRRORS", "SPACE_BUILD_EGRESS",
                         "SPACE_BUILD_REGISTRIES", "SPACE_BUILD_MAX_BYTES", "SPACE_BUILD_IMAGE_POLICY",
                         "SPACE_BUILD_SIGNATURES")

#: Per role, the names taken from the parent's environment (when set there).
ALLOW: Final[Mapping[Role, tuple[str, ...]]] = {
    # btrfs, mount, losetup, blkid, mkfs, ip, nft, zstd, cc, chroot, debootstrap: a PATH, nothing else.
    "tool": ("PATH",),
    # runsc, and the sentries and gofers it leaves running.
    "runsc": ("PATH",),
    # space.runtime.shim: imports the stdlib and its own module only.
    "shim": ("PATH",),
    # The root helper: runs the tools and runsc, and starts the gateway.
    "helper": ("PATH", *_LOGGING, "SPACE_GATEWAY_PYTHON"),
    # The egress gateway: everything it needs is on its command line and in descriptors. Not even
    # mitmproxy's own variables (SSLKEYLOGFILE would write the TLS keys of intercepted traffic).
    "gateway": ("PATH",),
    # space.nodesup, the node agent's root supervisor.
    "nodesup": ("PATH", *_LOGGING),
    # The node agent of ``space serve``.
    "node": ("PATH", *_LOGGING, *_NODE_SETTINGS),
    # The API of ``space serve`` after it read its settings and secrets (:func:`confine_self`): it
    # starts no process, and keeps what libraries read later (TLS roots and proxies for its Vault
    # client, the locale).
    "api": ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "SSL_CERT_FILE",
            "SSL_CERT_DIR", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy",
            *_LOGGING, "SPACE_FAILPOINTS", "SPACE_CLAIM_GRACE"),
}

#: Per role, the names a caller may set explicitly (``extra``): values SPACE itself decides.
EXPLICIT: Final[Mapping[Role, tuple[str, ...]]] = {
    # debootstrap's first stage (container=lxc: its target is on the nodev pool) and the base
    # template's scripts (CHROOT_ENV); build steps get HOST_CA.
    "tool": ("LC_ALL", "DEBIAN_FRONTEND", "container", "HOST_CA"),
    "runsc": (),
    "shim": ("PYTHONPATH",),
    "helper": (),
    "gateway": (),
    "nodesup": (),
    "node": (),
    # privdrop.drop_privileges sets the user's own.
    "api": ("HOME", "USER", "LOGNAME"),
}


#: Per role, names a process sets for itself: runsc is started through ``sh -c`` (the helper's
#: launcher, which mounts the sandbox's root first), and a shell sets these of its own.
SELF_SET: Final[Mapping[Role, tuple[str, ...]]] = {"runsc": ("PWD", "SHLVL", "_")}


class EnvError(ValueError):
    """A caller asked for a name its child's role may not be given."""


def names(role: str) -> frozenset[str]:
    """Every name a process of ``role`` may hold (what the e2e test checks ``/proc`` against)."""
    r = _role(role)
    return frozenset(ALLOW[r]) | frozenset(EXPLICIT[r]) | frozenset(SELF_SET.get(r, ()))


def build(role: Role, extra: Mapping[str, str] | None = None, *,
          source: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child of ``role``: the allowed names of ``source`` (default: this
    process's environment), ``PATH`` defaulted, then ``extra`` (each name must be the role's)."""
    r = _role(role)
    src = os.environ if source is None else source
    env = {k: src[k] for k in ALLOW[r] if k in src}
    env.setdefault("PATH", DEFAULT_PATH)
    for k, v in (extra or {}).items():
        if k not in EXPLICIT[r] and k not in ALLOW[r]:
            raise EnvError(f"{k} is not a variable a {r} process may be given (space/childenv.py)")
        env[k] = v
    return env


def tool(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a host tool (btrfs, ip, nft, zstd, debootstrap...)."""
    return build("tool", extra)


def snapshot() -> dict[str, str]:
    """This process's environment as it started, for the code that reads settings and secrets from
    it before :func:`confine_self` (credentials, object store, the node agent's secrets)."""
    return dict(os.environ)


def confine_self(role: Role) -> None:
    """Cut this process's own environment down to ``role``'s and wipe the one it started with.

    ``os.environ`` and libc's ``environ`` then hold only the allowed names; the kernel's copy of the
    initial block (``/proc/<pid>/environ``, a core dump) is overwritten with zeros. Call it before
    any thread is started: ``setenv`` is not thread-safe."""
    keep = build(role)
    os.environ.clear()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.clearenv()
    os.environ.update(keep)
    _wipe_initial_block()


def _wipe_initial_block() -> None:
    """Overwrite the environment strings the kernel laid out at exec with zeros (fields 50-51 of
    ``/proc/self/stat``: ``env_start``, ``env_end``). Nothing points into them any more: Python copied
    them at startup and :func:`confine_self` replaced libc's pointers first."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    # The fields after "(comm)" start at field 3: env_start is field 50, env_end field 51.
    start, end = int(fields[50 - 3]), int(fields[51 - 3])
    if 0 < start < end:
        ctypes.memset(start, 0, end - start)


def _role(role: str) -> Role:
    if role not in ALLOW:
        raise EnvError(f"unknown process role {role!r}")
    return role  # type: ignore[return-value]
