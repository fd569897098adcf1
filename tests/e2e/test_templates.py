"""The template pipeline end to end, on a server of its own (real btrfs, runsc, apt and PyPI).

Aspects: ``space template build NAME -f space-template.toml`` derives a template from ``base``
with an apt package, a pip package, a file, a run command, env, a workdir and a start command;
a sandbox of it has them. Building the same spec again is a cache hit (no rebuild, same digest,
the node's template directory untouched). A sandbox saved as a template (``space template
save``) carries its files into new sandboxes, and its stream is in the object store.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from space.config import ServeSettings
from space.node.templates import spec as template_spec
from tests.e2e.harness import SPACE, Server, create_sandbox, own_server, run

pytestmark = pytest.mark.runtime

#: The machine's template cache, which own_server's servers share.
CACHE = ServeSettings(data_dir=Path("unused")).cache_dir

TOML = """
name = "ignored-the-cli-name-wins"
[base]
template = "base"
[build]
apt = ["jq"]
pip = ["six==1.16.0"]
files = [{ src = "site/", dest = "/opt/site" }]
run = ["echo built-by-run > /etc/space-built"]
env = { GREETING = "hello-from-template" }
workdir = "/srv/work"
[start]
cmd = "python3 -m http.server 8000 --directory /opt/site"
ready = { port = 8000, timeout_s = 30 }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with own_server(tmp_path_factory.mktemp("tpl")) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The template's source directory. A file unique to this run makes its spec new, so it is
    built (not received from the machine's template cache); what the run adds to that cache goes."""
    d = tmp_path_factory.mktemp("project")
    (d / "site").mkdir()
    (d / "site" / "index.html").write_text("<h1>space template</h1>\n")
    (d / "site" / "sub").mkdir()
    (d / "site" / "sub" / "run-id.txt").write_text(f"{uuid.uuid4()}\n")
    (d / "space-template.toml").write_text(TOML)
    yield d
    for f in (d / "site").rglob("*"):
        if f.is_file():
            (CACHE / "blobs" / template_spec.file_sha256(f)).unlink(missing_ok=True)


@pytest.fixture(scope="module", autouse=True)
def _forget_cached_streams(server: Server) -> Iterator[None]:
    yield
    for manifest in (server.data_dir / "pool" / "templates").glob("*@*.json"):
        body = json.loads(manifest.read_text())
        if body["name"] != "base":
            (CACHE / "templates" / f"{body['name']}-{body['digest']}.btrfs.zst").unlink(missing_ok=True)


def cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPACE_URL": server.url, "SPACE_API_KEY": server.admin_key}
    p = subprocess.run([SPACE, *args], env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise AssertionError(f"space {' '.join(args)} -> {p.returncode}\n{p.stderr}\n{server.log_tail()}")
    return p


def sh(api: httpx.Client, sid: str, script: str, **extra: str) -> str:
    code, out, err = run(api, sid, {"shell": script, **extra})
    assert code == 0, (script, code, out, err)
    return out.decode()


def template_dirs(server: Server, name: str) -> dict[str, float]:
    root = server.data_dir / "pool" / "templates"
    return {p.name: p.stat().st_mtime for p in root.glob(f"{name}@*")}


@pytest.fixture(scope="module")
def built(server: Server, project: Path) -> dict[str, str]:
    """``pyweb`` built once from the TOML file; its digest and the CLI's stderr."""
    started = time.monotonic()
    p = cli(server, "template", "build", "pyweb", "-f", str(project / "space-template.toml"))
    print(f"derived build: {time.monotonic() - started:.1f}s through the CLI;",
          *[line for line in p.stderr.splitlines() if " built in " in line])
    return {"digest": p.stdout.strip(), "stderr": p.stderr}


def test_build_from_toml_streams_steps_and_prints_the_digest(built: dict[str, str], api: httpx.Client) -> None:
    digest = built["digest"]
    assert len(digest) == 64 and "\n" not in digest
    for step in ("base: template base@", "apt install jq", "pip install six==1.16.0", "copy 2 file(s)",
                 "run: echo built-by-run", "configure: user user, workdir /srv/work", "publish pyweb@"):
        assert step in built["stderr"], (step, built["stderr"][-3000:])
    t = api.get("/v1/templates/pyweb").json()
    assert (t["status"], t["digest"]) == ("ready", digest)


def test_sandbox_of_the_template_has_its_packages_files_and_commands(built: dict[str, str], api: httpx.Client,
                                                                     project: Path) -> None:
    sid = create_sandbox(api, template="pyweb")
    try:
        assert sh(api, sid, "jq --version").startswith("jq-")
        assert sh(api, sid, "python3 -c 'import six; print(six.__version__)'").strip() == "1.16.0"
        assert sh(api, sid, "cat /opt/site/index.html") == "<h1>space template</h1>\n"
        assert sh(api, sid, "cat /opt/site/sub/run-id.txt") == (project / "site" / "sub" / "run-id.txt").read_text()
        assert sh(api, sid, "stat -c %a /opt/site/index.html").strip() == "644"
        assert sh(api, sid, "cat /etc/space-built") == "built-by-run\n"
        # The workdir exists and belongs to the template's user; apt lists were cleaned.
        assert sh(api, sid, "stat -c %U /srv/work").strip() == "user"
        assert sh(api, sid, "ls /var/lib/apt/lists | grep -c Packages || true").strip() == "0"
        assert sh(api, sid, "whoami").strip() == "user"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_sandbox_of_the_template_gets_its_env_workdir_and_running_start_command(
        built: dict[str, str], api: httpx.Client) -> None:
    sid = create_sandbox(api, template="pyweb")
    try:
        assert sh(api, sid, "echo $GREETING").strip() == "hello-from-template"
        assert sh(api, sid, "pwd").strip() == "/srv/work"
        # Create finished only once the start command's port accepted connections.
        page = sh(api, sid, "python3 -c \"import urllib.request as u; "
                            "print(u.urlopen('http://127.0.0.1:8000/index.html').read().decode(), end='')\"")
        assert page == "<h1>space template</h1>\n"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_building_the_same_spec_again_is_a_cache_hit(built: dict[str, str], server: Server, project: Path,
                                                     api: httpx.Client) -> None:
    before = template_dirs(server, "pyweb")  # the subvolume and its manifest
    assert len([n for n in before if not n.endswith(".json")]) == 1, before
    started = time.monotonic()
    p = cli(server, "template", "build", "pyweb", "-f", str(project / "space-template.toml"))
    print(f"cached build: {time.monotonic() - started:.1f}s through the CLI")
    assert p.stdout.strip() == built["digest"]
    assert "ready (cached, no rebuild)" in p.stderr, p.stderr
    assert "apt install" not in p.stderr
    assert template_dirs(server, "pyweb") == before
    # A spec naming a base that does not exist is refused up front, naming the field.
    r = api.post("/v1/templates/other/build", json={"spec": {"base_template": "nope"}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "base.template", r.text


def test_a_sandbox_saved_as_a_template_carries_its_files(server: Server, api: httpx.Client) -> None:
    src = create_sandbox(api)
    new = None
    try:
        # A configured template (built from the server's spec) is not overwritten by a save.
        r = api.post("/v1/templates", json={"name": "base", "sandbox_id": src})
        assert r.status_code == 409, r.text
        sh(api, src, "echo saved-state > /home/user/note.txt")
        started = time.monotonic()
        p = cli(server, "template", "save", src, "mytpl")
        print(f"save: {time.monotonic() - started:.1f}s through the CLI")
        digest = p.stdout.strip()
        assert len(digest) == 64, p.stdout
        t = api.get("/v1/templates/mytpl").json()
        assert (t["status"], t["digest"]) == ("ready", digest)
        new = create_sandbox(api, template="mytpl")
        assert sh(api, new, "cat /home/user/note.txt") == "saved-state\n"
        assert sh(api, new, "whoami").strip() == "user"
        # Its stream is in the object store, named by the hash of its bytes, with a sealed manifest:
        # other nodes download it (it cannot be rebuilt).
        streams = list((server.data_dir / "objects" / "templates").glob(f"mytpl-{digest}-*.btrfs.zst"))
        assert len(streams) == 1 and streams[0].stat().st_size > 0, streams
        sha = streams[0].name.removesuffix(".btrfs.zst").rsplit("-", 1)[1]
        assert hashlib.sha256(streams[0].read_bytes()).hexdigest() == sha
        sealed = json.loads((server.data_dir / "objects" / "templates" / f"mytpl-{digest}.json").read_text())
        assert sealed["kind"] == "template" and sealed["body"]["stream"]["sha256"] == sha
        manifest = next((server.data_dir / "pool" / "templates").glob("mytpl@*.json"))
        spec = json.loads(manifest.read_text())["spec"]
        assert spec["sandbox"] == src and spec["from_snapshot"].startswith("snap")
        # Rebuilding a saved template is refused; the template stays usable.
        r = api.post("/v1/templates/mytpl/build", json={"force": True})
        assert r.status_code == 400 and "cannot be rebuilt" in r.json()["error"]["message"], r.text
        assert api.get("/v1/templates/mytpl").json()["status"] == "ready"
    finally:
        for sid in (src, new):
            if sid is not None:
                api.delete(f"/v1/sandboxes/{sid}")
