# SPACE — the two commands: `make run` (install everything, start the platform) and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
DATA_DIR ?= /var/lib/space
LISTEN ?= 127.0.0.1:8080
PYTEST_ARGS ?=
GW_VENV ?= .venv-gateway
DEPLOY_VENV ?= .venv-deploy

.PHONY: setup system python gateway deploy-tools access images test-containers run test lint typecheck check bench chaos chaos-short e2b-suite clean-dev

setup: system python gateway deploy-tools access  ## install system packages and the Python environments (idempotent)

system:
	@if [ "$$(id -u)" -ne 0 ]; then sudo bash scripts/setup-system.sh; else bash scripts/setup-system.sh; fi

python: $(VENV)/.installed
	@# the CLI on PATH for the README walkthrough (this checkout's)
	@if [ -w /usr/local/bin ]; then ln -sf "$$(pwd)/$(VENV)/bin/space" /usr/local/bin/space; fi
	@# the guest daemon mounted into sandboxes, compiled and its exec wrapper built here, not by a running node
	$(PY) -m space.cli.main node prepare-guest >/dev/null

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

gateway: $(GW_VENV)/.installed  ## the egress gateway's own venv (mitmproxy pins clash with the main venv)

$(GW_VENV)/.installed: gateway-requirements.txt pyproject.toml
	test -x $(GW_VENV)/bin/python || python3 -m venv $(GW_VENV)
	$(GW_VENV)/bin/python -m pip install -q --upgrade pip
	$(GW_VENV)/bin/python -m pip install -q -r gateway-requirements.txt
	$(GW_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

deploy-tools: $(DEPLOY_VENV)/.installed  ## the manifests' validators (kubernetes-validate, checkov), in a venv of their own

$(DEPLOY_VENV)/.installed: deploy-requirements.txt
	test -x $(DEPLOY_VENV)/bin/python || python3 -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install -q --upgrade pip
	$(DEPLOY_VENV)/bin/python -m pip install -q -r deploy-requirements.txt
	touch $@

access: python gateway  ## the service users (`space`: the API; `space-node`: the node agent; `space-gw`: the egress gateway) can reach their Python and this checkout
	@if [ "$$(id -u)" -eq 0 ]; then bash scripts/service-user-access.sh space $(PY) space-node $(PY) space-gw $(GW_VENV)/bin/python; fi

images:  ## the space and space-node images (as root: buildah from a debootstrap'd Debian root) in build/images/
	bash deploy/images/build.sh

test-containers: setup images  ## the images as podman containers: API, controller and node agent; create, exec, files, pause, suspend, node container restarts (tests/deploy/test_containers.py)
	@command -v podman >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman runc >/dev/null
	SPACE_TEST_CONTAINERS=1 $(VENV)/bin/pytest -m containers tests/deploy/test_containers.py $(PYTEST_ARGS)

run: setup  ## start SPACE on its embedded defaults (builds the `base` template on first start)
	$(VENV)/bin/space serve --data-dir $(DATA_DIR) --listen $(LISTEN)

test: setup lint typecheck  ## the whole test suite, with real sandboxes and the 5-minute chaos run
	$(VENV)/bin/pytest $(PYTEST_ARGS)

chaos-short: setup  ## the 5-minute chaos run (tests/e2e/test_chaos.py)
	$(VENV)/bin/pytest -m chaos $(PYTEST_ARGS)

lint:
	$(VENV)/bin/ruff check space tests bench scripts
	$(PY) scripts/unasync.py --check
	$(VENV)/bin/lint-imports

typecheck:
	$(VENV)/bin/mypy

bench: setup  ## benchmarks: prints a table, saves bench/results/<date>.json and .md
	$(PY) bench/run

chaos: setup  ## 30 minutes of killed, frozen and drained nodes, controllers and replicas; report in bench/results/<date>-chaos.md
	$(PY) bench/chaos.py --minutes $(or $(CHAOS_MINUTES),30)

e2b-suite: setup  ## E2B's own Python SDK tests, unmodified, against a space serve of its own (E2B_SDK_DIR=<an E2B checkout>/packages/python-sdk; see scripts/e2b-suite)
	scripts/e2b-suite all
