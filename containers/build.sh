#!/usr/bin/env bash
# `make container`: build the vitpod image with a private dockerd, import it once with enroot
# into the profile's .sqsh (under a lock; verified with `unsquashfs -l`; renamed into place) and
# record its digest beside it (IMAGE.json). The last line printed is the .sqsh path.
#
#   make container                          # CLUSTER's image (localpyxis's when it has none)
#   make container CLUSTER=dgxpod           # NGC base, training stack in the image
#   make container IMAGE=/shared/images/vitpod.sqsh
#   make container CLUSTER=localregistry PUSH=1   # push to the profile's registry (push.sh)
#
# A profile whose image is a registry reference (USER@REGISTRY#REPO[:TAG|@sha256:..]) is built
# and pushed instead (PUSH=1): no .sqsh; the last line is USER@REGISTRY#REPO@sha256:<manifest
# digest>, recorded in .cache/images/<profile>.pushed.json.
#
# The image's digest is the sha256 of its inputs (base, Dockerfile, target, build arguments,
# copied files, interpreter); it is baked into the image as /etc/vitpod-image.json with the
# git commit and build time. Unchanged inputs are not rebuilt: the .sqsh is reused.
# The dockerd is the project's own (data-root, exec-root and socket under VITPOD_CACHE, no
# iptables, no bridge), started for the build and stopped afterwards; never the host's.
# Registries are not needed for the local (venv) image: its base is made from Debian packages.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
cd "$REPO"
PY=$REPO/.venv/bin/python
[ -x "$PY" ] || PY=python3
CACHE=${VITPOD_CACHE:-$REPO/.cache}/container
RUNTIME_PREFIX=${VITPOD_RUNTIME_PREFIX:-$REPO/.runtime}
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_PACKAGES=python3,numactl
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1700000000}  # reproducible base tarballs
export SOURCE_DATE_EPOCH

die() { echo "container: error: $*" >&2; exit 1; }
log() { echo "container: $*" >&2; }
sha() { sha256sum | cut -d' ' -f1; }

# ---- what to build: the profile's image path, its stack, and (venv) the environment's python
read -r IMAGE_DEFAULT STACK VENV_PY PROFILE_NAME PUSH_REF PUSH_BASE PUSH_VAR < <("$PY" - "${CLUSTER:-local}" <<'PYEOF'
import sys
from pathlib import Path
from vitpod.workflows.site.profile import load_profile
from vitpod.workflows.containers.container import host_path, sqsh_path
from vitpod.workflows.containers.registryref import parse
profile = load_profile(sys.argv[1])
if profile.container is None:
    profile = load_profile("localpyxis")
c = profile.container
venv = Path(host_path(str(Path(c.python).parent))).parent if c.stack == "venv" else "-"
ref = parse(c.image)
push = ["-", "-", "-"]
if ref is not None:
    tag = ref.tag or "latest"
    base = f"{ref.user}@{ref.registry}#{ref.repository}" if ref.user else "-"
    var = c.credentials.password if c.credentials else "-"
    push = [f"{ref.registry}/{ref.repository}:{tag}", base, var]
print(sqsh_path(c.image) or "-", c.stack, venv, profile.name, *push)
PYEOF
) || die "cannot read profile ${CLUSTER:-local}"
if [ "$PUSH_REF" != - ]; then
  [ "${PUSH:-}" = 1 ] || die "profile $PROFILE_NAME's image is a registry reference: build and push it with PUSH=1"
  if [ "$PUSH_BASE" = - ] || [ "$PUSH_VAR" = - ]; then
    die "profile $PROFILE_NAME: PUSH=1 needs USER@ in container.image and container.credentials"
  fi
  IMAGE=$REPO/.cache/images/$PROFILE_NAME.pushed  # the lock and record name only (.json)
elif [ "${PUSH:-}" = 1 ]; then
  die "PUSH=1: profile $PROFILE_NAME's image is a .sqsh file; name a registry image (USER@REGISTRY#REPO) in its container.image"
