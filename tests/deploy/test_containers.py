"""The images as containers on this machine (``make images``; podman with runc), as a Kubernetes node
runs them: the ``space`` image as the API and as the controller (non-root, read-only root, no
capabilities), the ``space-node`` image as the node agent (privileged, the host's PID and network
namespaces, the host paths of docs/deploy/kubernetes.md), against PostgreSQL on the host and
moto's S3 server on loopback.

- through them: create, exec, files, pause/resume, suspend/restore through object storage;
- the node container restarted (a rollout: SIGTERM, then runc removes what is left in its
  cgroups) and killed (a crash): every sandbox still runs -- the same shim, the same sentry -- and
  its command's output streams on, counted without a gap from its first line;
- each container stops by itself at SIGTERM, as its first process (PID 1), with exit status 0.

Needs images built from this checkout (their ``org.opencontainers.image.revision`` label names a
commit with the same image inputs as HEAD): ``make test-containers`` builds them first and runs
this file. Elsewhere (``make test`` on a machine without them) it is skipped, saying so.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.e2e.cluster import S3_CREDENTIALS, moto_bucket
from tests.e2e.harness import (
    LOUD_COUNTER,
    REPO,
    SCRATCH,
    SPACE,
    counter_numbers,
    free_port,
    loop_devices,
    node_teardown,
    run,
    wait_operation,
)
from tests.store.conftest import reset_postgres
from tests.waiting import wait_for

pytestmark = [pytest.mark.runtime, pytest.mark.postgres, pytest.mark.containers]

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
SPACE_IMAGE, NODE_IMAGE = f"localhost/space:{VERSION}", f"localhost/space-node:{VERSION}"
#: What goes into the images: a commit that changed none of these since an image's is its commit.
IMAGE_INPUTS = ("space", "pyproject.toml", "gateway-requirements.txt", "deploy/images")
#: podman's defaults exceed this host's limits, and crun refuses its hybrid cgroup layout.
PODMAN = ["podman", "--runtime", "runc"]
RUN = [*PODMAN, "run", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096"]
NODE_ID = "ctr-node"


def _images_missing() -> str | None:
    """Why the images cannot be used (None: they are this checkout's)."""
    if shutil.which("podman") is None:
        return "podman is not installed (make images installs buildah; podman: apt-get install podman)"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    for image in (SPACE_IMAGE, NODE_IMAGE):
        got = subprocess.run([*PODMAN, "image", "inspect", image, "--format",
                              '{{index .Labels "org.opencontainers.image.revision"}}'],
                             capture_output=True, text=True)
        if got.returncode != 0:
            return f"no image {image}: make images"
        built = got.stdout.strip()
        same = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", built, head, "--", *IMAGE_INPUTS],
                              capture_output=True)
        if same.returncode != 0:
            return f"{image} is of commit {built}, and what goes into it changed since: make images"
        if subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", *IMAGE_INPUTS]).returncode != 0:
            return "the checkout has uncommitted changes to what goes into the images: commit, then make images"
    return None


