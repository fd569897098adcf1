"""Whether Kubernetes is taking this machine away: its Node object, read with the pod's service
account (the in-cluster configuration every Kubernetes client uses: ``KUBERNETES_SERVICE_HOST`` and
``_PORT``, the token and CA under ``/var/run/secrets/kubernetes.io/serviceaccount``).

A node pod is stopped both for a rollout and for its machine's end; only the Node says which. A Node
on its way out is cordoned (``kubectl drain``) or carries the taint of whatever removes it. The node
pod's service account may ``get`` Nodes and nothing else (deploy/kubernetes/base/node.yaml).
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from space.errors import Unavailable

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: Taints that mean the machine is being removed, and by what.
LEAVING_TAINTS = {
    "ToBeDeletedByClusterAutoscaler": "the cluster autoscaler is removing the node",
    "karpenter.sh/disrupted": "Karpenter is disrupting the node",
    "karpenter.sh/disruption": "Karpenter is disrupting the node",
    "node.kubernetes.io/out-of-service": "the node is out of service",
    "node.cloudprovider.kubernetes.io/shutdown": "the cloud provider shut the machine down",
}
#: A Node's name: a DNS subdomain.
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
#: The most of a Node object read (they are a few KiB; images lists can grow them).
_MAX_BYTES = 4 << 20


def leaving_reason(node: Mapping[str, Any]) -> str | None:
    """Why the Node is going away (None: it is not)."""
    spec = node.get("spec")
    if not isinstance(spec, Mapping):
        return None
    for taint in spec.get("taints") or []:
        if isinstance(taint, Mapping) and taint.get("key") in LEAVING_TAINTS:
            return f"{LEAVING_TAINTS[taint['key']]} (taint {taint['key']})"
    if spec.get("unschedulable") is True:
        return "the node is cordoned (kubectl cordon or drain)"
    return None


def read_node(name: str, *, env: Mapping[str, str] | None = None, account: Path = SERVICE_ACCOUNT,
              timeout: float = 5.0) -> dict[str, Any]:
    """The Node object ``name``; Unavailable saying why it could not be read."""
    if not _NODE_NAME.fullmatch(name):
        raise Unavailable(f"{name!r} is not a Kubernetes node name")
    env = os.environ if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise Unavailable("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST)")
    try:
        token = (account / "token").read_text().strip()
    except OSError as exc:
        raise Unavailable(f"no service account token: {exc.strerror} ({account / 'token'})") from None
    host = f"[{host}]" if ":" in host else host
    try:
        trusted = ssl.create_default_context(cafile=str(account / "ca.crt"))
        with httpx.Client(verify=trusted, timeout=timeout) as client, client.stream(
                "GET", f"https://{host}:{port}/api/v1/nodes/{name}",
                headers={"authorization": f"Bearer {token}", "accept": "application/json"}) as r:
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > _MAX_BYTES:
                    raise Unavailable(f"the Node object {name} is larger than {_MAX_BYTES} bytes")
    except (httpx.HTTPError, OSError) as exc:  # ssl.SSLError is an OSError
        raise Unavailable(f"cannot read the Node {name}: {exc}") from None
    if r.status_code != 200:
        raise Unavailable(f"reading the Node {name} answered {r.status_code}: {body[:200]!r}")
    try:
        doc = httpx.Response(200, content=body).json()
    except ValueError:
        raise Unavailable(f"the Node {name} is not JSON") from None
    if not isinstance(doc, dict):
        raise Unavailable(f"the Node {name} is not an object")
    return doc
