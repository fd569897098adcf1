#!/usr/bin/env bash
# SPACE runs parts of itself as system users: the API as `space` (after its root node agent is up),
# the egress gateway as `space-gw`. Each must be able to reach the Python it runs on and this
# checkout: on hosts where the interpreter lives under a private home (pyenv in /root, mode 0700),
# grant it traverse (x) only, as a named ACL entry, on exactly the directories in the way.
# Idempotent; a user that does not exist is skipped.
#   service-user-access.sh PYTHON             the `space` user, that interpreter
#   service-user-access.sh USER PYTHON ...    each USER with the PYTHON after it
set -euo pipefail
[ $# -eq 1 ] && set -- space "$1"
[ $# -ge 2 ] && [ $(($# % 2)) -eq 0 ] || { echo "usage: $0 [USER] PYTHON [USER PYTHON]..." >&2; exit 2; }
command -v setfacl >/dev/null || { echo "setfacl missing: apt-get install acl" >&2; exit 1; }
grant() {
  local user="$1" python="$2" t d
  getent passwd "$user" >/dev/null || return 0
  # The interpreter (a venv's is a link: both it and its target), its stdlib, and this checkout.
  local targets=("$(readlink -f "$python")" "$(readlink -f "$(dirname "$python")")"
                 "$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" "$(pwd)")
  for t in "${targets[@]}"; do
    d="$t"
    [ -d "$d" ] || d="$(dirname "$d")"
    local chain=()
    while [ "$d" != "/" ]; do chain=("$d" "${chain[@]}"); d="$(dirname "$d")"; done
    # From the top down: below a directory it cannot pass, every test fails, needed or not.
    for d in "${chain[@]}"; do
      if ! runuser -u "$user" -- test -x "$d" 2>/dev/null; then
        setfacl -m "u:$user:x" "$d"
        echo "granted the $user user traverse on $d"
      fi
    done
  done
}
while [ $# -gt 0 ]; do
  grant "$1" "$2"
  shift 2
done
