"""A node joining its cluster: a join token in, a node certificate out, then mutual TLS.

On every start the agent joins again (``POST /v1/nodes/join``) with a CSR made from the key it keeps
in ``<data>/node/tls/node.key`` (made on the first start, never sent anywhere): the control plane
learns the node's current address, the node gets a fresh certificate, and its key proves it is the
node that joined before under this id. If the control plane cannot be reached, or the token has
expired since, a node that holds a certificate still valid for this address serves with it (a
restart must not need the control plane); a node without one cannot serve and says why.

The token is sent only over HTTPS (or to a loopback control plane): whoever reads it can join nodes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import json
import ssl
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import structlog
from cryptography import x509

from space.cluster import pki

log = structlog.get_logger("space.node.membership")

#: The most of the control plane's answer a node reads (two certificates and a node row).
MAX_ANSWER = 256 * 1024


class JoinError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclasses.dataclass(frozen=True)
class JoinSettings:
    #: The control plane's API (any replica), ``https://…`` (``http://`` to a loopback address only).
    control_url: str
    #: The join token (a file: a Kubernetes Secret, never a command-line argument).
    token_file: Path
    #: Where the control plane reaches this node: ``https://NAME:PORT``, NAME its certificate's.
    advertise_url: str
    #: CA certificates (PEM) the control plane's HTTPS certificate is checked with; None: the system's.
    control_ca_file: Path | None = None


@dataclasses.dataclass(frozen=True)
class NodeTLSFiles:
    key: Path
    cert: Path
    ca: Path

    @classmethod
    def under(cls, state_dir: Path) -> NodeTLSFiles:
        d = state_dir / "tls"
        return cls(key=d / "node.key", cert=d / "node.crt", ca=d / "cluster-ca.crt")

    def server_context(self) -> ssl.SSLContext:
        return pki.server_context(self.cert, self.key, self.ca)


def check_control_url(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme == "https" and host:
        return url.rstrip("/")
    if parts.scheme == "http" and _loopback(host):
        return url.rstrip("/")
    raise JoinError(f"--control-url {url!r}: the join token goes there, so it must be https:// "
                    "(http:// only to a loopback address)")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _version() -> str:
    try:
        return metadata.version("space")
    except metadata.PackageNotFoundError:
        return "unknown"


async def join(settings: JoinSettings, node_id: str, files: NodeTLSFiles) -> NodeTLSFiles:
    """Join (or join again) and leave the node's TLS files in place; :class:`JoinError` if this node
    cannot serve."""
    control = check_control_url(settings.control_url)
    files.key.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not files.key.exists():
        pki.write_private(files.key, pki.new_key())
        log.info("node.key_created", path=str(files.key))
    try:
        token = settings.token_file.read_text().strip()
    except OSError as e:
        raise JoinError(f"cannot read the join token from {settings.token_file}: {e.strerror}") from None
    csr = pki.csr_for_key(files.key.read_bytes(), node_id)
    body = {"node_id": node_id, "advertise_url": settings.advertise_url, "csr": csr.decode(), "version": _version()}
    verify: ssl.SSLContext | bool = True
    if settings.control_ca_file is not None:
        verify = ssl.create_default_context(cafile=str(settings.control_ca_file))
    try:
        async with httpx.AsyncClient(base_url=control, timeout=30, verify=verify) as http, \
                http.stream("POST", "/v1/nodes/join", json=body,
                            headers={"authorization": f"Bearer {token}"}) as resp:
            raw = b""
            async for chunk in resp.aiter_bytes():
                raw += chunk
                if len(raw) > MAX_ANSWER:
                    raise JoinError(f"the control plane's answer is over {MAX_ANSWER} bytes")
            status = resp.status_code
    except httpx.HTTPError as e:
        return _keep_serving(files, settings, f"the control plane at {control} did not answer: {e!r}")
    if status != 201:
        message = _error_message(raw)
        if status >= 500 or status == 401:
            # Down, or a token that has expired since this node joined: what it has still works.
            return _keep_serving(files, settings, f"join refused ({status}): {message}")
        raise JoinError(f"the control plane refused the join ({status}): {message}")
    try:
        answer = json.loads(raw)
        cert, ca = answer["certificate"].encode(), answer["ca_certificate"].encode()
        if pki.node_id_of(cert) != node_id or pki.public_key_sha256(cert) != pki.public_key_sha256(csr):
            raise JoinError("the control plane answered a certificate for another node or key")
    except (ValueError, KeyError, TypeError, AttributeError, pki.PKIError) as e:
        raise JoinError(f"the control plane's answer is not a node certificate: {e}") from None
    pki.write_private(files.ca, ca)
    pki.write_private(files.cert, cert)
    log.info("node.joined", node=node_id, control_plane=control, advertise=settings.advertise_url,
             node_state=answer.get("node", {}).get("state"))
    return files


def _keep_serving(files: NodeTLSFiles, settings: JoinSettings, why: str) -> NodeTLSFiles:
    """Serve with the certificate from the last join when it is still valid here, else refuse."""
    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        files.ca.read_bytes()
    except (OSError, ValueError):
        raise JoinError(f"{why}; and this node holds no certificate from an earlier join") from None
    if cert.not_valid_after_utc <= dt.datetime.now(dt.UTC):
        raise JoinError(f"{why}; and this node's certificate expired at {cert.not_valid_after_utc.isoformat()}")
    host = (urlsplit(settings.advertise_url).hostname or "").lower()
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = {str(v).lower() for v in sans.get_values_for_type(x509.DNSName)} | \
            {str(v) for v in sans.get_values_for_type(x509.IPAddress)}
    except x509.ExtensionNotFound:
        names = set()
    if host not in names:
        raise JoinError(f"{why}; and this node's certificate is for {sorted(names)}, not {host!r}")
    log.warning("node.join_skipped", reason=why, serving_with=str(files.cert),
                expires=cert.not_valid_after_utc.isoformat())
    return files


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return f"{err.get('code')}: {str(err.get('message'))[:300]}"
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode(errors="replace")