fi
IMAGE=${IMAGE:-$IMAGE_DEFAULT}
[ "$PUSH_REF" != - ] || case "$IMAGE" in
  /*.sqsh) ;;
  ./*.sqsh) IMAGE=$REPO/${IMAGE#./} ;;
  *) die "IMAGE=$IMAGE must be a .sqsh path starting with / or ./ (pyxis reads only those as files)" ;;
esac
case "$STACK" in image | venv) ;; *) die "unknown stack $STACK" ;; esac

export PATH="$RUNTIME_PREFIX/bin:/usr/sbin:/usr/bin:$PATH"  # Debian's docker CLI, our enroot
for tool in dockerd docker enroot flock unsquashfs sha256sum; do
  command -v "$tool" >/dev/null || die "$tool not found; run 'make setup' (docker.io, enroot from the vendored sources)"
done
mkdir -p "$CACHE" "$(dirname "$IMAGE")"
WORK=$(mktemp -d "$CACHE/build.XXXXXX")
DOCKERD_PID=""
cleanup() {
  if [ -n "$DOCKERD_PID" ]; then
    kill -TERM "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -rf "$WORK" "$IMAGE.importing.$$"
}
trap cleanup EXIT

# ---- the inputs that decide the image, and their digest
CTX=$WORK/context
mkdir -p "$CTX/python" "$CTX/code"
BASE_REF=""
BASE_ID=""
INTERP="-"
if [ "$STACK" = venv ]; then
  cfg=$VENV_PY/pyvenv.cfg
  [ -f "$cfg" ] || die "$VENV_PY is not a virtual environment (no pyvenv.cfg); run 'make setup'"
  home=$(sed -n 's/^home *= *//p' "$cfg")
  INTERP=$(dirname "$home")
  if [ "$INTERP" != /usr ]; then
    # The interpreter without its tests, static library and site-packages (the venv has its own).
    ver=$(sed -n 's/^version *= *\([0-9]*\.[0-9]*\).*/\1/p' "$cfg")
    tar -C / -cf - --exclude="lib/python$ver/test" --exclude="lib/python$ver/site-packages/*" \
      --exclude="lib/python$ver/config-*" --exclude='*.a' --exclude="lib/python$ver/idlelib" \
      --exclude="lib/python$ver/tkinter" "${INTERP#/}" | tar -C "$CTX/python" -xf -
  fi
  BASE_KEY=$(printf '%s\n' "$DEBIAN_SUITE" "$DEBIAN_MIRROR" "$DEBIAN_PACKAGES" "$SOURCE_DATE_EPOCH" | sha)
  BASE_TAR=$CACHE/debian-$DEBIAN_SUITE-${BASE_KEY:0:16}.tar
  BASE_REF="vitpod-base:${BASE_KEY:0:16}"
  if [ ! -s "$BASE_TAR.sha256" ]; then
    command -v mmdebstrap >/dev/null || die "mmdebstrap not found; run 'make setup'"
    log "making the Debian $DEBIAN_SUITE base ($DEBIAN_PACKAGES) with mmdebstrap"
    rm -rf "$BASE_TAR.tmp" "$BASE_TAR"
    # --format=tar: mmdebstrap picks the format from the name's extension otherwise, and
    # ".tmp" would make it write a directory.
    mmdebstrap --quiet --variant=minbase --format=tar --include="$DEBIAN_PACKAGES" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      "$DEBIAN_SUITE" "$BASE_TAR.tmp" "$DEBIAN_MIRROR" || die "mmdebstrap failed"
    mv -f "$BASE_TAR.tmp" "$BASE_TAR"
    digest=$(sha256sum "$BASE_TAR") || die "cannot read $BASE_TAR"
    echo "${digest%% *}" >"$BASE_TAR.sha256"
  fi
  BASE_ID="sha256:$(cat "$BASE_TAR.sha256")"
