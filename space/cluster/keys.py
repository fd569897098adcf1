"""The keys every control-plane replica must hold the same copy of.

One API replica signs an attach token that another verifies; one controller seals a credential
that another opens; any replica admits a node with the cluster CA. A replica that made up its own
key would fail those calls intermittently, behind a load balancer, long after it started — so a
replica that is not given a key refuses to start, naming it.

Each key comes, first found wins, from:

1. the environment variable (``SPACE_SECRET_KEY``…), the value itself;
2. the file named by the same variable with ``_FILE`` appended (``SPACE_SECRET_KEY_FILE``);
3. ``<keys dir>/<file name>`` (``--keys-dir``: a Kubernetes Secret mounted as a directory).

``space keys generate DIR`` makes a full set once, for the operator to distribute. ``space serve``
(one machine) keeps making its own in its data directory on first start, as before.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from space.cluster.pki import ClusterCA, PKIError, write_private
from space.credentials.crypto import Keyring, MasterKeyError, encode_key, generate_key, parse_keys


@dataclasses.dataclass(frozen=True)
class KeySpec:
    #: Its file's name in a keys directory.
    file: str
    #: The environment variable holding it.
    env: str
    #: What it is, for messages.
    what: str


SIGNING = KeySpec("secret.key", "SPACE_SECRET_KEY", "attach and envd token signing key")
MASTER = KeySpec("master.key", "SPACE_MASTER_KEY", "credential master key")
CLUSTER_CA_CERT = KeySpec("cluster-ca.pem", "SPACE_CLUSTER_CA_CERT", "cluster CA certificate")
CLUSTER_CA_KEY = KeySpec("cluster-ca.key", "SPACE_CLUSTER_CA_KEY", "cluster CA private key")
ALL = (SIGNING, MASTER, CLUSTER_CA_CERT, CLUSTER_CA_KEY)

#: The most a key file may hold (a PEM key is ~250 bytes, a master key ring a few lines).
MAX_KEY_BYTES = 64 * 1024


class SharedKeyError(Exception):
    """A shared key is missing or unusable; the message says which and how to give it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclasses.dataclass(frozen=True)
class SharedKeys:
    #: HMAC key of attach tokens and envd access tokens.
    signing: bytes
    #: The credential store's master keys.
    keyring: Keyring
    #: Signs node certificates and this replica's own client certificate.
    cluster_ca: ClusterCA

    @classmethod
    def load(cls, env: Mapping[str, str], keys_dir: Path | None) -> SharedKeys:
        """Every shared key, or :class:`SharedKeyError` naming each one missing."""
        found: dict[KeySpec, bytes] = {}
        missing: list[str] = []
        for spec in ALL:
            value = read_key(spec, env, keys_dir)
            if value is None:
                missing.append(f"{spec.what} (${spec.env}, ${spec.env}_FILE"
                               + (f" or {keys_dir / spec.file}" if keys_dir else " or --keys-dir") + ")")
            else:
                found[spec] = value
        if missing:
            raise SharedKeyError("missing shared keys, which every replica must be given the same copy of: "
                            + "; ".join(missing) + ". `space keys generate DIR` makes a set once.")
        signing = found[SIGNING].strip()
        if len(signing) < 32:
            raise SharedKeyError(f"the {SIGNING.what} is {len(signing)} bytes: give at least 32")
        try:
            keyring = Keyring(parse_keys(found[MASTER].decode(errors="replace"), MASTER.env))
        except MasterKeyError as e:
            raise SharedKeyError(f"the {MASTER.what}: {e.message}") from None
        try:
            ca = ClusterCA.load(found[CLUSTER_CA_CERT], found[CLUSTER_CA_KEY])
        except PKIError as e:
            raise SharedKeyError(f"the cluster CA: {e}") from None
        return cls(signing=signing, keyring=keyring, cluster_ca=ca)


def read_key(spec: KeySpec, env: Mapping[str, str], keys_dir: Path | None) -> bytes | None:
    """One key's bytes by the rules of the module doc; None when nothing gives it."""
    value = env.get(spec.env, "").strip()
    if value:
        return value.encode()
    file = env.get(spec.env + "_FILE", "").strip()
    path = Path(file) if file else (keys_dir / spec.file if keys_dir is not None else None)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_BYTES + 1)
    except FileNotFoundError:
        if file:  # named explicitly: a typo must not read as "not given"
            raise SharedKeyError(f"${spec.env}_FILE names {path}, which does not exist") from None
        return None
    except OSError as e:
        raise SharedKeyError(f"cannot read the {spec.what} from {path}: {e.strerror}") from None
    if len(data) > MAX_KEY_BYTES:
        raise SharedKeyError(f"{path} holds more than {MAX_KEY_BYTES} bytes: not a {spec.what}")
    return data if data.strip() else None


def generate(keys_dir: Path) -> list[Path]:
    """Write a new set of shared keys into ``keys_dir`` (0700), each file 0600; refuses to replace
    any that exists (a new key would orphan what the old one signed or sealed)."""
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = [spec.file for spec in ALL if (keys_dir / spec.file).exists()]
    if existing:
        raise SharedKeyError(f"{keys_dir} already holds {', '.join(existing)}: refusing to replace shared keys")
    ca = ClusterCA.create()
    contents = {
        SIGNING: secrets.token_urlsafe(32).encode() + b"\n",
        MASTER: encode_key(generate_key()).encode() + b"\n",
        CLUSTER_CA_CERT: ca.cert_pem,
        CLUSTER_CA_KEY: ca.key_pem,
    }
    out = []
    for spec, data in contents.items():
        write_private(keys_dir / spec.file, data)
        out.append(keys_dir / spec.file)
    os.chmod(keys_dir, 0o700)
    return out
