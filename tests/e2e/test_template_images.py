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
- E2B's own SDK: ``Template().from_image(...)`` with ENV, WORKDIR, RUN and USER, ``Template.build``
  and ``Template.exists``, then ``Sandbox.create`` of it; a failing RUN fails the build
- E2B's ``Template().copy(...)`` from a build context (links, a relative destination, owner and
  mode), in order among RUN steps; the same files again are not uploaded again
- a registry the operator did not list is refused before anything is pulled
- Docker Hub's short names through a mirror for docker.io, by E2B's SDK: named as Docker Hub names
  them, pulled from the mirror
- a Dockerfile through the CLI: FROM that image, COPY (in order among RUNs, --chown), RUN in the
  ENV/WORKDIR/USER before it, CMD started at boot; a sandbox of it has it all
- a registry that wants a login: refused without one; with the operator's secret for its host
  (format basic) the image is pinned, pulled and run, the login audited and found nowhere else
  (not in the template, its operation, nor the server's log)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import SPACE, Server, base_template, create_sandbox, own_server, run, wait_operation
from tests.node.test_helper_oci import Signer, auth_registry, make_signer, push_with_login, registry, signed_only
from tests.waiting import wait_for

pytestmark = [pytest.mark.runtime,
              pytest.mark.skipif(not all(shutil.which(t) for t in ("docker-registry", "skopeo", "umoci", "buildah")),
                                 reason="needs docker-registry, skopeo, umoci and buildah (make setup installs them)")]

__all__ = ["auth_registry", "registry"]

CACHE = Path("/var/cache/space")
CMD = "echo started-by-image > /tmp/image-cmd; exec sleep infinity"


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory, registry: str) -> Signer:
    return make_signer(tmp_path_factory.mktemp("signer"), registry)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, registry: str, auth_registry: str,
           signer: Signer) -> Iterator[Server]:
    # Docker Hub's names come from the test registry too (a mirror): docker.io itself is not reachable.
    registries = f"http://{registry},http://{auth_registry},docker.io=http://{registry}"
    # The operator's image policy: images under registry/signed must carry the signer's signature.
    policy = signed_only(tmp_path_factory.mktemp("policy"), registry, signer.public_key)
    env = {"SPACE_BUILD_REGISTRIES": registries, "SPACE_BUILD_IMAGE_POLICY": str(policy),
           "SPACE_BUILD_SIGNATURES": str(signer.registries_d)}
    with own_server(tmp_path_factory.mktemp("img"), env=env) as srv:
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


def build_image(buildah: Buildah, server: Server, registry: str, repo: str, *, drop_python: bool = False,
                tag: str = "1") -> str:
    """The server's base root as an image, configured like a Dockerfile would, pushed as
    ``registry/repo:1``; its name by tag."""
    c = buildah("from", "scratch")
    # Mounted and copied with owners kept (buildah copy would make every file root's).
    mnt = Path(buildah("mount", c))
    subprocess.run(["cp", "-a", f"{base_template(server)}/.", str(mnt)], check=True)
    if drop_python:
        (mnt / "usr/bin/python3").unlink()
        (mnt / "usr/bin/python3.11").unlink()
    buildah("umount", c)
    buildah("config", "--env", "GREETING=hello from the image", "--user", "user", "--workingdir", "/home/user",
            "--cmd", json.dumps(["/bin/sh", "-c", CMD]), c)
    buildah("commit", "--quiet", c, f"{repo}:{tag}")
    buildah("push", "--quiet", "--tls-verify=false", f"{repo}:{tag}", f"docker://{registry}/{repo}:{tag}")
    buildah("rm", c)
    return f"{registry}/{repo}:{tag}"


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


def test_the_operators_signature_policy(server: Server, api: httpx.Client, buildah: Buildah, registry: str,
                                       signer: Signer, tmp_path: Path) -> None:
    """``$SPACE_BUILD_IMAGE_POLICY`` reaches the node's pulls: under ``registry/signed`` an unsigned
    image's build fails naming the policy, one signed by the operator's key builds."""
    c = buildah("from", "scratch")
    mnt = Path(buildah("mount", c))
    subprocess.run(["cp", "-a", f"{base_template(server)}/.", str(mnt)], check=True)
    buildah("umount", c)
    buildah("commit", "--quiet", c, "signed-app:1")
    buildah("rm", c)
    buildah("push", "--quiet", "--tls-verify=false", "signed-app:1", f"docker://{registry}/signed/unsigned:1")
    r = api.post("/v1/templates/unsigned-app/build", json={"spec": {"image": f"{registry}/signed/unsigned:1"}})
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=900)
    assert op["status"] == "failed"
    assert "refused by this node's image policy" in op["error"]["message"], op["error"]
    assert "A signature was required" in op["error"]["message"], op["error"]

    layout = tmp_path / "layout"
    buildah("push", "--quiet", "signed-app:1", f"oci:{layout}:v1")
    subprocess.run(["skopeo", "--insecure-policy", "--registries.d", str(signer.registries_d), "copy", "--quiet",
                    "--dest-tls-verify=false", "--sign-by", signer.fingerprint, f"oci:{layout}:v1",
                    f"docker://{registry}/signed/app:1"], check=True, capture_output=True,
                   env={"PATH": os.environ["PATH"], "GNUPGHOME": str(signer.home)})
    assert build_template(api, "signed-app", f"{registry}/signed/app:1")["status"] == "succeeded"


