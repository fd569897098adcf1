"""The Kubernetes manifests (deploy/kubernetes): every overlay renders, validates and holds its posture.

- base, kind and eks render with ``kubectl kustomize`` (the overlays' secrets made by
  make-secrets.sh, as an operator makes them)
- every rendered object validates against Kubernetes' own JSON schemas, strictly (an unknown or
  misspelt field is an error), for each supported minor version
- checkov's findings on each overlay are exactly the accepted ones in deploy/kubernetes/posture.yaml:
  the API, controller and migration run non-root on a read-only root without escalation and with
  limits, and the node DaemonSet's exceptions are the documented list (docs/deploy/kubernetes.md)
- what the pods reference exists: Secrets, ConfigMaps, the Service's and PDBs' selectors, the
  ServiceMonitor's port; images carry the package's version, never ``latest``
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
DEPLOY_VENV = REPO / ".venv-deploy" / "bin"
#: The Kubernetes minor versions the manifests are validated for (kind's and EKS's current ones).
SUPPORTED = ("1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0")
OVERLAYS = ("base", "kind", "eks")
#: Kinds without a namespace.
CLUSTER_SCOPED = ("Namespace", "ClusterRole", "ClusterRoleBinding")
#: Kinds not in Kubernetes' schemas (CRDs), checked by hand below.
CUSTOM_KINDS = {"ServiceMonitor"}
#: Secrets the operator makes after the control plane is up (a join token) or may leave out.
MADE_LATER = {"space-join-token", "space-bootstrap-admin"}


def _tool(name: str) -> str:
    path = DEPLOY_VENV / name
    if not path.exists():
        pytest.fail(f"{path} is missing: `make setup` installs the manifests' validators (make deploy-tools)")
    return str(path)


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is missing: `make setup` installs it (scripts/setup-system.sh)")
    return found


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Each overlay rendered to a file, from a copy of deploy/kubernetes whose overlays got their
    secrets from make-secrets.sh."""
    work = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(DEPLOY, work, ignore=shutil.ignore_patterns("secrets"))
    space = Path(sys.executable).with_name("space")
    env = {"PATH": f"{space.parent}:/usr/bin:/bin", "SPACE": str(space)}
    for overlay, extra in (("kind", []), ("eks", ["--database-url", "postgresql+asyncpg://space:pw@db.example:5432/s"])):
        made = subprocess.run([str(work / "make-secrets.sh"), str(work / "overlays" / overlay), *extra],
                              env=env, capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr
    out = {}
    for overlay in OVERLAYS:
        src = work / "base" if overlay == "base" else work / "overlays" / overlay
        r = subprocess.run([_kubectl(), "kustomize", str(src)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{overlay}: {r.stderr}"
        out[overlay] = work.parent / f"{overlay}.yaml"
        out[overlay].write_text(r.stdout)
    yield out


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _by(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_every_overlay_renders_the_whole_platform(rendered: dict[str, Path]) -> None:
    for overlay, path in rendered.items():
        names = {(d["kind"], d["metadata"]["name"]) for d in _docs(path)}
        assert {("Deployment", "space-api"), ("Deployment", "space-controller"), ("DaemonSet", "space-node"),
                ("Job", "space-migrate"), ("Service", "space-api"), ("PodDisruptionBudget", "space-api"),
                ("HorizontalPodAutoscaler", "space-api"), ("ServiceMonitor", "space-api"),
                ("Namespace", "space")} <= names, overlay
        assert all(d["metadata"].get("namespace") == "space" for d in _docs(path)
                   if d["kind"] not in CLUSTER_SCOPED), overlay
    kind = {(d["kind"], d["metadata"]["name"]) for d in _docs(rendered["kind"])}
    assert {("StatefulSet", "space-postgres"), ("StatefulSet", "space-minio"), ("Secret", "space-control-keys")} <= kind
    eks = _docs(rendered["eks"])
    assert not any(d["kind"] == "StatefulSet" for d in eks), "EKS uses RDS and S3, not in-cluster stores"
    for name in ("space-api", "space-controller", "space-node"):
        sa = _by(eks, "ServiceAccount")[name]
        assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::"), sa


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_object_validates_against_the_kubernetes_schemas(rendered: dict[str, Path], version: str) -> None:
    r = subprocess.run([_tool("kubernetes-validate"), "--strict", "-k", version, "--quiet",
                        *(str(p) for p in rendered.values())], capture_output=True, text=True, timeout=300)
    problems = [line for line in (r.stdout + r.stderr).splitlines()
                if line.strip() and not any(f"kind {k} " in line for k in CUSTOM_KINDS)]
    assert r.returncode == 0 and not problems, f"on {version}:\n" + "\n".join(problems)


def test_the_schema_check_catches_a_misspelt_field(rendered: dict[str, Path], tmp_path: Path) -> None:
    """The validator is not vacuous: a typo in a pod spec is an error."""
    broken = rendered["base"].read_text().replace("readOnlyRootFilesystem: true", "readOnlyRootFilesytem: true", 1)
    (tmp_path / "broken.yaml").write_text(broken)
    r = subprocess.run([_tool("kubernetes-validate"), "--strict", "-k", SUPPORTED[-1], "--quiet",
                        str(tmp_path / "broken.yaml")], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "readOnlyRootFilesytem" in r.stdout + r.stderr


def _accepted(overlay: str) -> dict[str, dict[str, str]]:
    posture = yaml.safe_load((DEPLOY / "posture.yaml").read_text())
    out: dict[str, dict[str, str]] = {}
    for section in ("every", overlay):
        for resource, checks in (posture.get(section) or {}).items():
            out.setdefault(resource, {}).update(checks)
    return out


def test_the_security_posture_is_exactly_the_accepted_one(rendered: dict[str, Path]) -> None:
    failures: list[str] = []
    files = [a for p in rendered.values() for a in ("-f", str(p))]
    r = subprocess.run([_tool("checkov"), *files, "--framework", "kubernetes", "--quiet", "--compact",
                        "-o", "json", "--skip-download"], capture_output=True, text=True, timeout=600)
    report = json.loads(r.stdout)
    report = report[0] if isinstance(report, list) else report
    assert report["summary"]["parsing_errors"] == 0, report["summary"]
    for overlay, path in rendered.items():
        found: dict[str, set[str]] = {}
        for f in report["results"]["failed_checks"]:
            if Path(f["file_path"]).name != path.name:
                continue
            kind, _, name = f["resource"].split(".", 2)
            found.setdefault(f"{kind}.{name}", set()).add(f["check_id"])
        accepted = {k: set(v) for k, v in _accepted(overlay).items()}
        for resource in sorted(set(found) | set(accepted)):
            new, stale = found.get(resource, set()) - accepted.get(resource, set()), \
                accepted.get(resource, set()) - found.get(resource, set())
            if new:
                failures.append(f"{overlay}: {resource} fails {sorted(new)} (not accepted in posture.yaml)")
            if stale:
                failures.append(f"{overlay}: {resource} no longer fails {sorted(stale)} (drop it from posture.yaml)")
    assert not failures, "\n".join(failures)


def test_the_control_plane_pods_are_restricted(rendered: dict[str, Path]) -> None:
    """What the posture check asserts, spelled out for SPACE's own unprivileged pods."""
    docs = _docs(rendered["eks"])
    pods = [*(_by(docs, "Deployment")[n]["spec"]["template"]["spec"] for n in ("space-api", "space-controller")),
            _by(docs, "Job")["space-migrate"]["spec"]["template"]["spec"]]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] >= 10000
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert (sc["readOnlyRootFilesystem"], sc["allowPrivilegeEscalation"], sc["capabilities"]["drop"]) \
                == (True, False, ["ALL"]), c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]) and {"cpu", "memory"} <= set(
                c["resources"]["requests"]), c["name"]


def test_only_the_node_pod_holds_a_kubernetes_token_and_it_may_only_get_nodes(rendered: dict[str, Path]) -> None:
    """The node's preStop hook reads its own Node (space node leave --when kubernetes); nothing
    else in SPACE calls the Kubernetes API."""
    for overlay in OVERLAYS:
        docs = _docs(rendered[overlay])
        roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")}
        assert list(roles) == [("ClusterRole", "space-node-read-nodes")], overlay
        assert roles[("ClusterRole", "space-node-read-nodes")]["rules"] == [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
        bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
        assert [(b["roleRef"]["name"], b["subjects"]) for b in bindings] == [
            ("space-node-read-nodes", [{"kind": "ServiceAccount", "name": "space-node", "namespace": "space"}])]
        ds = _by(docs, "DaemonSet")["space-node"]["spec"]["template"]["spec"]
        assert ds["automountServiceAccountToken"] is True and ds["serviceAccountName"] == "space-node"
        hook = ds["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[1:4] == ["node", "leave", "--data-dir=/var/lib/space/data"] and "--when=kubernetes" in hook
        timeout = float(next(a for a in hook if a.startswith("--timeout=")).split("=")[1])
        assert timeout < ds["terminationGracePeriodSeconds"], "the hook must end before the grace does"


def test_the_node_daemonsets_host_access_is_the_documented_list(rendered: dict[str, Path]) -> None:
    ds = _by(_docs(rendered["base"]), "DaemonSet")["space-node"]["spec"]["template"]["spec"]
    host_paths = sorted(v["hostPath"]["path"] for v in ds["volumes"] if "hostPath" in v)
    assert host_paths == ["/dev", "/lib/modules", "/run/netns", "/run/space", "/sys/fs/cgroup", "/var/cache/space",
                          "/var/lib/space"]
    assert (ds["hostPID"], ds["hostNetwork"]) == (True, True)
    assert ds["nodeSelector"] == {"space.dev/sandboxes": "true"}
    assert {"key": "space.dev/sandboxes", "operator": "Equal", "value": "true", "effect": "NoSchedule"} \
        in ds["tolerations"]
    guide = (REPO / "docs" / "deploy" / "kubernetes.md").read_text()
    for path in host_paths:
        assert f"`{path}`" in guide, f"docs/deploy/kubernetes.md does not say why the node mounts {path}"
    for check in _accepted("base")["DaemonSet.space-node"]:
        assert check in guide, f"docs/deploy/kubernetes.md does not explain {check}"


def test_what_the_pods_reference_exists(rendered: dict[str, Path]) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for overlay in ("kind", "eks"):
        docs = _docs(rendered[overlay])
        secrets, configmaps = set(_by(docs, "Secret")), set(_by(docs, "ConfigMap"))
        workloads = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job")]
        for w in workloads:
            pod = w["spec"]["template"]["spec"]
            labels = w["spec"]["template"]["metadata"]["labels"]
            if "selector" in w["spec"]:
                assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), w["metadata"]["name"]
            for v in pod.get("volumes", []):
                if "secret" in v:
                    assert v["secret"]["secretName"] in secrets | MADE_LATER, (overlay, v)
            for c in pod["containers"]:
                for ref in c.get("envFrom", []):
                    if "secretRef" in ref:
                        assert ref["secretRef"]["name"] in secrets, (overlay, ref)
                    if "configMapRef" in ref:
                        assert ref["configMapRef"]["name"] in configmaps, (overlay, ref)
                if c["image"].split("/")[-1].startswith("space"):
                    assert c["image"].endswith(f":{version}"), c["image"]
                assert not c["image"].endswith(":latest"), c["image"]
        api_pod = _by(docs, "Deployment")["space-api"]["spec"]["template"]["metadata"]["labels"]
        svc = _by(docs, "Service")["space-api"]
        assert svc["spec"]["selector"].items() <= api_pod.items()
        for pdb in _by(docs, "PodDisruptionBudget").values():
            target = pdb["spec"]["selector"]["matchLabels"]
            assert any(target.items() <= w["spec"]["template"]["metadata"]["labels"].items() for w in workloads), pdb
        monitor = _by(docs, "ServiceMonitor")["space-api"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
        node_keys = _by(docs, "Secret")["space-node-keys"]["data"]
        assert {"cluster-ca.pem", "manifest.key", "mitmproxy-ca.pem", "mitmproxy-ca-cert.pem"} <= set(node_keys)
        control = _by(docs, "Secret")["space-control-keys"]["data"]
        assert {"secret.key", "master.key", "cluster-ca.pem", "cluster-ca.key", "api.pem", "api.key"} <= set(control)
