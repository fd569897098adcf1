#!/usr/bin/env bash
# `space serve` runs its API as the `space` system user (after its root node agent is up). That
# user must be able to reach the Python it runs on and this checkout: on hosts where the
# interpreter lives under a private home (pyenv in /root, mode 0700), grant it traverse (x) only, as
# a named ACL entry, on exactly the directories in the way. Idempotent.
set -euo pipefail
python="${1:?usage: $0 PYTHON}"
getent passwd space >/dev/null || exit 0
command -v setfacl >/dev/null || { echo "setfacl missing: apt-get install acl" >&2; exit 1; }
targets=("$(readlink -f "$python")" "$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
         "$(pwd)")
for t in "${targets[@]}"; do
  d="$t"
  [ -d "$d" ] || d="$(dirname "$d")"
  while [ "$d" != "/" ]; do
    if ! runuser -u space -- test -x "$d" 2>/dev/null; then
      setfacl -m u:space:x "$d"
      echo "granted the space user traverse on $d"
    fi
    d="$(dirname "$d")"
  done
done