def test_a_registry_not_listed_is_refused(api: httpx.Client) -> None:
    r = api.post("/v1/templates/elsewhere/build", json={"spec": {"image": "127.0.0.2:5999/team/app:1"}})
    assert r.status_code == 400 and "not one this node pulls images from" in r.json()["error"]["message"], r.text
    r = api.post("/v1/templates/elsewhere/build", json={"spec": {"image": "no-tag-or-digest/x"}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "image", r.text


def test_e2b_sdk_template_build_from_the_image_then_a_sandbox_of_it(
        server: Server, api: httpx.Client, buildah: Buildah, registry: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """E2B's own ``Template().from_image(...)...`` and ``Template.build``, then ``Sandbox.create``."""
    e2b = pytest.importorskip("e2b")
    from tests.e2e import e2b_env

    e2b_env.point_sdk_at(monkeypatch, server)
    image = f"{registry}/team/app:1"
    if api.get("/v1/templates/team-app").status_code != 200:  # the image the first test pushed
        image = build_image(buildah, server, registry, "team/app")
    assert not e2b.Template.exists("e2b-app")
    template = (e2b.Template().from_image(image)
                .set_envs({"STAGE": "built by e2b"})
                .set_workdir("/srv/app")
                .run_cmd("echo \"$STAGE\" > marker && chown user marker")
                .set_user("user")
                .run_cmd("id -un > /home/user/built-as"))  # (a build's last step empties /tmp)
    logs: list[str] = []
    info = e2b.Template.build(template, "e2b-app:v1", on_build_logs=lambda e: logs.append(e.message))
    assert info.template_id == "e2b-app:v1"  # what the SDK hands back to the next calls: the build's tag
    assert e2b.Template.exists("e2b-app") and not e2b.Template.exists("no-such-template")
    assert any("base: image" in line for line in logs), logs[-20:]

    sbx = e2b.Sandbox.create("e2b-app")
    try:
        r = sbx.commands.run('cat marker; echo "$STAGE"; pwd; id -un; cat /home/user/built-as; cat /tmp/image-cmd')
        assert r.stdout.splitlines() == ["built by e2b", "built by e2b", "/srv/app", "user", "user",
                                         "started-by-image"]
    finally:
        sbx.kill()

    # SPACE's own templates are not E2B's to rebuild.
    with pytest.raises(Exception, match="configured on this server"):
        e2b.Template.build(e2b.Template().from_image(image), "base")
    # A step that fails fails the build, with its output.
    with pytest.raises(e2b.BuildException, match="exit 3"):
        e2b.Template.build(e2b.Template().from_image(image).run_cmd("echo about to fail; exit 3"), "e2b-broken")


def test_e2b_sdk_copy_from_the_build_context(server: Server, monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    """E2B's ``Template().copy(...)``: the SDK uploads the files by their hash to the URL the facade
    signs, the build places them in order among the RUN steps (links kept, owner and mode set), and
    a second build of the same files skips the upload."""
    e2b = pytest.importorskip("e2b")
    from tests.e2e import e2b_env

    e2b_env.point_sdk_at(monkeypatch, server)
    ctx = tmp_path / "context"
    folder = ctx / "folder"
    folder.mkdir(parents=True)
    (folder / "test.txt").write_text("This is a test file.\n")
    os.symlink("test.txt", folder / "symlink.txt")
    os.symlink(str(folder / "test.txt"), folder / "symlink2.txt")  # absolute: kept as it is
    os.symlink("12345test.txt", folder / "symlink3.txt")  # leads nowhere: kept too
    (ctx / "tool.py").write_text("print('tool ran')\n")

    def template() -> Any:
        return (e2b.Template(file_context_path=str(ctx)).from_template("base")
                .set_workdir("/app")
                .copy("folder/*", "folder")
                .run_cmd("cat folder/symlink.txt > copied-then-read")
                .copy("tool.py", "/opt/tool/", user="user", mode=0o755)
                .set_user("user")
                .run_cmd("stat -c '%U %a' /opt/tool/tool.py > /home/user/tool-stat"))

    logs: list[str] = []
    e2b.Template.build(template(), "e2b-copy", on_build_logs=lambda e: logs.append(e.message))
    assert any(line.startswith("Uploaded 'folder/*'") for line in logs), logs[-30:]
    sbx = e2b.Sandbox.create("e2b-copy")
    try:
        r = sbx.commands.run("cat /app/copied-then-read; cat /home/user/tool-stat; python3 /opt/tool/tool.py; "
                             "readlink /app/folder/symlink2.txt /app/folder/symlink3.txt; ls -A /app/folder")
        assert r.stdout.splitlines() == [
            "This is a test file.", "user 755", "tool ran", str(folder / "test.txt"), "12345test.txt",
            "symlink.txt", "symlink2.txt", "symlink3.txt", "test.txt"], r.stdout
    finally:
        sbx.kill()
    logs.clear()
    e2b.Template.build(template(), "e2b-copy", on_build_logs=lambda e: logs.append(e.message))
    assert any("Skipping upload of 'folder/*', already cached" in line for line in logs), logs[-30:]


def test_e2b_sdk_template_tags(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """E2B's ``Template.build(t, "name:tag")``, ``assign_tags``, ``get_tags``, ``remove_tags``, and
    ``Sandbox.create("name:tag")``: a tag names a build; a sandbox of a tag left on an earlier build
    is refused with the reason (SPACE starts sandboxes from a template's current build)."""
    e2b = pytest.importorskip("e2b")
    from tests.e2e import e2b_env

    e2b_env.point_sdk_at(monkeypatch, server)

    def which(word: str) -> Any:
        return e2b.Template().from_template("base").run_cmd(f"echo {word} > /home/user/which")

    def built_from(ref: str) -> str:
        sbx = e2b.Sandbox.create(ref)
        try:
            return str(sbx.commands.run("cat /home/user/which").stdout.strip())
        finally:
            sbx.kill()

    info = e2b.Template.build(which("one"), "e2b-tags:v1")
    tagged = e2b.Template.assign_tags("e2b-tags:v1", ["production", "latest"])
    assert str(tagged.build_id) == str(info.build_id) and set(tagged.tags) == {"production", "latest"}
    assert e2b.Template.assign_tags("e2b-tags:v1", "stable").tags == ["stable"]
    for bad in (":invalid-tag", "e2b-tags:"):
        with pytest.raises(Exception):  # noqa: B017 - E2B's tests ask only that it raises
            e2b.Template.assign_tags("e2b-tags:v1", bad)
    tags = {t.tag: str(t.build_id) for t in e2b.Template.get_tags("e2b-tags")}
    assert tags == dict.fromkeys(("v1", "production", "latest", "stable"), str(info.build_id))
    assert built_from("e2b-tags:production") == "one"

    e2b.Template.build(which("two"), "e2b-tags:v2")
    assert built_from("e2b-tags:v2") == built_from("e2b-tags") == "two"
    with pytest.raises(Exception, match="earlier build"):
        e2b.Sandbox.create("e2b-tags:v1")
    e2b.Template.remove_tags("e2b-tags", ["latest", "stable"])
    assert {t.tag for t in e2b.Template.get_tags("e2b-tags")} == {"v1", "production", "v2"}
    with pytest.raises(Exception):  # noqa: B017 - a template that does not exist
        e2b.Template.remove_tags("no-such-template", ["x"])


def test_docker_hub_names_through_a_mirror(server: Server, api: httpx.Client, buildah: Buildah, registry: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``ubuntu:22.04`` is Docker Hub's ``docker.io/library/ubuntu:22.04``; with a mirror for
    docker.io (``SPACE_BUILD_REGISTRIES=docker.io=URL``) it is asked for and pulled there, and the
    template names the image as Docker Hub does. (The image is the server's Debian root pushed to
    the test registry under that name: Docker Hub is not reachable from here.)"""
    e2b = pytest.importorskip("e2b")
    from tests.e2e import e2b_env

    build_image(buildah, server, registry, "library/ubuntu", tag="22.04")
    e2b_env.point_sdk_at(monkeypatch, server)
    e2b.Template.build(e2b.Template().from_image("ubuntu:22.04").run_cmd('test "$(whoami)" = "root"', user="root"),
                       "hub-ubuntu")
    pinned = api.get("/v1/templates/hub-ubuntu").json()["image"]
    assert pinned.startswith("docker.io/library/ubuntu@sha256:"), pinned
    sbx = e2b.Sandbox.create("hub-ubuntu")
    try:
        assert sbx.commands.run("cat /etc/debian_version").exit_code == 0
    finally:
        sbx.kill()


def test_a_dockerfile_through_the_cli(server: Server, api: httpx.Client, buildah: Buildah, registry: str,
                                      tmp_path: Path) -> None:
    """``space template build NAME -f Dockerfile``: FROM the user's image, COPY from the context,
    RUN in the ENV/WORKDIR/USER before it, CMD as the start command; then a sandbox of it."""
    image = f"{registry}/team/app:1"
    if api.get("/v1/templates/team-app").status_code != 200:
        image = build_image(buildah, server, registry, "team/app")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("<h1>from a Dockerfile</h1>\n")
    (tmp_path / "Dockerfile").write_text(f"""
ARG GREETING=hi
FROM {image}
ENV SITE=/srv/site
WORKDIR $SITE
RUN mkdir -p /home/user/owned && echo "made by a RUN before the COPY" > /home/user/owned/old.txt
COPY site/ ./
COPY --chown=user:user site/index.html /home/user/owned/
USER user
RUN echo "$GREETING from $(id -un) in $(pwd)" > /home/user/built && ls /home/user/owned >> /home/user/built
EXPOSE 8000
CMD ["python3", "-m", "http.server", "8000"]
""")
    env = {**os.environ, "SPACE_URL": server.url, "SPACE_API_KEY": server.admin_key}
    p = subprocess.run([SPACE, "template", "build", "from-dockerfile", "-f", str(tmp_path / "Dockerfile"),
                        "--build-arg", "GREETING=hello"], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(p.stdout.strip()) == 64
    sid = create_sandbox(api, template="from-dockerfile")
    try:
        code, out, err = run(api, sid, {"shell": "cat /home/user/built; cat index.html; pwd; "
                                                 "stat -c '%U %n' /home/user/owned/index.html index.html"})
        assert code == 0, err
        # COPY in its place among the RUNs (the directory a RUN made before it, the file a RUN after
        # it listed), --chown's owner, else root's.
        assert out.decode().splitlines() == [
            "hello from user in /srv/site", "index.html", "old.txt", "<h1>from a Dockerfile</h1>", "/srv/site",
            "user /home/user/owned/index.html", "root index.html"]
        # The start command has no readiness check (a Dockerfile has none SPACE takes): wait for it.
        fetch = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/').read().decode(), end='')"

        def served() -> bytes | None:
            code, page, _ = run(api, sid, {"cmd": ["python3", "-c", fetch]})
            return page if code == 0 else None

        assert wait_for(served, timeout=60, what="the image's command serving the site") == (
            b"<h1>from a Dockerfile</h1>\n")
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_a_private_registry_with_the_operators_login(server: Server, api: httpx.Client, auth_registry: str,
                                                     tmp_path: Path) -> None:
    layer = tmp_path / "base.tar"
    subprocess.run(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", str(base_template(server)),
                    "-cf", str(layer), "."], check=True)
    pinned = push_with_login(tmp_path, auth_registry, "private/app", [layer])
    tag = pinned.split("@")[0] + ":v1"

    r = api.post("/v1/templates/private-app/build", json={"spec": {"image": tag, "user": "user"}})
    assert r.status_code >= 400 and "unauthorized" in r.text.lower(), r.text

    r = api.put("/v1/secrets/registry-login", json={"value": "alice:s3cret", "format": "basic",
                                                    "hosts": ["localhost"]})
    assert r.status_code in (200, 201), r.text
    r = api.post("/v1/templates/private-app/build", json={"spec": {"image": tag, "user": "user"}})
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=900)
    assert op["status"] == "succeeded", op
    assert api.get("/v1/templates/private-app").json()["image"] == pinned
    sid = create_sandbox(api, template="private-app")
    try:
        code, out, _ = run(api, sid, {"shell": "id -un"})
        assert (code, out) == (0, b"user\n")
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
    audit = api.get("/v1/audit", params={"action": "secret.resolve"}).json()["records"]
    assert any(a["details"].get("registry") == auth_registry and a["target"] == "template:private-app"
               for a in audit), audit
    assert "s3cret" not in json.dumps(op) and "s3cret" not in json.dumps(api.get("/v1/templates/private-app").json())
    assert "s3cret" not in server.log_path.read_text(errors="replace")
