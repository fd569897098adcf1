"""space-template.toml parsing, spec validation and digests (no btrfs, no network).

Aspects: a full TOML file becomes the request spec (directories expand to one entry per file,
files are named by sha256, modes normalized); every malformed field is refused naming it; the
debootstrap form keeps ``base``'s digest; resolving a base embeds its spec and inherits its
defaults; the digest covers file contents and the base's spec; a derived spec validates only
resolved; saved specs validate; template_defaults reads a spec's sandbox defaults.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from space.errors import ValidationFailed
from space.node.sandboxes.startup import template_defaults
from space.node.templates import spec as ts
from space.node.templates.store import BASE_SPEC, spec_digest, validate_spec

FULL = """
name = "from-file"
[base]
template = "base"
[build]
apt = ["jq", "libfoo1"]
pip = ["requests==2.32.3"]
files = [{ src = "app/", dest = "/opt/app" }, { src = "run.sh", dest = "/usr/local/bin/run", mode = "755" }]
run = ["echo hi > /etc/motd"]
env = { FOO = "bar" }
user = "user"
workdir = "/home/user"
[start]
cmd = "python3 -m http.server 8000"
ready = { port = 8000 }
"""


def project(tmp_path: Path, toml: str = FULL) -> Path:
    (tmp_path / "app" / "sub").mkdir(parents=True)
    (tmp_path / "app" / "a.txt").write_text("a\n")
    (tmp_path / "app" / "sub" / "b.txt").write_text("b\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho run\n")
    path = tmp_path / ts.SPEC_FILE
    path.write_text(toml)
    return path


def resolved(spec: dict[str, Any], base: dict[str, Any] = BASE_SPEC) -> dict[str, Any]:
    return validate_spec(ts.resolve_base(spec, base, spec_digest(base)))


def test_a_full_file_becomes_the_request_spec(tmp_path: Path) -> None:
    parsed = ts.load(project(tmp_path), name="py-web")
    spec = parsed.spec
    assert spec["name"] == "py-web"  # the CLI's NAME wins over the file's
    assert spec["base_template"] == "base"
    assert spec["apt"] == ["jq", "libfoo1"] and spec["pip"] == ["requests==2.32.3"]
    assert [f["dest"] for f in spec["files"]] == ["/opt/app/a.txt", "/opt/app/sub/b.txt", "/usr/local/bin/run"]
    assert [f["mode"] for f in spec["files"]] == ["0644", "0644", "0755"]
    assert parsed.blobs[spec["files"][0]["sha256"]] == tmp_path / "app" / "a.txt"
    assert spec["start"] == {"cmd": "python3 -m http.server 8000", "ready": {"port": 8000, "timeout_s": 30.0}}
    assert (spec["env"], spec["user"], spec["workdir"]) == ({"FOO": "bar"}, "user", "/home/user")
    assert ts.load(project(tmp_path / "x")).spec["name"] == "from-file"


@pytest.mark.parametrize(("toml", "field"), [
    ('[base]\ntemplate = "base"\nsuite = "bookworm"', "base"),
    ("[base]\n", "base"),
    ('[base]\ntemplate = "base"\n[build]\napt = ["Bad Name"]', "build.apt"),
    ('[base]\ntemplate = "base"\n[build]\npip = ["--index-url=http://x"]', "build.pip"),
    ('[base]\ntemplate = "base"\n[build]\nrun = [""]', "build.run"),
    ('[base]\ntemplate = "base"\n[build]\nenv = { "1X" = "y" }', "build.env"),
    ('[base]\ntemplate = "base"\n[build]\nworkdir = "rel/path"', "build.workdir"),
    ('[base]\ntemplate = "base"\n[build]\nuser = "Root Kit"', "build.user"),
    ('[base]\ntemplate = "base"\n[build]\nsurprise = 1', "build.surprise"),
    ('[base]\ntemplate = "base"\n[build]\nfiles = [{ src = "missing", dest = "/x" }]', "build.files[0].src"),
    ('[base]\ntemplate = "base"\n[build]\nfiles = [{ src = "run.sh", dest = "/a/../b" }]', "build.files[0].dest"),
    ('[base]\ntemplate = "base"\n[build]\nfiles = [{ src = "run.sh", dest = "/x", mode = "999" }]',
     "build.files[0].mode"),
    ('[base]\ntemplate = "base"\n[start]\nready = { port = 80 }', "start.cmd"),
    ('[base]\ntemplate = "base"\n[start]\ncmd = "x"\nready = { port = 70000 }', "start.ready.port"),
    ('[base]\ntemplate = "base"\n[start]\ncmd = "x"\nready = { port = 1, cmd = "y" }', "start.ready"),
    ('[base]\ntemplate = "base"\n[start]\ncmd = "x"\nready = { cmd = "y", timeout_s = 0 }',
     "start.ready.timeout_s"),
    ('[base]\ntemplate = "t"', "base.template"),
    ('[base]\nsuite = "Bookworm!"', "base.suite"),
    ('extra = 1\n[base]\ntemplate = "base"', "extra"),
])
def test_malformed_fields_are_refused_by_name(tmp_path: Path, toml: str, field: str) -> None:
    with pytest.raises(ValidationFailed) as exc:
        ts.load(project(tmp_path, toml), name="t")
    assert exc.value.details["field"] == field, exc.value.message


def test_not_toml_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationFailed, match="not valid TOML"):
        ts.load(project(tmp_path, "[base\n"), name="t")


def test_the_debootstrap_form_keeps_the_digest_of_base(tmp_path: Path) -> None:
    spec = ts.load(project(tmp_path, '[base]\nsuite = "bookworm"'), name="base").spec
    assert spec == BASE_SPEC
    assert spec_digest(validate_spec(spec)) == spec_digest(BASE_SPEC)
    # Extra steps on a debootstrap base are part of the digest.
    more = ts.load(project(tmp_path / "b", '[base]\nsuite = "bookworm"\n[build]\napt = ["jq"]'), name="base").spec
    assert spec_digest(validate_spec(more)) != spec_digest(BASE_SPEC)


def test_resolving_embeds_the_base_and_inherits_its_defaults(tmp_path: Path) -> None:
    parent = resolved({"name": "mid", "base_template": "base", "env": {"A": "1", "B": "1"},
                       "start": {"cmd": "serve"}})
    assert parent["user"] == "user"  # from base
    assert parent["base_template"] == {"name": "base", "digest": spec_digest(BASE_SPEC), "spec": BASE_SPEC}
    child = resolved({"name": "leaf", "base_template": "mid", "env": {"B": "2"}, "workdir": "/w"}, parent)
    assert child["env"] == {"A": "1", "B": "2"}
    assert (child["start"], child["user"], child["workdir"]) == ({"cmd": "serve"}, "user", "/w")
    assert template_defaults(child) == ({"A": "1", "B": "2"}, "user", "/w")
    assert template_defaults(BASE_SPEC) == ({}, "user", None)


def test_the_digest_covers_file_contents_and_the_base(tmp_path: Path) -> None:
    path = project(tmp_path)
    first = resolved(ts.load(path, name="t").spec)
    again = resolved(ts.load(path, name="t").spec)
    assert spec_digest(first) == spec_digest(again)
    (tmp_path / "app" / "a.txt").write_text("changed\n")
    assert spec_digest(resolved(ts.load(path, name="t").spec)) != spec_digest(first)
    (tmp_path / "app" / "a.txt").write_text("a\n")
    other_base = {**BASE_SPEC, "packages": [*BASE_SPEC["packages"], "jq"]}
    assert spec_digest(resolved(ts.load(path, name="t").spec, other_base)) != spec_digest(first)


def test_a_derived_spec_must_be_resolved_and_consistent(tmp_path: Path) -> None:
    spec = ts.load(project(tmp_path), name="t").spec
    with pytest.raises(ValidationFailed) as exc:
        validate_spec(spec)
    assert exc.value.details["field"] == "base_template"
    good = resolved(spec)
    forged = copy.deepcopy(good)
    forged["base_template"]["digest"] = "0" * 64
    with pytest.raises(ValidationFailed, match="does not match"):
        validate_spec(forged)
    mixed = {**good, "suite": "bookworm"}
    with pytest.raises(ValidationFailed):
        validate_spec(mixed)
    bad_file = copy.deepcopy(good)
    bad_file["files"][0]["sha256"] = "xyz"
    with pytest.raises(ValidationFailed) as exc:
        validate_spec(bad_file)
    assert exc.value.details["field"] == "files[0].sha256"


def test_saved_specs_validate() -> None:
    spec = {"name": "mytpl", "from_snapshot": "snap-0123456789abcdef", "sandbox": "s0123456789abcdefghi",
            "parent_template_digest": spec_digest(BASE_SPEC), "user": "user", "env": {"A": "b"}}
    assert validate_spec(spec) == spec
    with pytest.raises(ValidationFailed) as exc:
        validate_spec({**spec, "parent_template_digest": "short"})
    assert exc.value.details["field"] == "parent_template_digest"
    assert ts.is_saved(spec) and not ts.is_derived(spec)


def test_blob_keys_are_sha256_only() -> None:
    assert ts.blob_key("a" * 64) == "blobs/" + "a" * 64
    with pytest.raises(ValidationFailed):
        ts.blob_key("../etc/passwd")
