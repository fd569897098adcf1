"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator, MutableMapping

import pytest

from tests.e2e.harness import Server, own_server

# ---- the caller's environment ---------------------------------------------------------------------

#: Variables SPACE, its SDK and CLI, boto/obstore and the E2B SDKs read: a caller's (the README's
#: walkthrough exports SPACE_URL and SPACE_API_KEY) would point the tests at another server, key or
#: bucket. ``SPACE_TEST_*`` are the suite's own knobs (``SPACE_TEST_PG_URL``) and stay.
CALLER_PREFIXES = ("SPACE_", "AWS_", "E2B_")
_scrubbed: dict[str, str] = {}


def scrub_caller_environment(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Remove the caller's SPACE_*, AWS_* and E2B_* variables from ``environ``; what was removed."""
    gone = {k: v for k, v in environ.items() if k.startswith(CALLER_PREFIXES) and not k.startswith("SPACE_TEST_")}
    for k in gone:
        del environ[k]
    return gone


def pytest_configure(config: pytest.Config) -> None:
    # Before collection: modules read some of them at import (space.controller's SPACE_CLAIM_GRACE).
    _scrubbed.update(scrub_caller_environment(os.environ))


def pytest_unconfigure(config: pytest.Config) -> None:
    os.environ.update(_scrubbed)


# ---- PostgreSQL ---------------------------------------------------------------------------------

_PG_ROLE = "space_test"


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def _psql(port: str, sql: str) -> str:
    proc = _run("runuser", "-u", "postgres", "--", "psql", "-p", port, "-v", "ON_ERROR_STOP=1",
                "-tAc", sql)
    if proc.returncode != 0:
        raise RuntimeError(f"psql {sql!r} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def _ensure_local_postgres() -> str:
    """Start (or create) Debian's PostgreSQL cluster and a ``space_test`` role and database.

    Returns the asyncpg URL; raises RuntimeError saying why PostgreSQL cannot be used.
    """
    if os.geteuid() != 0:
        raise RuntimeError("not root: cannot manage the local PostgreSQL cluster")
    if shutil.which("pg_lsclusters") is None:
        proc = _run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "postgresql", timeout=600)
        if proc.returncode != 0 or shutil.which("pg_lsclusters") is None:
            raise RuntimeError(f"postgresql is not installed and apt-get failed: {proc.stderr[-300:]}")
    clusters = [line.split() for line in _run("pg_lsclusters", "--no-header").stdout.splitlines()
                if line.strip()]
    if not clusters:
        versions = sorted((v for v in os.listdir("/usr/lib/postgresql") if v.isdigit()), key=int)
        if not versions:
            raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql")
        proc = _run("pg_createcluster", versions[-1], "main", "--start")
        if proc.returncode != 0:
            raise RuntimeError(f"pg_createcluster failed: {proc.stderr.strip()}")
        clusters = [line.split() for line in _run("pg_lsclusters", "--no-header").stdout.splitlines()
                    if line.strip()]
    ver, name, port, status = clusters[0][:4]
    if not re.fullmatch(r"\d+", port):
        raise RuntimeError(f"unexpected port {port!r} from pg_lsclusters")
    if status != "online":
        proc = _run("pg_ctlcluster", ver, name, "start")
        if proc.returncode != 0:
            raise RuntimeError(f"pg_ctlcluster {ver} {name} start failed: {proc.stderr.strip()}")
    # pg_isready -t waits (up to 60 s) for the server to accept connections.
    if _run("pg_isready", "-q", "-t", "60", "-h", "127.0.0.1", "-p", port).returncode != 0:
        raise RuntimeError(f"PostgreSQL {ver}/{name} did not accept connections on port {port}")
    if _psql(port, f"SELECT 1 FROM pg_roles WHERE rolname = '{_PG_ROLE}'") != "1":
        _psql(port, f"CREATE ROLE {_PG_ROLE} LOGIN PASSWORD '{_PG_ROLE}'")
    if _psql(port, f"SELECT 1 FROM pg_database WHERE datname = '{_PG_ROLE}'") != "1":
        _psql(port, f"CREATE DATABASE {_PG_ROLE} OWNER {_PG_ROLE}")
    return f"postgresql+asyncpg://{_PG_ROLE}:{_PG_ROLE}@127.0.0.1:{port}/{_PG_ROLE}"


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """An asyncpg URL of a PostgreSQL database the tests may wipe.

    ``$SPACE_TEST_PG_URL`` wins (it must name a throwaway database: tests drop its ``public``
    schema); otherwise the local Debian cluster is started, or created, and a ``space_test``
    role and database are made. Skips only when PostgreSQL cannot run here at all.
    """
    url = os.environ.get("SPACE_TEST_PG_URL")
    if url:
        return url
    try:
        return _ensure_local_postgres()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"PostgreSQL unavailable: {e}")


# ---- a real `space serve` ----------------------------------------------------------------------


#: The domain of E2B host names on the shared server.
E2B_TEST_DOMAIN = "e2b.test"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # E2B's host routing (<port>-<id>.e2b.test) is on, so its tests need no server of their own.
    with own_server(tmp_path_factory.mktemp("srv"), "--e2b-domain", E2B_TEST_DOMAIN) as srv:
        yield srv
