#!/usr/bin/env bash
# Build the vitpod image with docker, import it once with enroot into a squashfs on shared
# storage (under a lock, verified with unsquashfs, then renamed into place), and record its
# path and sha256 digest in containers/image.json, which `make render` copies into manifests.
#
#   make container IMAGE=/lustre/fsw/vitpod/images/vitpod.sqsh
#   DRY_RUN=1 bash containers/build.sh     # print the commands only
# IMAGE defaults to the container image of profile $CLUSTER (or dgxpod's if it has none).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
cd "$REPO"
PY=$REPO/.venv/bin/python
[ -x "$PY" ] || PY=python3
RECORD=${IMAGE_RECORD:-$HERE/image.json}

die() { echo "container: error: $*" >&2; exit 1; }
run() { echo "+ $*" >&2; [ -n "${DRY_RUN:-}" ] || "$@"; }

if [ -z "${IMAGE:-}" ]; then
  IMAGE=$("$PY" - "${CLUSTER:-dgxpod}" <<'PYEOF'
import sys
from workflows.profile import load_profile
profile = load_profile(sys.argv[1])
print((profile.container or load_profile("dgxpod").container).image)
PYEOF
)
fi
case "$IMAGE" in
  /*.sqsh | ./*.sqsh) ;;
  *) die "IMAGE=$IMAGE must be a .sqsh path starting with / or ./ (pyxis needs that)" ;;
esac
NGC_TAG=$(sed -n 's/^ARG NGC_TAG=//p' "$HERE/Dockerfile")
TAG="vitpod:$(git rev-parse --short HEAD 2>/dev/null || echo dev)-$NGC_TAG"

if [ -z "${DRY_RUN:-}" ]; then
  for tool in docker enroot flock unsquashfs sha256sum; do
    command -v "$tool" >/dev/null || die "$tool not found (build on a machine with docker and enroot)"
  done
fi

run docker build -f "$HERE/Dockerfile" -t "$TAG" "$REPO"
image_id=dry-run
if [ -z "${DRY_RUN:-}" ]; then
  image_id=$(docker image inspect --format '{{.Id}}' "$TAG")
fi

run mkdir -p "$(dirname "$IMAGE")"
echo "+ flock $IMAGE.lock (one import at a time on shared storage)" >&2
if [ -z "${DRY_RUN:-}" ]; then
  exec 9>"$IMAGE.lock"
  flock -w 7200 9 || die "timed out waiting for $IMAGE.lock"
fi
if [ -s "$IMAGE" ] && [ "$(cat "$IMAGE.source" 2>/dev/null)" = "$image_id" ]; then
  echo "container: $IMAGE already holds $TAG ($image_id)" >&2
else
  tmp="$IMAGE.importing.$$"
  trap 'rm -f "$tmp"' EXIT
  run rm -f "$tmp"
  run enroot import --output "$tmp" "dockerd://$TAG"
  echo "+ unsquashfs -l $tmp >/dev/null" >&2
  if [ -z "${DRY_RUN:-}" ] && ! unsquashfs -l "$tmp" >/dev/null 2>&1; then
    die "enroot produced an unreadable squashfs; $IMAGE left unchanged"
  fi
  run mv -f "$tmp" "$IMAGE"
  [ -n "${DRY_RUN:-}" ] || echo "$image_id" >"$IMAGE.source"
fi

echo "+ sha256sum $IMAGE > $RECORD" >&2
[ -z "${DRY_RUN:-}" ] || exit 0
digest=$(sha256sum "$IMAGE" | cut -d' ' -f1)
"$PY" - "$RECORD" "$IMAGE" "$digest" "$TAG" "$image_id" <<'PYEOF'
import datetime, json, os, sys
record, path, digest, tag, image_id = sys.argv[1:]
data = {"path": path, "sha256": digest, "tag": tag, "docker_id": image_id,
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
with open(record + ".tmp", "w") as f:
    json.dump(data, f, indent=2)
    f.flush()
    os.fsync(f.fileno())
os.replace(record + ".tmp", record)
PYEOF
echo "container: $IMAGE sha256:$digest (recorded in $RECORD)"
