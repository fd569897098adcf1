"""A Dockerfile's common subset as a template spec (space.node.templates.dockerfile), no build:

- each instruction of the subset: FROM an image or a template, RUN (shell and JSON form) in the
  ENV/ARG/WORKDIR/USER before it, COPY/ADD of files and directories of the context (into a
  directory, onto a name, --chmod), ENV in both forms, ARG defaults and --build-arg, WORKDIR
  relative to the one before, USER, CMD and ENTRYPOINT combined as Docker combines them; variables
  substituted where Docker substitutes them; continuation lines and comments
- EXPOSE and LABEL accepted and ignored
- refused with the line they are on: an instruction outside the subset, a second FROM, an image
  without its registry, COPY --from/--link and a numeric --chown, wildcards, URLs, archives ADD would unpack,
  sources outside the context, a numeric USER, a heredoc, a --build-arg no ARG declares
"""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest

from space.node.templates.dockerfile import DockerfileError, logical_lines, parse, substitute
from space.node.templates.spec import file_sha256

IMAGE = "registry.example.com/team/app:1.4"


@pytest.fixture
def context(tmp_path: Path) -> Path:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text("print('hi')\n")
    (tmp_path / "app" / "sub").mkdir()
    (tmp_path / "app" / "sub" / "data.txt").write_text("data\n")
    (tmp_path / "requirements.txt").write_text("six==1.16.0\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho run\n")
    (tmp_path / "run.sh").chmod(0o755)
    return tmp_path


def test_the_subset_in_order(context: Path) -> None:
    text = """
# a comment
ARG TAG=1.4
FROM registry.example.com/team/app:${TAG}
LABEL maintainer="someone"
ENV APP_HOME=/srv/app \\
    GREETING="hello world"
ENV LEGACY legacy value
WORKDIR $APP_HOME
COPY requirements.txt ./
COPY app/ ./src/
COPY --chmod=0700 run.sh /usr/local/bin/run
RUN pip install -r requirements.txt
USER user
RUN ["python3", "src/main.py"]
EXPOSE 8000
ENTRYPOINT ["python3", "-m"]
CMD ["http.server", "8000"]
"""
    parsed = parse(text, context, name="web")
    spec = parsed.spec
    assert spec["image"] == IMAGE
    assert spec["env"] == {"APP_HOME": "/srv/app", "GREETING": "hello world", "LEGACY": "legacy value"}
    assert (spec["workdir"], spec["user"]) == ("/srv/app", "user")
    assert spec["start"] == {"cmd": "python3 -m http.server 8000"}
    assert "files" not in spec
    steps = spec["run"]
    assert [type(s) for s in steps] == [dict, dict, dict, str, str]  # COPYs in their place among RUNs
    copies = [s for s in steps if isinstance(s, dict)]
    assert [(c["src"], c["dest"], c["owner"], c["mode"]) for c in copies] == [
        ("requirements.txt", "/srv/app/", "root", ""), ("app", "/srv/app/src/", "root", ""),
        ("run.sh", "/usr/local/bin/run", "root", "0700")]
    assert set(parsed.blobs) == {c["archive"] for c in copies}
    for c in copies:
        assert file_sha256(parsed.blobs[c["archive"]]) == c["archive"]
    with tarfile.open(parsed.blobs[copies[1]["archive"]]) as tar:
        members = tar.getmembers()
        assert sorted(m.name for m in members) == ["app", "app/main.py", "app/sub", "app/sub/data.txt"]
        assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and not m.uname for m in members)
        main = tar.extractfile("app/main.py")
        assert main is not None and main.read() == b"print('hi')\n"
    # The same context again: the same archives, so the same template.
    again = [c["archive"] for c in parse(text, context, name="web").spec["run"] if isinstance(c, dict)]
    assert again == [c["archive"] for c in copies]
    first, second = [s for s in steps if isinstance(s, str)]
    assert first.endswith("mkdir -p /srv/app && cd /srv/app\npip install -r requirements.txt")
    assert "export TAG=1.4" in first and "export GREETING='hello world'" in first
    assert second.startswith("su -s /bin/sh user -c ") and "python3 src/main.py" in second


def test_copy_owner_links_and_order(context: Path) -> None:
    (context / "app" / "link").symlink_to("main.py")
    spec = parse("FROM base\nRUN useradd app\nCOPY --chown=app:app app /opt/app\nRUN ls -l /opt/app\n",
                 context, name="t").spec
    useradd, copy, ls = spec["run"]
    assert useradd == "useradd app" and ls == "ls -l /opt/app"
    assert (copy["owner"], copy["dest"]) == ("app:app", "/opt/app")
    parsed = parse("FROM base\nCOPY app /opt/app\n", context, name="t")
    with tarfile.open(parsed.blobs[parsed.spec["run"][0]["archive"]]) as tar:
        link = tar.getmember("app/link")
        assert link.issym() and link.linkname == "main.py"  # a link stays a link


