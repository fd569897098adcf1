"""What an image's config gives a template spec (space.api.template_images.with_image_defaults):
the template's own settings win; the image's user by name (none: root; a uid is refused with a
message asking for the name), env merged, workdir, entrypoint then cmd as the start command; and
``[base] image`` in a space-template.toml."""

from __future__ import annotations

from pathlib import Path

import pytest

from space.api.template_images import with_image_defaults
from space.errors import ValidationFailed
from space.node.templates import spec as template_spec

PINNED = "registry.example.com/team/app@sha256:" + "ab" * 32
CONFIG = {"env": ["PATH=/usr/bin:/bin", "A=image"], "user": "app:staff", "workdir": "/srv/app/",
          "entrypoint": ["/bin/sh", "-c"], "cmd": ["exec server --port 80"]}


def test_the_image_fills_what_the_template_leaves_unset() -> None:
    out = with_image_defaults({"name": "t", "image": "registry.example.com/team/app:1"}, PINNED, CONFIG)
    assert out == {"name": "t", "image": PINNED, "user": "app", "env": {"PATH": "/usr/bin:/bin", "A": "image"},
                   "workdir": "/srv/app", "start": {"cmd": "/bin/sh -c 'exec server --port 80'"}}


def test_the_template_wins() -> None:
    own = {"name": "t", "image": "x", "user": "user", "env": {"A": "mine", "B": "b"}, "workdir": "/w",
           "start": {"cmd": "true"}}
    out = with_image_defaults(own, PINNED, CONFIG)
    assert (out["user"], out["workdir"], out["start"]) == ("user", "/w", {"cmd": "true"})
    assert out["env"] == {"PATH": "/usr/bin:/bin", "A": "mine", "B": "b"}


def test_no_user_is_root_and_a_uid_is_refused() -> None:
    assert with_image_defaults({"name": "t", "image": "x"}, PINNED, {})["user"] == "root"
    with pytest.raises(ValidationFailed, match="runs as '1000'"):
        with_image_defaults({"name": "t", "image": "x"}, PINNED, {"user": "1000:1000"})
    assert with_image_defaults({"name": "t", "image": "x", "user": "user"}, PINNED, {"user": "1000"})["user"] == "user"


def test_an_image_base_in_the_toml_file(tmp_path: Path) -> None:
    f = tmp_path / "space-template.toml"
    f.write_text('[base]\nimage = "registry.example.com/team/app:1.4"\n[build]\nuser = "app"\n')
    assert template_spec.load(f, "t").spec == {"name": "t", "image": "registry.example.com/team/app:1.4",
                                               "user": "app"}
    for base in ('image = "no-tag/x"', 'image = "r.example.com/x:1"\nsuite = "bookworm"',
                 'image = "r.example.com/x:1"\ntemplate = "base"'):
        f.write_text(f"[base]\n{base}\n")
        with pytest.raises(ValidationFailed, match="base"):
            template_spec.load(f, "t")
