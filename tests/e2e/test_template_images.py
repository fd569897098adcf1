"""A template from a container image a user pushed to their registry, through SPACE's API, and a
sandbox of it.

The image is built in the test with Debian's ``buildah`` from scratch: the server's own ``base``
root copied in, and a config (env, user, working directory, a command) as a Dockerfile would set
it; pushed by tag to a registry on loopback (Debian's ``docker-registry``) that the server's node
may pull from (``SPACE_BUILD_REGISTRIES``).

Aspects:
- the build pins the tag to the image's digest and takes the sandbox defaults from its config:
  a sandbox of the template has the image's files, runs commands as the image's user in its
  working directory with its environment, and the image's command ran at boot
- the same tag built again (by the API, and by ``space template build NAME --image REF``) is the same
  template (same digest, nothing rebuilt)
- an image that cannot run SPACE's guest daemon (no python) fails its build with a message saying so
- a registry the operator did not list is refused before anything is pulled
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import SPACE, Server, base_template, create_sandbox, own_server, run, wait_operation
from tests.node.test_helper_oci import registry

pytestmark = [pytest.mark.runtime,
              pytest.mark.skipif(not all(shutil.which(t) for t in ("docker-registry", "skopeo", "umoci", "buildah")),
                                 reason="needs docker-registry, skopeo, umoci and buildah (make setup installs them)")]

__all__ = ["registry"]

CACHE = Path("/var/cache/space")
CMD = "echo started-by-image > /tmp/image-cmd; exec sleep infinity"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, registry: str) -> Iterator[Server]:
    with own_server(tmp_path_factory.mktemp("img"), env={"SPACE_BUILD_REGISTRIES": f"http://{registry}"}) as srv:
        yield srv
        for manifest in (srv.data_dir / "pool" / "templates").glob("*@*.json"):
            body = json.loads(manifest.read_text())
            if body["name"] != "base":  # what this module built leaves the machine's cache
                (CACHE / "templates" / f"{body['name']}-{body['digest']}.btrfs.zst").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=120) as c:
        yield c


class Buildah:
    """buildah with storage of its own (vfs, in a temporary directory): nothing of the host's."""

    def __init__(self, root: Path) -> None:
        self.flags = ["--root", str(root / "storage"), "--runroot", str(root / "run"), "--storage-driver", "vfs"]

    def __call__(self, *args: str) -> str:
        p = subprocess.run(["buildah", *self.flags, *args], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (args, p.stderr[-2000:])
        return p.stdout.strip()


@pytest.fixture(scope="module")
def buildah(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Buildah]:
    root = tmp_path_factory.mktemp("buildah")
    b = Buildah(root)
    try:
        yield b
    finally:
        subprocess.run(["buildah", *b.flags, "rm", "--all"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def build_image(buildah: Buildah, server: Server, registry: str, repo: str, *, drop_python: bool = False) -> str:
    """The server's base root as an image, configured like a Dockerfile would, pushed as
    ``registry/repo:1``; its name by tag."""
    c = buildah("from", "scratch")
    buildah("copy", c, str(base_template(server)), "/")
    if drop_python:
        mnt = Path(buildah("mount", c))
        (mnt / "usr/bin/python3").unlink()
        (mnt / "usr/bin/python3.11").unlink()
        buildah("umount", c)
    buildah("config", "--env", "GREETING=hello from the image", "--user", "user", "--workingdir", "/home/user",
            "--cmd", json.dumps(["/bin/sh", "-c", CMD]), c)
    buildah("commit", "--quiet", c, f"{repo}:1")
    buildah("push", "--quiet", "--tls-verify=false", f"{repo}:1", f"docker://{registry}/{repo}:1")
    buildah("rm", c)
    return f"{registry}/{repo}:1"


def build_template(api: httpx.Client, name: str, image: str) -> dict[str, object]:
    r = api.post(f"/v1/templates/{name}/build", json={"spec": {"image": image}})
    assert r.status_code == 202, r.text
    return wait_operation(api, r.json()["operation"]["id"], timeout=900)


def test_a_sandbox_from_an_image_the_user_pushed(server: Server, api: httpx.Client, buildah: Buildah,
                                                 registry: str) -> None:
    image = build_image(buildah, server, registry, "team/app")
    started = time.monotonic()
    op = build_template(api, "team-app", image)
    assert op["status"] == "succeeded", op
    print(f"image template built in {time.monotonic() - started:.1f}s")
    t = api.get("/v1/templates/team-app").json()
    pinned = t["image"]
    assert pinned.startswith(f"{registry}/team/app@sha256:") and len(pinned.rpartition(":")[2]) == 64

    sid = create_sandbox(api, template="team-app")
    try:
        code, out, err = run(api, sid, {"shell": 'echo "$GREETING"; pwd; id -un; cat /tmp/image-cmd'})
        assert code == 0, err
        assert out.decode().splitlines() == ["hello from the image", "/home/user", "user", "started-by-image"]
    finally:
        api.delete(f"/v1/sandboxes/{sid}")

    # The same tag again, and the digest it was pinned to: the same template, nothing built.
    for ref in (image, pinned):
        again = build_template(api, "team-app", ref)
        assert again["status"] == "succeeded"
        assert api.get("/v1/templates/team-app").json()["digest"] == t["digest"]
    # The CLI's form of it prints that digest.
    env = {**os.environ, "SPACE_URL": server.url, "SPACE_API_KEY": server.admin_key}
    p = subprocess.run([SPACE, "template", "build", "team-app", "--image", image], env=env, capture_output=True,
                       text=True, timeout=900)
    assert (p.returncode, p.stdout.strip()) == (0, t["digest"]), p.stderr[-2000:]


def test_an_image_that_cannot_run_the_guest_fails_its_build(server: Server, api: httpx.Client, buildah: Buildah,
                                                          registry: str) -> None:
    image = build_image(buildah, server, registry, "team/nopython", drop_python=True)
    op = build_template(api, "team-nopython", image)
    assert op["status"] == "failed"
    assert "has no /usr/bin/python3" in json.dumps(op["error"]), op


def test_a_registry_not_listed_is_refused(api: httpx.Client) -> None:
    r = api.post("/v1/templates/elsewhere/build", json={"spec": {"image": "127.0.0.2:5999/team/app:1"}})
    assert r.status_code == 400 and "not one this node pulls images from" in r.json()["error"]["message"], r.text
    r = api.post("/v1/templates/elsewhere/build", json={"spec": {"image": "no-tag-or-digest/x"}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "image", r.text
