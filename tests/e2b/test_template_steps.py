"""E2B template build instructions as a SPACE template spec (space.e2b.templates.spec_of): the
base (an image, E2B's base image, a template), RUN steps in the ENV/WORKDIR/USER before them,
the last of each as the template's defaults, the start and ready commands; refused with a 400
naming the step: a COPY without uploaded files, registry credentials, an unknown instruction."""

from __future__ import annotations

import subprocess

import pytest

from space.e2b.control import E2BError
from space.e2b.templates import BuildStart, spec_of, template_name


def start(**body: object) -> BuildStart:
    return BuildStart.model_validate(body)


def test_instructions_in_order() -> None:
    spec = spec_of(start(fromImage="registry.example.com/team/app:1", startCmd="serve", readyCmd="true", steps=[
        {"type": "RUN", "args": ["echo first"]},
        {"type": "ENV", "args": ["A", "1 2", "B", "x'y"]},
        {"type": "WORKDIR", "args": ["/srv/app"]},
        {"type": "USER", "args": ["user"]},
        {"type": "RUN", "args": ["echo second"]},
        {"type": "RUN", "args": ["echo third", "root"]},
    ]))
    assert spec["image"] == "registry.example.com/team/app:1"
    assert (spec["env"], spec["workdir"], spec["user"]) == ({"A": "1 2", "B": "x'y"}, "/srv/app", "user")
    assert spec["start"] == {"cmd": "serve", "ready": {"cmd": "true"}}
    first, second, third = spec["run"]
    assert first == 'cd "$HOME"\necho first'  # no WORKDIR yet: the user's home, as E2B's builds (and COPY)
    assert second.startswith("if ! id -u user >/dev/null 2>&1; then echo ")
    assert "\nsu -s /bin/sh user -c " in second
    assert third == "export A='1 2'\nexport B='x'\"'\"'y'\nmkdir -p /srv/app && cd /srv/app\necho third"
    # The scripts are what sh runs: the environment and directory reach the command.
    out = subprocess.run(["/bin/sh", "-c", third.replace("/srv/app", "/tmp/space-e2b-steps").replace(
        "echo third", 'echo "$A|$B|$(pwd)"')], capture_output=True, text=True, check=True).stdout
    assert out == "1 2|x'y|/tmp/space-e2b-steps\n"


def test_a_run_as_a_user_that_does_not_exist_fails_in_envds_words() -> None:
    """E2B's SDK users (and its test_run_command_as_user_that_does_not_exist) match on envd's words."""
    (step,) = spec_of(start(steps=[{"type": "RUN", "args": ["whoami", "root123"]}]))["run"]
    r = subprocess.run(["/bin/sh", "-c", step], capture_output=True, text=True)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == "failed to run command 'whoami': command failed: unauthenticated: invalid username: 'root123'\n"


def test_copies_keep_their_place_and_context() -> None:
    sha = "5" * 64
    spec = spec_of(start(steps=[
        {"type": "RUN", "args": ["mkdir /srv"]},
        {"type": "COPY", "args": ["app/", "/srv/app/"], "filesHash": "h1"},
        {"type": "WORKDIR", "args": ["/srv"]},
        {"type": "USER", "args": ["user"]},
        {"type": "COPY", "args": ["conf/*.toml", "conf", "root:root", "0600"], "filesHash": "h2"},
        {"type": "RUN", "args": ["ls conf"]},
    ]), {"h1": sha, "h2": sha.replace("5", "6")})
    first, copy1, copy2, last = spec["run"]
    assert first == 'cd "$HOME"\nmkdir /srv' and last.endswith("ls conf'")
    assert copy1 == {"archive": sha, "src": "app/", "dest": "/srv/app/", "owner": "", "mode": "", "workdir": "",
                     "user": ""}
    assert copy2 == {"archive": "6" * 64, "src": "conf/*.toml", "dest": "conf", "owner": "root:root",
                     "mode": "0600", "workdir": "/srv", "user": "user"}


def test_a_copy_under_the_root_directory() -> None:
    """E2B's ``from_dockerfile`` starts with Docker's ``WORKDIR /``: a COPY after it is valid."""
    from space.node.templates.spec import check_build_fields

    spec = spec_of(start(steps=[{"type": "WORKDIR", "args": ["/"]},
                                {"type": "COPY", "args": ["app.py", "opt/app/"], "filesHash": "h"},
                                {"type": "WORKDIR", "args": ["/home/user"]}]), {"h": "7" * 64})
    check_build_fields(spec)
    assert spec["run"][0]["workdir"] == "/" and spec["workdir"] == "/home/user"


def test_the_base() -> None:
    assert spec_of(start())["base_template"] == "base"
    assert spec_of(start(fromImage="e2bdev/base"))["base_template"] == "base"
    assert spec_of(start(fromTemplate="py-web:v2"))["base_template"] == "py-web"
    assert "image" not in spec_of(start(fromTemplate="py-web"))


@pytest.mark.parametrize(("body", "message"), [
    ({"steps": [{"type": "COPY", "args": ["a", "/a"], "filesHash": "x"}]}, "COPY 'a' has no uploaded files"),
    ({"steps": [{"type": "COPY", "args": ["a"], "filesHash": "x"}]}, "'COPY' with 1 argument"),
    ({"fromImage": "r.example.com/x:1", "fromImageRegistry": {"type": "registry", "username": "u"}},
     "registry credentials in the build"),
    ({"steps": [{"type": "HEALTHCHECK", "args": []}]}, "'HEALTHCHECK' with 0 argument"),
    ({"steps": [{"type": "ENV", "args": ["A"]}]}, "ENV takes name and value pairs"),
    ({"steps": [{"type": "WORKDIR", "args": ["/a", "/b"]}]}, "'WORKDIR' with 2 argument"),
])
def test_what_is_refused(body: dict[str, object], message: str) -> None:
    with pytest.raises(E2BError, match=message) as info:
        spec_of(start(**body))
    assert info.value.status == 400


def test_names() -> None:
    assert template_name("my-env:v1.0") == "my-env"
    for bad in ("", "a/b", "../x", "x y"):
        with pytest.raises(E2BError):
            template_name(bad)