else
  BASE_REF=${BASE_IMAGE:-$(sed -n 's/^ARG BASE_IMAGE=//p' "$HERE/Dockerfile")}
  case "$BASE_REF" in *@sha256:*) ;; *) die "BASE_IMAGE=$BASE_REF: pin the base by digest (IMAGE@sha256:...)" ;; esac
  BASE_ID=${BASE_REF#*@}
  for f in pyproject.toml README.md constraints.txt; do cp "$f" "$CTX/code/"; done
  git ls-files -z vitpod workflows trainer analysis registry templates | tar --null -T - -cf - | tar -C "$CTX/code" -xf -
fi
tree_sha() { (cd "$1" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0r sha256sum | sha); }
"$PY" - "$WORK/inputs.json" "$BASE_REF" "$BASE_ID" "$(sha <"$HERE/Dockerfile")" "$STACK" \
  "$INTERP" "$(tree_sha "$CTX/python")" "$(tree_sha "$CTX/code")" <<'PYEOF'
import json, sys
out, base_ref, base_id, dockerfile, target, interp, interp_sha, code_sha = sys.argv[1:]
inputs = {
    "base": {"ref": base_ref, "id": base_id},
    "dockerfile_sha256": dockerfile,
    "target": target,
    "build_args": {"BASE_IMAGE": base_ref},
    "interpreter": {"path": interp, "sha256": interp_sha},
    "code_sha256": code_sha,
}
with open(out, "w") as f:
    json.dump(inputs, f, sort_keys=True, separators=(",", ":"))
PYEOF
DIGEST="sha256:$(sha <"$WORK/inputs.json")"
log "inputs digest $DIGEST (target $STACK, base $BASE_REF)"

# The pushed image's reference when the registry still has its manifest (authenticated HEAD;
# the password goes to curl through a pipe, never a file or its command line).
still_pushed() {
  local ref host
  ref=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["registry"]["ref"])' "$1" 2>/dev/null) || return 1
  host=${PUSH_REF%%/*}
  curl -sfI -o /dev/null --netrc-file <(printf 'machine %s login %s password %s\n' "${host%:*}" \
    "${PUSH_BASE%%@*}" "${!PUSH_VAR:-}") -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
    "https://$host/v2/$("$PY" -c 'import sys; print(sys.argv[1].split("/",1)[1].rsplit(":",1)[0])' "$PUSH_REF")/manifests/${ref##*@}" \
    || return 1
  echo "$ref"
}

# ---- one import at a time per .sqsh; a second run waits here, then reuses the first's import
exec 9>"$IMAGE.lock"
flock -w 3600 9 || die "timed out waiting for $IMAGE.lock"
recorded=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("digest",""))' "$IMAGE.json" 2>/dev/null || true)
if [ "$PUSH_REF" != - ] && [ "$recorded" = "$DIGEST" ] && pushed=$(still_pushed "$IMAGE.json"); then
  log "$PUSH_REF already holds $DIGEST (inputs unchanged): not rebuilt"
  echo "$pushed"
  exit 0
fi
if [ -s "$IMAGE" ] && [ "$recorded" = "$DIGEST" ] && unsquashfs -l "$IMAGE" >/dev/null 2>&1; then
  log "$IMAGE already holds $DIGEST (inputs unchanged): not rebuilt"
  echo "$IMAGE"
  exit 0
fi

# ---- the project's own dockerd (one at a time: they share the data-root)
DOCKER_DIR=$CACHE/docker
mkdir -p "$DOCKER_DIR/data" "$DOCKER_DIR/exec" "$DOCKER_DIR/run"
exec 8>"$DOCKER_DIR/lock"
flock -w 3600 8 || die "timed out waiting for $DOCKER_DIR/lock"
export DOCKER_HOST=unix://$DOCKER_DIR/run/docker.sock
log "starting a private dockerd ($DOCKER_DIR)"
setsid dockerd --iptables=false --ip-masq=false --bridge=none --data-root "$DOCKER_DIR/data" \
  --exec-root "$DOCKER_DIR/exec" --pidfile "$DOCKER_DIR/run/docker.pid" -H "$DOCKER_HOST" \
  </dev/null >"$DOCKER_DIR/dockerd.log" 2>&1 &
DOCKERD_PID=$!
for _ in $(seq 1 120); do docker version >/dev/null 2>&1 && break; sleep 0.5; done
docker version >/dev/null 2>&1 || die "dockerd did not start (see $DOCKER_DIR/dockerd.log)"

start=$SECONDS
if [ "$STACK" = venv ] && ! docker image inspect "$BASE_REF" >/dev/null 2>&1; then
  docker import -c 'CMD ["/bin/bash"]' "$BASE_TAR" "$BASE_REF" >/dev/null
fi
"$PY" - "$WORK/inputs.json" "$DIGEST" "$CTX/vitpod-image.json" <<'PYEOF'
import datetime, json, subprocess, sys
inputs = json.load(open(sys.argv[1]))
git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                       capture_output=True, text=True).stdout.strip()
record = {"digest": sys.argv[2], "inputs": inputs, "git": {"commit": git or None, "dirty": bool(dirty)},
          "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
json.dump(record, open(sys.argv[3], "w"), indent=2)
PYEOF
cp "$HERE/Dockerfile" "$CTX/Dockerfile"
TAG="vitpod:${DIGEST:7:16}"
log "docker build --target $STACK -t $TAG"
DOCKER_BUILDKIT=1 docker build --quiet --network=host --target "$STACK" \
  --build-arg "BASE_IMAGE=$BASE_REF" -t "$TAG" "$CTX" >/dev/null || die "docker build failed"

if [ "$PUSH_REF" != - ]; then
  PY=$PY bash "$HERE/push.sh" "$TAG" "$PUSH_REF" "$PUSH_BASE" "$PUSH_VAR" "$IMAGE.json" \
    "$CTX/vitpod-image.json"
  docker image rm "$TAG" >/dev/null 2>&1 || true
  exit 0
fi
tmp="$IMAGE.importing.$$"
log "enroot import dockerd://$TAG"
ENROOT_TEMP_PATH=$WORK enroot import --output "$tmp" "dockerd://$TAG" >"$WORK/import.log" 2>&1 \
  || { tail -20 "$WORK/import.log" >&2; die "enroot import failed; $IMAGE left unchanged"; }
unsquashfs -l "$tmp" >/dev/null 2>&1 || die "enroot produced an unreadable squashfs; $IMAGE left unchanged"
mv -f "$tmp" "$IMAGE"
chmod 0644 "$IMAGE"
docker image rm "$TAG" >/dev/null 2>&1 || true
"$PY" - "$IMAGE" "$CTX/vitpod-image.json" "$((SECONDS - start))" <<'PYEOF'
import hashlib, json, os, sys
path, provenance, seconds = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
h = hashlib.sha256()
with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
st = os.stat(path)
record = {**provenance, "sqsh": {"path": path, "sha256": h.hexdigest(), "bytes": st.st_size,
          "mtime_ns": st.st_mtime_ns}, "build_seconds": seconds}
with open(path + ".json.tmp", "w") as f:
    json.dump(record, f, indent=2)
os.replace(path + ".json.tmp", path + ".json")
PYEOF
log "built $IMAGE ($(du -h "$IMAGE" | cut -f1), $((SECONDS - start)) s after dockerd start); digest $DIGEST"
echo "$IMAGE"
