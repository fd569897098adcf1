#!/usr/bin/env bash
# make images: the `space` image (API, controller, migration) and the `space-node` image (node agent,
# root helper, runsc, btrfs-progs, nftables, the egress gateway's venv), built with Debian's buildah
# from scratch: a debootstrap'd Debian root, packages from Debian and PyPI, no base image pulled from
# any registry. Tagged VERSION and VERSION-COMMIT; each written as an OCI archive beside its SBOM
# (the Debian packages and the Python distributions in it) under build/images/.
#
#   sudo deploy/images/build.sh            (as root: debootstrap, chroot and buildah need it)
#
# Reproducible from the checkout: the same commit gives the same Python distributions (the wheels
# this checkout resolves), the same Debian suite and package set (their versions are the mirror's of
# that day, listed in the SBOM), and file times clamped to the commit's (SOURCE_DATE_EPOCH).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)

[ "$(id -u)" -eq 0 ] || { echo "build.sh: run as root (debootstrap, chroot, buildah)" >&2; exit 2; }
version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
dist=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["name"])')
commit=$(git rev-parse --short=12 HEAD)
export SOURCE_DATE_EPOCH=$(git log -1 --format=%ct)
suite=bookworm
mirror=${SPACE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
out=$repo/build/images
work=$out/work
mkdir -p "$out" "$work"

say() { printf '%s [%4ss] %s\n' "$(date -u +%T)" "$SECONDS" "$*" >&2; }

if ! command -v buildah >/dev/null 2>&1; then
  say "installing buildah (Debian)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah >/dev/null
fi

# -- 1. the Python distributions: this checkout and everything it needs, as wheels ------------------
say "wheels: space $version and its dependencies"
rm -f "$work"/wheels/"${dist//-/_}"-*.whl
python3 -m pip wheel -q -w "$work/wheels" "$repo[kms-aws]"
python3 -m pip wheel -q -w "$work/gateway-wheels" -r "$repo/gateway-requirements.txt"
cp "$work"/wheels/"${dist//-/_}"-*.whl "$work/gateway-wheels/"

# -- 2. a minimal Debian root, once per package set -------------------------------------------------
base_pkgs="python3,python3-venv,ca-certificates"
base=$work/root-$suite-$(printf '%s' "$base_pkgs" | sha256sum | cut -c1-12)
if [ ! -x "$base/usr/bin/python3" ]; then
  say "debootstrap $suite (minbase + $base_pkgs)"
  rm -rf "$base.tmp"
  debootstrap --variant=minbase --include="$base_pkgs" "$suite" "$base.tmp" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
  mv "$base.tmp" "$base"
fi

in_root() {  # in_root ROOT CMD...: run CMD in ROOT with /proc and the wheels mounted
  local root=$1; shift
  mount -t proc proc "$root/proc"
  mkdir -p "$root/tmp/wheels"
  mount --bind "$work" "$root/tmp/wheels"
  local rc=0
  chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 "$@" || rc=$?
  umount "$root/tmp/wheels" "$root/proc"
  rmdir "$root/tmp/wheels"
  return $rc
}

fresh_root() {  # fresh_root NAME: a copy of the base root to build NAME in
  local root=$work/$1
  rm -rf "$root"
  cp -a "$base" "$root"
  echo "$root"
}

sbom() {  # sbom ROOT NAME: the Debian packages and the Python distributions in ROOT
  {
    echo "# $2 $version ($commit): Debian packages ($suite)"
    chroot "$1" dpkg-query -W -f '${Package}\t${Version}\n'
    for venv in "$1"/opt/space/.venv "$1"/opt/space/.venv-gateway; do
      [ -d "$venv" ] || continue
      echo "# Python distributions in ${venv#"$1"}"
      chroot "$1" "${venv#"$1"}/bin/python" -m pip list --format=freeze 2>/dev/null
    done
  } > "$out/$2.sbom.txt"
}

commit_image() {  # commit_image ROOT NAME USER ENTRYPOINT-JSON
  local root=$1 name=$2 user=$3 entrypoint=$4
  rm -rf "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root"/tmp/*
  find "$root" -newermt "@$SOURCE_DATE_EPOCH" -print0 2>/dev/null | xargs -0r touch -h -d "@$SOURCE_DATE_EPOCH"
  local ctr
  ctr=$(buildah from scratch)
  local mnt
  mnt=$(buildah mount "$ctr")
  cp -a "$root"/. "$mnt"/
  buildah umount "$ctr" >/dev/null
  buildah config --entrypoint "$entrypoint" --cmd '[]' --user "$user" --workingdir / \
    --env PATH=/opt/space/.venv/bin:/usr/sbin:/usr/bin:/sbin:/bin --env PYTHONDONTWRITEBYTECODE=1 \
    --label org.opencontainers.image.title="$name" --label org.opencontainers.image.version="$version" \
    --label org.opencontainers.image.revision="$commit" --label org.opencontainers.image.source="SPACE" \
    "$ctr"
  buildah commit -q --timestamp "$SOURCE_DATE_EPOCH" --rm "$ctr" "localhost/$name:$version" >/dev/null
  buildah tag "localhost/$name:$version" "localhost/$name:$version-$commit"
  rm -f "$out/$name.tar"
  buildah push -q "localhost/$name:$version" "oci-archive:$out/$name.tar:localhost/$name:$version"
  say "$name: localhost/$name:$version, :$version-$commit; $(du -h "$out/$name.tar" | cut -f1) in $out/$name.tar"
}

# -- 3. space: the control plane, non-root ----------------------------------------------------------
say "space: root"
root=$(fresh_root space)
in_root "$root" python3 -m venv /opt/space/.venv
in_root "$root" /opt/space/.venv/bin/pip install -q --no-index --find-links /tmp/wheels/wheels "$dist"
in_root "$root" groupadd --system --gid 10001 space
in_root "$root" useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
  --shell /usr/sbin/nologin space
sbom "$root" space
commit_image "$root" space 10001:10001 '["/opt/space/.venv/bin/space"]'

# -- 4. space-node: the node agent, root (it drops to space-node once its helper runs) ---------------
# Its Debian packages and users, once per package set (what changes with the checkout comes after).
node_pkgs="btrfs-progs nftables iproute2 util-linux mount zstd debootstrap procps acl publicsuffix kmod skopeo umoci"
node_base=$work/root-$suite-node-$(printf '%s|%s|runsc:trixie|users:2' "$base_pkgs" "$node_pkgs" | sha256sum | cut -c1-12)
if [ ! -x "$node_base/usr/bin/runsc" ]; then
  say "space-node: Debian packages ($node_pkgs; runsc from trixie)"
  rm -rf "$node_base.tmp"
  cp -a "$base" "$node_base.tmp"
  in_root "$node_base.tmp" apt-get update -qq
  in_root "$node_base.tmp" apt-get install -y -qq --no-install-recommends $node_pkgs >/dev/null
  # runsc from trixie (its 2024 build; RUNTIME_NOTES.md), pinned so that nothing else comes from trixie.
  cat > "$node_base.tmp/etc/apt/sources.list.d/trixie.sources" <<SRC
Types: deb
URIs: $mirror
Suites: trixie
Components: main
SRC
  printf 'Package: *\nPin: release n=trixie\nPin-Priority: 100\n' > "$node_base.tmp/etc/apt/preferences.d/trixie"
  in_root "$node_base.tmp" apt-get update -qq
  in_root "$node_base.tmp" apt-get install -y -qq --no-install-recommends -t trixie runsc >/dev/null
  # Fixed uids, outside the range distributions give their system users: with the host's PID
  # namespace (hostPID), the host sees these processes by uid, and must not take them for its own.
  in_root "$node_base.tmp" groupadd --system --gid 10001 space
  in_root "$node_base.tmp" useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin space
  in_root "$node_base.tmp" groupadd --system --gid 10002 space-node
  in_root "$node_base.tmp" useradd --system --uid 10002 --gid 10002 --groups space --no-create-home \
    --home-dir /nonexistent --shell /usr/sbin/nologin space-node
  in_root "$node_base.tmp" groupadd --system --gid 10003 space-gw
  in_root "$node_base.tmp" useradd --system --uid 10003 --gid 10003 --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin space-gw
  rm -rf "$node_base"
  mv "$node_base.tmp" "$node_base"
fi
say "space-node: root"
root=$work/space-node
rm -rf "$root"
cp -a "$node_base" "$root"
in_root "$root" python3 -m venv /opt/space/.venv
# With AWS KMS for tenants' own keys: nodes wrap and unwrap their snapshots' data keys.
in_root "$root" /opt/space/.venv/bin/pip install -q --no-index --find-links /tmp/wheels/wheels "$dist[kms-aws]"
in_root "$root" python3 -m venv /opt/space/.venv-gateway
cp "$repo/gateway-requirements.txt" "$work/gateway-requirements.txt"
in_root "$root" /opt/space/.venv-gateway/bin/pip install -q --no-index --find-links /tmp/wheels/gateway-wheels \
  -r /tmp/wheels/gateway-requirements.txt
in_root "$root" /opt/space/.venv-gateway/bin/pip install -q --no-index --no-deps --find-links /tmp/wheels/wheels "$dist"
# The guest daemon's exec wrapper, static, built here (no compiler in the image); then compiled and
# stamped in place (space node prepare-guest keeps a space-spawn it finds).
guest=$(in_root "$root" /opt/space/.venv/bin/python -c 'import space.guest, os; print(os.path.dirname(space.guest.__file__))')
gcc -O2 -static -o "$root$guest/space-spawn" "$repo/space/guest/spawn.c"
in_root "$root" /opt/space/.venv/bin/space node prepare-guest >/dev/null
sbom "$root" space-node
commit_image "$root" space-node 0:0 '["/opt/space/.venv/bin/space"]'
say "done: $out/space.tar, $out/space-node.tar (+ .sbom.txt)"
