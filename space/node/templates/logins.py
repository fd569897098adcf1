"""Registry logins on their way from the node agent to its root helper: a memfd (never a file on
disk) holding ``{registry: {"username", "password"}}`` as JSON, passed as the helper's ``auth``
descriptor and closed once the call returns."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping

Logins = Mapping[str, Mapping[str, str]]


@contextlib.contextmanager
def logins_fd(logins: Logins | None) -> Iterator[dict[str, int]]:
    """``fds`` for a helper call: ``{"auth": fd}`` with ``logins``, ``{}`` without any."""
    if not logins:
        yield {}
        return
    fd = os.memfd_create("space-registry-logins", os.MFD_CLOEXEC)
    try:
        data = json.dumps({k: dict(v) for k, v in logins.items()}).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        yield {"auth": fd}
    finally:
        os.close(fd)
