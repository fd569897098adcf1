"""A node going away for good (space.node.leaving, space.node.kubernetes, ``space node leave``):

- the mark and the count are written whole (a link planted in their place is replaced, never
  followed) and read as hostile input: a link, a FIFO (which must not block the reader), an
  oversized file or something that is not a mark or a count reads as none;
- the agent's heartbeat rewrites its count only when it changes and reports the mark;
- a leaving waits until the count is 0, or its deadline;
- the Kubernetes Node says whether the machine is leaving: cordoned, or tainted by the cluster
  autoscaler, Karpenter, an out-of-service or a cloud shutdown; the Node is read with the pod's
  service account over HTTPS (a local server with the cluster CA's certificate stands in for the
  Kubernetes API: the seam is the request it gets);
- ``space node leave``: --when always marks and waits; --when kubernetes outside a pod stays and
  says why; --cancel withdraws.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from space.cluster.pki import ClusterCA
from space.errors import Unavailable
from space.node import kubernetes, leaving
from space.node.storage.ownership import node_state_dir


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    node_state_dir(tmp_path).mkdir(parents=True)
    return tmp_path


def test_the_mark_is_written_whole_read_back_and_withdrawn(data_dir: Path) -> None:
    assert leaving.read_mark(data_dir) is None
    leaving.mark(data_dir, "the operator retires the machine")
    got = leaving.read_mark(data_dir)
    assert got is not None and got["reason"] == "the operator retires the machine" and got["since"] > 0
    assert leaving.clear(data_dir) and not leaving.clear(data_dir)
    assert leaving.read_mark(data_dir) is None


def test_a_link_planted_where_the_mark_goes_is_replaced_not_followed(data_dir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    leaving.mark_path(data_dir).symlink_to(victim)
    leaving.mark(data_dir, "leaving")
    assert victim.read_text() == "root's file"
    assert not leaving.mark_path(data_dir).is_symlink() and leaving.read_mark(data_dir) is not None


@pytest.mark.parametrize("kind", ["symlink", "fifo", "huge", "not-json", "no-reason", "boolean-since"])
def test_what_is_not_a_mark_or_a_count_reads_as_none(data_dir: Path, tmp_path: Path, kind: str) -> None:
    real = tmp_path / "real"
    real.write_text(json.dumps({"reason": "x", "since": 1.0}))
    for path, good in ((leaving.mark_path(data_dir), real), (leaving.owned_path(data_dir), tmp_path / "n")):
        (tmp_path / "n").write_text("3 -\n")
        if kind == "symlink":
            path.symlink_to(good)
        elif kind == "fifo":
            os.mkfifo(path)  # no writer: a blocking open would hang here
        elif kind == "huge":
            path.write_text("1" * 5000)
        elif kind == "not-json":
            path.write_text("{nope")
        elif kind == "no-reason":
            path.write_text(json.dumps({"since": 1.0}))
        else:
            path.write_text(json.dumps({"reason": "x", "since": True}))
    assert leaving.read_mark(data_dir) is None
    assert leaving.read_owned(data_dir) is None


def test_the_heartbeat_rewrites_the_count_when_it_or_the_mark_changes_and_reports_the_mark(data_dir: Path) -> None:
    beats = leaving.Heartbeats(data_dir)
    assert beats.report(2) is None and leaving.read_owned(data_dir) == 2
    before = leaving.owned_path(data_dir).stat().st_ino
    beats.report(2)
    assert leaving.owned_path(data_dir).stat().st_ino == before  # not rewritten
    since = leaving.mark(data_dir, "leaving")
    # A count from before the mark is not one for it: a sandbox made a moment ago is not in it.
    assert leaving.read_owned(data_dir, since) is None
    report = beats.report(2)
    assert report == {"reason": "leaving", "since": since}
    assert leaving.read_owned(data_dir, since) == 2 and leaving.read_owned(data_dir, since + 1) is None
    beats.report(1)
    assert leaving.read_owned(data_dir, since) == 1


def test_a_leaving_waits_for_the_count_of_its_mark_to_reach_zero_or_its_deadline(data_dir: Path) -> None:
    said: list[str] = []
    since = leaving.mark(data_dir, "leaving")
    leaving.write_owned(data_dir, 0, None)  # the agent has not answered with the mark yet
    assert leaving.wait_until_empty(data_dir, since, 0.3, said.append, poll=0.05) is None
    leaving.write_owned(data_dir, 2, since)
    assert leaving.wait_until_empty(data_dir, since, 0.3, said.append, poll=0.05) == 2
    assert said == ["? sandbox(es) still on this node", "2 sandbox(es) still on this node"]

    timer = threading.Timer(0.2, leaving.write_owned, (data_dir, 0, since))
    timer.start()
    try:
        assert leaving.wait_until_empty(data_dir, since, 30, said.append, poll=0.05) == 0
    finally:
        timer.cancel()


# -- the Kubernetes Node -------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "reason"), [
    ({}, None),
    ({"unschedulable": False, "taints": [{"key": "node-role.kubernetes.io/control-plane"}]}, None),
    ({"unschedulable": True}, "the node is cordoned (kubectl cordon or drain)"),
    ({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"}]},
     "the cluster autoscaler is removing the node (taint ToBeDeletedByClusterAutoscaler)"),
    ({"taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]},
     "Karpenter is disrupting the node (taint karpenter.sh/disrupted)"),
    ({"taints": [{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}]},
     "the node is out of service (taint node.kubernetes.io/out-of-service)"),
    ({"taints": "not a list of taints"}, None),
])
def test_the_node_object_says_whether_the_machine_is_leaving(spec: dict[str, Any], reason: str | None) -> None:
    assert kubernetes.leaving_reason({"kind": "Node", "spec": spec}) == reason


class _FakeKubernetesAPI:
    """HTTPS on loopback with a certificate for 127.0.0.1; answers GET /api/v1/nodes/<name>."""

    def __init__(self, tmp: Path, nodes: dict[str, dict[str, Any]]) -> None:
        ca = ClusterCA.create()
        cert, key = ca.issue_api_server(["127.0.0.1"], days=1)
        (tmp / "server.pem").write_bytes(cert)
        (tmp / "server.key").write_bytes(key)
        self.account = tmp / "serviceaccount"
        self.account.mkdir()
        (self.account / "ca.crt").write_bytes(ca.cert_pem)
        (self.account / "token").write_text("the-pods-token\n")
        self.seen: list[tuple[str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.seen.append((self.path, self.headers.get("authorization")))
                name = self.path.removeprefix("/api/v1/nodes/")
                body = json.dumps(nodes[name]).encode() if name in nodes else b'{"kind":"Status","code":404}'
                self.send_response(200 if name in nodes else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tmp / "server.pem", tmp / "server.key")
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.server.server_port)}
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[_FakeKubernetesAPI]:
    api = _FakeKubernetesAPI(tmp_path, {
        "worker-1": {"kind": "Node", "metadata": {"name": "worker-1"}, "spec": {"unschedulable": True}},
        "worker-2": {"kind": "Node", "metadata": {"name": "worker-2"}, "spec": {}},
    })
    yield api
    api.close()


def test_the_node_is_read_with_the_pods_service_account(kube: _FakeKubernetesAPI) -> None:
    node = kubernetes.read_node("worker-1", env=kube.env, account=kube.account)
    assert kubernetes.leaving_reason(node) == "the node is cordoned (kubectl cordon or drain)"
    assert kube.seen == [("/api/v1/nodes/worker-1", "Bearer the-pods-token")]
    with pytest.raises(Unavailable, match="answered 404"):
        kubernetes.read_node("worker-9", env=kube.env, account=kube.account)
    with pytest.raises(Unavailable, match="not a Kubernetes node name"):
        kubernetes.read_node("../../namespaces", env=kube.env, account=kube.account)
    with pytest.raises(Unavailable, match="no KUBERNETES_SERVICE_HOST"):
        kubernetes.read_node("worker-1", env={}, account=kube.account)
    with pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):  # another CA: refused
        other = kube.account.parent / "other"
        other.mkdir()
        (other / "ca.crt").write_bytes(ClusterCA.create().cert_pem)
        (other / "token").write_text("t")
        kubernetes.read_node("worker-1", env=kube.env, account=other)


# -- space node leave ------------------------------------------------------------------------------


def _leave(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "space.cli.main", "node", "leave", "--data-dir", str(data_dir),
                           *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], **(env or {})})


def test_space_node_leave_marks_waits_and_cancels(data_dir: Path) -> None:
    """The agent's side is played by a thread answering the mark the way a heartbeat does."""
    stop = threading.Event()

    def agent(count: int) -> None:
        beats = leaving.Heartbeats(data_dir)
        while not stop.wait(0.05):
            beats.report(count)

    thread = threading.Thread(target=agent, args=(0,), daemon=True)
    thread.start()
    try:
        done = _leave(data_dir, "--when", "always", "--timeout", "30")
    finally:
        stop.set()
        thread.join()
    assert done.returncode == 0 and "every sandbox moved away" in done.stderr, done.stderr
    assert leaving.read_mark(data_dir) is not None
    done = _leave(data_dir, "--cancel")
    assert done.returncode == 0 and "leaving withdrawn" in done.stdout
    assert leaving.read_mark(data_dir) is None

    leaving.write_owned(data_dir, 0, None)  # no agent answers this leaving
    done = _leave(data_dir, "--when", "always", "--timeout", "0.5")
    assert done.returncode == 0, done.stderr
    assert "gave up after 0.5s with an unknown number of sandbox(es) still here (the node agent did not answer)" \
        in done.stderr, done.stderr


def test_space_node_leave_outside_a_pod_marks_nothing(data_dir: Path) -> None:
    done = _leave(data_dir, "--node-name", "worker-1")
    assert done.returncode == 0 and "staying: not in a Kubernetes pod" in done.stderr, done.stderr
    assert leaving.read_mark(data_dir) is None