@dataclass
class Containers:
    """The deployment: container names, where they listen, and the host paths they share."""

    prefix: str
    work: Path
    node_dir: Path
    database_url: str
    object_store_url: str
    admin_key: str = field(default_factory=lambda: "sk_" + secrets.token_urlsafe(30))
    api_port: int = field(default_factory=free_port)
    node_port: int = field(default_factory=free_port)
    started: list[str] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def name(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, timeout=timeout,
                            headers={"authorization": f"Bearer {self.admin_key}"})

    def _aws(self) -> list[str]:
        return [a for k, v in S3_CREDENTIALS.items() for a in ("-e", f"{k}={v}")]

    def run_control(self, role: str, *args: str, detach: bool = True) -> subprocess.CompletedProcess[str]:
        """The ``space`` image as ``role``: its own user (10001), a read-only root, no capability."""
        argv = [*RUN, "--network", "host", "--read-only", "--tmpfs", "/tmp", "--cap-drop", "all",
                "--security-opt", "no-new-privileges", *self._aws(),
                "-v", f"{self.work / 'control-keys'}:/etc/space/keys:ro"]
        if detach:
            argv += ["-d", "--name", self.name(role)]
            self.started.append(self.name(role))
        else:
            argv += ["--rm"]
        if role == "api":
            argv += ["-e", f"SPACE_BOOTSTRAP_ADMIN_KEY={self.admin_key}"]
        done = subprocess.run([*argv, SPACE_IMAGE, *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"podman run {role}: {done.stderr[-3000:]}"
        return done

    def node_argv(self, token_file: Path) -> list[str]:
        """The node agent's container, with the host paths and privileges of the DaemonSet."""
        mounts = ["-v", f"{self.node_dir}:{self.node_dir}:rshared",  # the pool outlives the container
                  "-v", f"{self.work / 'cache'}:/var/cache/space",  # its own (see the fixture)
                  "-v", "/run/netns:/run/netns:rshared",
                  "-v", "/run/space:/run/space",
                  "-v", "/sys/fs/cgroup:/sys/fs/cgroup",
                  "-v", "/dev:/dev"]
        if Path("/lib/modules").is_dir():
            mounts += ["-v", "/lib/modules:/lib/modules:ro"]
        data = self.node_dir / "data"
        return [*RUN, "-d", "--name", self.name("node"), "--privileged", "--pid", "host", "--network", "host",
                "--read-only", "--tmpfs", "/tmp", *self._aws(), *mounts, NODE_IMAGE,
                "node", "run", "--data-dir", str(data), "--listen", f"127.0.0.1:{self.node_port}",
                "--advertise-url", f"https://127.0.0.1:{self.node_port}", "--node-id", NODE_ID,
                "--join-token-file", str(token_file), "--control-url", self.api_url,
                "--egress-ca-dir", str(self.node_dir / "egress-ca"),
                "--manifest-key-file", str(self.node_dir / "manifest.key"),
                "--kek-file", str(self.node_dir / "kek.key"),
                "--cache-dir", "/var/cache/space", "--pool-size-gb", "8",
                "--object-store-url", self.object_store_url]

    def logs(self, role: str, n: int = 60) -> str:
        out = subprocess.run([*PODMAN, "logs", "--tail", str(n), self.name(role)], capture_output=True, text=True)
        return (out.stdout + out.stderr)[-6000:]

    def container_pid(self, role: str) -> int:
        out = subprocess.run([*PODMAN, "inspect", "--format", "{{.State.Pid}}", self.name(role)],
                             capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    def wait_api_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            try:
                return httpx.get(f"{self.api_url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, timeout, f"the API container to be ready:\n{self.logs('api')}", interval=0.2)

    def wait_node_ready(self, timeout: float = 180) -> None:
        def ready() -> bool:
            with self.client() as api:
                r = api.get(f"/v1/nodes/{NODE_ID}")
            return r.status_code == 200 and r.json().get("state") == "ready"
        wait_for(ready, timeout, f"the node container to be ready:\n{self.logs('node')}", interval=0.5)


def _shared_mount(path: Path) -> None:
    """``path`` as a mount of its own with shared propagation, so that what the node container
    mounts under it (the pool, network namespaces) is the host's and outlives the container: what
    ``mountPropagation: Bidirectional`` asks of a Kubernetes host path. (``ip netns`` itself makes
    /run/netns such a mount.)"""
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mountpoint", "-q", str(path)]).returncode != 0:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    subprocess.run(["mount", "--make-shared", str(path)], check=True)


@pytest.fixture(scope="module")
def deployment(postgres_url: str) -> Iterator[Containers]:
    missing = _images_missing()
    if missing:
        if os.environ.get("SPACE_TEST_CONTAINERS") == "1":  # make test-containers: they must be there
            pytest.fail(missing)
        pytest.skip(missing)
    anyio.run(reset_postgres, postgres_url)
    SCRATCH.mkdir(mode=0o711, exist_ok=True)
    work = SCRATCH / f"containers-{secrets.token_hex(4)}"
    work.mkdir(mode=0o711)
    node_dir = work / "node"
    node_dir.mkdir(mode=0o711)
    subprocess.run([SPACE, "keys", "generate", str(work / "keys")], check=True, capture_output=True, timeout=60)
    # The control plane's keys as its Secret mounts them: readable by its user, 10001.
    shutil.copytree(work / "keys", work / "control-keys")
    for p in [work / "control-keys", *(work / "control-keys").rglob("*")]:
        os.chown(p, 10001, 10001)
    shutil.copytree(work / "keys" / "egress-ca", node_dir / "egress-ca")
    shutil.copy(work / "keys" / "manifest.key", node_dir / "manifest.key")
    shutil.copy(work / "keys" / "kek.key", node_dir / "kek.key")
    _shared_mount(node_dir)
    _shared_mount(Path("/run/netns"))
    # The node's template cache is its own: an agent takes its cache for its user (uid 10002 in the
    # image), and the host's cache belongs to the host's node agents. The base template's stream
    # is copied in from the host's cache when it has one (else the container builds it).
    (work / "cache" / "templates").mkdir(parents=True)
    for stream in Path("/var/cache/space/templates").glob("base-*.btrfs.zst"):
        shutil.copyfile(stream, work / "cache" / "templates" / stream.name)
    Path("/run/space").mkdir(exist_ok=True)
    with moto_bucket() as objects:
        c = Containers(prefix=f"space-test-{secrets.token_hex(3)}", work=work, node_dir=node_dir,
                       database_url=postgres_url, object_store_url=objects)
        try:
            c.run_control("migrate", "db", "migrate", "--database-url", c.database_url, detach=False)
            common = ["--database-url", c.database_url, "--object-store-url", c.object_store_url,
                      "--keys-dir", "/etc/space/keys"]
            c.run_control("api", "api", *common, "--listen", f"127.0.0.1:{c.api_port}")
            c.run_control("controller", "controller", *common)
            c.wait_api_ready()
            with c.client() as api:
                r = api.post("/v1/nodes/tokens", json={"ttl_seconds": 600, "max_uses": 1, "description": NODE_ID})
                assert r.status_code == 201, r.text
            token = node_dir / "join.token"
            token.write_text(r.json()["token"] + "\n")
            token.chmod(0o600)
            done = subprocess.run(c.node_argv(token), capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
            c.started.append(c.name("node"))
            c.wait_node_ready()

            def base_ready() -> bool:
                with c.client() as api:
                    t = api.get("/v1/templates/base")
                return t.status_code == 200 and t.json().get("status") == "ready"
            # Imported from the host's template cache, or else debootstrap'd in the container.
            wait_for(base_ready, 1800, f"template base:\n{c.logs('node')}", interval=1)
            yield c
        finally:
            _teardown(c)


def _teardown(c: Containers) -> None:
    errors = []
    for name in c.started:  # the last scenario stops them
        subprocess.run([*PODMAN, "start", name], capture_output=True, timeout=120)
    # Whatever fails here, the containers, the pool and the mounts still go (below).
    try:
        if c.name("node") in c.started:
            c.wait_api_ready()
            c.wait_node_ready()
        with c.client() as api:
            for sb in api.get("/v1/sandboxes").json().get("sandboxes", []):
                api.delete(f"/v1/sandboxes/{sb['id']}")
    except Exception as e:  # reported below, after the cleanup
        errors.append(f"deleting the sandboxes: {e!r}")
    for name in reversed(c.started):
        subprocess.run([*PODMAN, "rm", "-f", "-t", "30", name], capture_output=True, timeout=120)
    data = c.node_dir / "data"
    if (data / "pool.img").exists():
        try:
            node_teardown(data, "--cache-dir", str(c.work / "cache"))
            assert loop_devices(data / "pool.img") == "", "the node's loop device leaked"
        except AssertionError as e:
            errors.append(str(e))
    subprocess.run(["umount", "-l", str(c.node_dir)], capture_output=True)
    shutil.rmtree(c.work, ignore_errors=True)
    assert not errors, errors


# -- helpers ---------------------------------------------------------------------------------------


def act(api: httpx.Client, sid: str, action: str) -> None:
    r = api.post(f"/v1/sandboxes/{sid}/{action}")
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "succeeded", op["error"]


def sh(api: httpx.Client, sid: str, script: str) -> bytes:
    code, out, err = run(api, sid, {"shell": script})
    assert code == 0, err
    return out


def create(api: httpx.Client) -> str:
    r = api.post("/v1/sandboxes", json={"template": "base"})
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "succeeded", op["error"]
    return str(r.json()["sandbox"]["id"])


def processes_of(instance: str) -> dict[str, int]:
    """The host pids of the instance's shim and sentry."""
    found: dict[str, int] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"space.runtime.shim" in argv and any(a.endswith(f"/{instance}.sock".encode()) for a in argv):
            found["shim"] = int(p.name)
        elif argv[0] == b"runsc-sandbox" and any(a.startswith(b"--bundle=") and a.endswith(f"/{instance}".encode())
                                                 for a in argv):
            found["sentry"] = int(p.name)
    return found


# -- the scenarios -----------------------------------------------------------------------------------


def test_create_exec_and_files_through_the_containers(deployment: Containers) -> None:
    with deployment.client() as api:
        sid = create(api)
        try:
            sb = api.get(f"/v1/sandboxes/{sid}").json()
            assert (sb["state"], sb["node_id"]) == ("running", NODE_ID)
            assert sh(api, sid, "echo hello from $(hostname)") == f"hello from {sid[:12]}\n".encode()
            blob = os.urandom(300_000)
            r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/blob"}, content=blob)
            assert r.status_code in (200, 201, 204), r.text
            assert api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/blob"}).content == blob
            assert sh(api, sid, "wc -c < /home/user/blob") == b"300000\n"
        finally:
            api.delete(f"/v1/sandboxes/{sid}")


def test_pause_resume_suspend_and_restore_through_the_containers(deployment: Containers) -> None:
    with deployment.client() as api:
        sid = create(api)
        try:
            sh(api, sid, "head -c 1000000 /dev/urandom > /home/user/blob && sha256sum /home/user/blob > /home/user/sum")
            cid = api.post(f"/v1/sandboxes/{sid}/commands", json={"shell": LOUD_COUNTER}).json()["id"]
            counter_numbers(api, sid, cid, 3)
            act(api, sid, "pause")
            assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
            act(api, sid, "resume")
            act(api, sid, "suspend")
            sb = api.get(f"/v1/sandboxes/{sid}").json()
            assert (sb["state"], sb["node_id"]) == ("suspended", None), sb
            snap = api.get(f"/v1/snapshots/{sb['snapshot_id']}").json()
            assert snap["restorable"] and snap["location"] == ["object_store"], snap
            act(api, sid, "restore")
            assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
            assert sh(api, sid, "sha256sum -c /home/user/sum").strip().endswith(b"OK")
            # The counter came back from memory: it counts on from where it was, not from 1.
            got = counter_numbers(api, sid, cid, 12)
            assert got == list(range(1, len(got) + 1)), got
        finally:
            api.delete(f"/v1/sandboxes/{sid}")


def test_a_restarted_or_killed_node_container_leaves_every_sandbox_running_and_streaming(
        deployment: Containers) -> None:
    c = deployment
    with c.client() as api:
        sids = [create(api) for _ in range(2)]
        try:
            counters = {sid: api.post(f"/v1/sandboxes/{sid}/commands", json={"shell": LOUD_COUNTER}).json()["id"]
                        for sid in sids}
            instances = {sid: api.get(f"/v1/sandboxes/{sid}").json()["instance_id"] for sid in sids}
            before = {sid: processes_of(instances[sid]) for sid in sids}
            assert all(set(p) == {"shim", "sentry"} for p in before.values()), before
            for how in ("restart", "kill"):
                agent = c.container_pid("node")
                reached = {sid: counter_numbers(api, sid, counters[sid], 3)[-1] for sid in sids}
                if how == "restart":  # a rollout: SIGTERM, then whatever is left in its cgroups goes
                    cmd = [[*PODMAN, "restart", "-t", "30", c.name("node")]]
                else:  # a crash: SIGKILL
                    cmd = [[*PODMAN, "kill", c.name("node")], [*PODMAN, "start", c.name("node")]]
                for argv in cmd:
                    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
                    assert done.returncode == 0, done.stderr
                assert c.container_pid("node") != agent  # a new agent, in a new container process
                c.wait_node_ready()
                for sid in sids:
                    sb = api.get(f"/v1/sandboxes/{sid}").json()
                    assert (sb["state"], sb["instance_id"]) == ("running", instances[sid]), (how, sb)
                    # The same shim and the same sentry: nothing was started again.
                    assert processes_of(instances[sid]) == before[sid], (how, c.logs("node"))
                    got = counter_numbers(api, sid, counters[sid], reached[sid] + 5)
                    assert got == list(range(1, len(got) + 1)), (how, got)
                    assert sh(api, sid, "echo still here") == b"still here\n"
                    cmd_state: dict[str, Any] = api.get(f"/v1/sandboxes/{sid}/commands/{counters[sid]}").json()
                    assert cmd_state["state"] == "running", cmd_state
        finally:
            for sid in sids:
                api.delete(f"/v1/sandboxes/{sid}")


def test_every_container_stops_by_itself_at_sigterm(deployment: Containers) -> None:
    """Kubernetes stops a pod with SIGTERM and, after its grace period, SIGKILL. Each process is
    its container's first (PID 1), which gets no default action for SIGTERM: each stops because
    it handles it, in order, with exit status 0 -- not 137, a SIGKILL at the grace's end. (Last:
    it stops the deployment.)"""
    c = deployment
    for role in ("node", "controller", "api"):
        done = subprocess.run([*PODMAN, "stop", "-t", "60", c.name(role)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        status = subprocess.run([*PODMAN, "inspect", "--format", "{{.State.ExitCode}}", c.name(role)],
                                capture_output=True, text=True, check=True).stdout.strip()
        assert status == "0", (role, status, c.logs(role))
