#!/usr/bin/env bash
# Installs the system packages SPACE needs on Debian 12. Idempotent: every step checks first.
set -euo pipefail

need_update=0
apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$need_update" -eq 0 ]; then apt-get update -qq; need_update=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# gVisor: trixie's runsc (2024-07 build) is ~70x faster than bookworm's under systrap and supports
# checkpoint --leave-running. Pin trixie at 100 so that only packages we ask for come from it.
if ! [ -f /etc/apt/sources.list.d/space-trixie.sources ]; then
  cat > /etc/apt/sources.list.d/space-trixie.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  cat > /etc/apt/preferences.d/space-trixie <<'PIN'
Package: *
Pin: release n=trixie
Pin-Priority: 100
PIN
  need_update=0
fi

apt_install btrfs-progs debootstrap iproute2 util-linux python3-venv ca-certificates \
  postgresql zstd procps gcc libc6-dev nftables acl publicsuffix
# Templates from container images: skopeo pulls by digest, umoci unpacks; the tests push images to a
# registry of their own on loopback (docker-registry) and build them with buildah.
apt_install skopeo umoci docker-registry buildah
# The package's own registry service would listen on :5000 of every interface: only tests run one,
# on loopback, with their own configuration.
if [ -d /run/systemd/system ]; then systemctl disable --now docker-registry >/dev/null 2>&1 || true; fi
# (The version is captured first: `runsc --version | grep -q` under pipefail fails whenever grep
# exits before runsc has written everything, which reinstalled runsc or ended this script early.)
runsc_version="$(runsc --version 2>/dev/null || true)"
if ! command -v runsc >/dev/null 2>&1 || [[ "$runsc_version" != *2024* ]]; then
  if [ "$need_update" -eq 0 ]; then apt-get update -qq; need_update=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -t trixie runsc
  runsc_version="$(runsc --version)"
fi
echo "${runsc_version%%$'\n'*}"
# kubectl renders the Kubernetes manifests (kustomize, offline) for their tests: trixie's (1.32; it needs
# only libc6 >= 2.34, which bookworm has).
if ! command -v kubectl >/dev/null 2>&1; then
  if [ "$need_update" -eq 0 ]; then apt-get update -qq; need_update=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -t trixie kubectl
fi

# `space serve` runs its API and controller as this system user once its node agent (root) is up.
if ! getent passwd space >/dev/null; then
  useradd --system --user-group --no-create-home --shell /usr/sbin/nologin space
fi
# The node's egress gateway (it parses sandbox traffic and holds their secrets) runs as this one.
if ! getent passwd space-gw >/dev/null; then
  useradd --system --user-group --no-create-home --shell /usr/sbin/nologin space-gw
fi
# The node agent drops to its own user once its root helper runs; group `space` lets it pass through
# the data dir (0710 root:space) and share the object store with the API.
if ! getent passwd space-node >/dev/null; then
  useradd --system --user-group --no-create-home --shell /usr/sbin/nologin --groups space space-node
fi
if ! id -nG space-node | tr ' ' '\n' | grep -qx space; then
  usermod --append --groups space space-node
fi