def test_run_scripts_run_where_and_with_what_docker_would(context: Path, tmp_path: Path) -> None:
    where = tmp_path / "wd"
    spec = parse(f'FROM base\nARG MODE=fast\nENV A="x y"\nWORKDIR {where}\nRUN echo "$A|$MODE|$(pwd)"',
                 context, name="t").spec
    assert spec["base_template"] == "base"
    out = subprocess.run(["/bin/sh", "-c", spec["run"][0]], capture_output=True, text=True, check=True).stdout
    assert out == f"x y|fast|{where}\n"


def test_args_and_variables(context: Path) -> None:
    spec = parse("ARG BASE=base\nFROM ${BASE}\nARG WHO\nUSER ${WHO:-user}\nENV P=${MISSING:+set}x",
                 context, name="t", build_args={"BASE": "py-web"}).spec
    assert (spec["base_template"], spec["user"], spec["env"]) == ("py-web", "user", {"P": "x"})
    assert parse("FROM base\nARG WHO\nUSER $WHO", context, name="t", build_args={"WHO": "app"}).spec["user"] == "app"
    assert substitute(r"a \$HOME $X ${X}", {"X": "1"}, 1) == "a $HOME 1 1"


def test_cmd_and_entrypoint_as_docker_combines_them(context: Path) -> None:
    def start(lines: str) -> object:
        return parse(f"FROM base\n{lines}", context, name="t").spec.get("start")

    assert start('CMD ["a", "b c"]') == {"cmd": "a 'b c'"}
    assert start("CMD echo $HOME") == {"cmd": "echo $HOME"}
    assert start('ENTRYPOINT ["e"]\nCMD ["x"]') == {"cmd": "e x"}
    assert start('ENTRYPOINT e --flag\nCMD ["ignored"]') == {"cmd": "e --flag"}
    assert start("") is None


def test_continuations_and_comments() -> None:
    assert logical_lines("FROM base\n# note\nRUN a \\\n  # inside\n  && b\n\n") == [(1, "FROM base"), (3, "RUN a && b")]


def test_docker_hub_short_names_are_images() -> None:
    for text, image in (("FROM ubuntu:24.04", "docker.io/library/ubuntu:24.04"),
                        ("FROM team/app@sha256:" + "a" * 64, "docker.io/team/app@sha256:" + "a" * 64),
                        ("FROM localhost:5000/app:1", "localhost:5000/app:1")):
        assert parse(text, Path("/nonexistent"), name="t").spec["image"] == image
    assert parse("FROM base", Path("/nonexistent"), name="t").spec["base_template"] == "base"


@pytest.mark.parametrize(("text", "line", "message"), [
    ("FROM base\nHEALTHCHECK CMD true", 2, "HEALTHCHECK is not an instruction SPACE builds"),
    ("FROM base\nVOLUME /data", 2, "VOLUME is not an instruction"),
    ("FROM base AS build\n", 1, "FROM takes one image or template"),
    ("FROM base\nFROM base", 2, "multi-stage builds are not supported"),
    ("FROM -bad", 1, "name a SPACE template, or an image"),
    ("FROM Ubuntu:24.04", 1, r"an image is \[registry/\]repository:tag"),
    ("RUN true\nFROM base", 1, "RUN before FROM"),
    ("FROM base\nCOPY --chown=1000 app /app", 2, "--chown=user\\[:group\\] by name"),
    ("FROM base\nCOPY --from=build /a /b", 2, "--from is not supported"),
    ("FROM base\nCOPY app/*.py /app/", 2, "wildcards are not supported"),
    ("FROM base\nADD https://example.com/x /x", 2, "ADD of a URL"),
    ("FROM base\nADD bundle.tar.gz /opt/", 2, "ADD of an archive"),
    ("FROM base\nCOPY ../secret /x", 2, "a source is a path inside the build context"),
    ("FROM base\nCOPY app requirements.txt /dest", 2, "a destination directory ending in /"),
    ("FROM base\nCOPY nothing-here /x", 2, "does not exist"),
    ("FROM base\nUSER 1000", 2, "by name, not by uid"),
    ("FROM base\nRUN cat <<EOF", 2, "heredoc"),
    ("# escape=`\nFROM base", 1, "parser directives"),
    ("FROM base\nENV 1BAD=x", 2, "is not a variable name"),
])
def test_refused_with_the_line(context: Path, text: str, line: int, message: str) -> None:
    with pytest.raises(DockerfileError, match=message) as info:
        parse(text, context, name="t")
    assert info.value.details["line"] == line and f"line {line}:" in info.value.message


def test_refused_for_the_whole_file(context: Path) -> None:
    with pytest.raises(DockerfileError, match="no FROM"):
        parse("ARG X=1\n", context, name="t")
    with pytest.raises(DockerfileError, match="--build-arg NOPE names no ARG"):
        parse("FROM base\n", context, name="t", build_args={"NOPE": "1"})
    with pytest.raises(DockerfileError, match="limited to"):
        parse("#" * (1 << 21), context, name="t")
