#!/usr/bin/env bash
# `make container PUSH=1` (called by build.sh with its private dockerd in DOCKER_HOST): push the
# built image to the profile's registry and record the manifest digest the registry gives it.
#
#   push.sh LOCAL_TAG DOCKER_REF PYXIS_BASE PASSWORD_VAR RECORD PROVENANCE
#
# DOCKER_REF is docker's REGISTRY/REPO:TAG, PYXIS_BASE pyxis's USER@REGISTRY#REPO; the password
# is read from the variable named PASSWORD_VAR and reaches docker on stdin only. docker login
# keeps it (base64) in a config.json: that lives in a private temporary DOCKER_CONFIG removed on
# exit. Prints PYXIS_BASE@sha256:<digest> as its last line; RECORD gets the same with the
# provenance (the image's own inputs digest, baked into /etc/vitpod-image.json).
set -euo pipefail

LOCAL_TAG=$1 DOCKER_REF=$2 PYXIS_BASE=$3 PASSWORD_VAR=$4 RECORD=$5 PROVENANCE=$6
REGISTRY=${DOCKER_REF%%/*}
USER_NAME=${PYXIS_BASE%%@*}
PY=${PY:-python3}

die() { echo "container: error: $*" >&2; exit 1; }
log() { echo "container: $*" >&2; }

[ -n "${!PASSWORD_VAR:-}" ] || die "\$$PASSWORD_VAR is not set; export it (local registry: source .slurm/registry.env)"
DOCKER_CONFIG=$(mktemp -d)
export DOCKER_CONFIG
trap 'rm -rf "$DOCKER_CONFIG"' EXIT
printenv "$PASSWORD_VAR" | docker login -u "$USER_NAME" --password-stdin "$REGISTRY" >/dev/null 2>&1 \
  || die "docker login to $REGISTRY as $USER_NAME failed (wrong \$$PASSWORD_VAR, or the registry is down: make slurm-up)"
docker tag "$LOCAL_TAG" "$DOCKER_REF"
log "docker push $DOCKER_REF"
out=$(docker push "$DOCKER_REF" 2>&1) || { echo "$out" | tail -5 >&2; die "docker push $DOCKER_REF failed"; }
digest=$(grep -o 'digest: sha256:[0-9a-f]\{64\}' <<<"$out" | tail -1 | cut -d' ' -f2)
[ -n "$digest" ] || die "docker push printed no digest for $DOCKER_REF"
docker logout "$REGISTRY" >/dev/null 2>&1 || true
docker image rm "$DOCKER_REF" >/dev/null 2>&1 || true
"$PY" - "$RECORD" "$PROVENANCE" "$PYXIS_BASE@$digest" "$DOCKER_REF" "$digest" <<'PYEOF'
import datetime, json, os, sys
record_path, provenance, ref, tag, digest = sys.argv[1:]
record = {**json.load(open(provenance)), "registry": {"ref": ref, "tag": tag,
          "manifest_digest": digest, "pushed": datetime.datetime.now(
          datetime.timezone.utc).isoformat(timespec="seconds")}}
with open(record_path + ".tmp", "w") as f:
    json.dump(record, f, indent=2)
os.replace(record_path + ".tmp", record_path)
PYEOF
log "pushed $DOCKER_REF as $digest"
echo "$PYXIS_BASE@$digest"
