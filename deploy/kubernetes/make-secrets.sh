#!/usr/bin/env bash
# Write a deployment's secrets as files under OVERLAY/secrets/ (git-ignored), which the overlay's
# secretGenerator turns into Secrets: the shared keys (space keys generate), the API's HTTPS
# certificate (space keys api-cert, from the cluster CA), the database URL, the first admin key, and,
# for kind, the in-cluster PostgreSQL and MinIO passwords. Refuses to overwrite an existing set.
#
#   deploy/kubernetes/make-secrets.sh deploy/kubernetes/overlays/kind
#   deploy/kubernetes/make-secrets.sh deploy/kubernetes/overlays/eks \
#       --database-url 'postgresql+asyncpg://space:PASSWORD@DB.rds.amazonaws.com:5432/space'
set -euo pipefail
overlay=${1:?usage: make-secrets.sh OVERLAY_DIR [--database-url URL] [--api-host NAME]...}
shift
database_url=""
api_hosts=(space-api.space.svc space-api.space.svc.cluster.local)
while [ $# -gt 0 ]; do
  case "$1" in
    --database-url) database_url=${2:?}; shift 2 ;;
    --api-host) api_hosts+=("${2:?}"); shift 2 ;;
    *) echo "make-secrets.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
space=${SPACE:-space}
out="$overlay/secrets"
if [ -e "$out" ]; then
  echo "make-secrets.sh: $out exists; remove it to make a new set (the old keys would be lost)" >&2
  exit 1
fi
umask 077
mkdir -p "$out"/{control,node,database,bootstrap,postgres}
keys=$(mktemp -d)
trap 'rm -rf "$keys"' EXIT
"$space" keys generate "$keys/k" >/dev/null 2>&1
host_args=()
for h in "${api_hosts[@]}"; do host_args+=(--host "$h"); done
"$space" keys api-cert "$keys/k" "${host_args[@]}" >/dev/null
cp "$keys"/k/{secret.key,master.key,cluster-ca.pem,cluster-ca.key,api.pem,api.key} "$out/control/"
cp "$keys"/k/{cluster-ca.pem,manifest.key,kek.key} "$keys"/k/egress-ca/{mitmproxy-ca.pem,mitmproxy-ca-cert.pem} "$out/node/"
random() { python3 -c 'import secrets; print(secrets.token_urlsafe(32), end="")'; }
random > "$out/postgres/password"
if [ -z "$database_url" ]; then
  # kind: the overlay's own PostgreSQL.
  database_url="postgresql+asyncpg://space:$(cat "$out/postgres/password")@space-postgres.space.svc:5432/space"
fi
printf '%s' "$database_url" > "$out/database/url"
printf 'sk_%s' "$(random)" > "$out/bootstrap/admin-key"
{
  echo "AWS_ACCESS_KEY_ID=space"
  echo "AWS_SECRET_ACCESS_KEY=$(random)"
} > "$out/object-store.env"
echo "$out: written (the first admin key is $out/bootstrap/admin-key)"
