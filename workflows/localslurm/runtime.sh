#!/usr/bin/env bash
# Build the container runtime of the local test Slurm: NVIDIA pyxis (a Slurm SPANK plugin) and
# NVIDIA enroot, from the unmodified upstream tarballs in the vendor directory, into a
# project-owned prefix; then write enroot's configuration. Idempotent: an unchanged vendor
# directory is not rebuilt. Called by scripts/setup.sh and workflows/localslurm/up.sh.
#
#   VITPOD_VENDOR=DIR        where the tarballs and SHA256SUMS are (default: ../shared/vendor
#                            beside the repository, or beside the main checkout of a worktree)
#   VITPOD_RUNTIME_PREFIX=P  install prefix (default: <repo>/.runtime)
#   VITPOD_ENROOT_SCRATCH=D  where containers are extracted (default: /dev/shm when it has room)
#
# Exit status 0 with "runtime: ready PREFIX" as the last line; 3 with the reason when the
# vendored sources are absent (everything else still works, container tests skip); 1 on error.
# Build steps follow the pyxis README (make && make install with prefix=) and enroot's
# doc/installation.md (the prefix is also written into the enroot script at build time).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PREFIX=${VITPOD_RUNTIME_PREFIX:-$REPO/.runtime}
PYXIS=pyxis-0.24.0
ENROOT=enroot-4.1.2
ENROOT_DEPS=(musl linux-headers makeself)

log() { echo "runtime: $*" >&2; }
die() { echo "runtime: error: $*" >&2; exit 1; }

vendor_dir() {
  if [ -n "${VITPOD_VENDOR:-}" ]; then echo "$VITPOD_VENDOR"; return; fi
  local common
  for candidate in "$REPO/../shared/vendor" \
    "$(common=$(git -C "$REPO" rev-parse --path-format=absolute --git-common-dir 2>/dev/null) \
       && dirname "$(dirname "$common")")/shared/vendor"; do
    [ -d "$candidate" ] && { (cd "$candidate" && pwd); return; }
  done
  echo "$REPO/../shared/vendor"
}
VENDOR=$(vendor_dir)

if [ ! -f "$VENDOR/$PYXIS.tar.gz" ] || [ ! -f "$VENDOR/$ENROOT.tar.gz" ]; then
  echo "runtime: pyxis/enroot sources not found in $VENDOR ($PYXIS.tar.gz, $ENROOT.tar.gz);" \
    "set VITPOD_VENDOR=DIR to build them. The local Slurm runs without containers." >&2
  exit 3
fi
(cd "$VENDOR" && sha256sum --quiet -c SHA256SUMS) \
  || die "$VENDOR: SHA256SUMS does not match; refusing to build altered sources"

STAMP=$PREFIX/.vendor-sha256
want=$(cd "$VENDOR" && sha256sum "$PYXIS.tar.gz" "$ENROOT.tar.gz" enroot-dep-*.tar.gz | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ] \
  || [ ! -f "$PREFIX/lib/slurm/spank_pyxis.so" ] || [ ! -x "$PREFIX/bin/enroot" ]; then
  for tool in make cc unsquashfs mksquashfs jq; do
    command -v "$tool" >/dev/null || die "$tool not found; run 'make setup' (Debian packages)"
  done
  [ -f /usr/include/slurm/spank.h ] || die "slurm/spank.h not found; install libslurm-dev"
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
  log "building $PYXIS and $ENROOT from $VENDOR into $PREFIX"
  start=$SECONDS
  tar -xzf "$VENDOR/$PYXIS.tar.gz" -C "$build"
  tar -xzf "$VENDOR/$ENROOT.tar.gz" -C "$build"
  for dep in "${ENROOT_DEPS[@]}"; do
    tar -xzf "$VENDOR/enroot-dep-$dep.tar.gz" -C "$build/$ENROOT/deps"
  done
  jobs=$(nproc)
  if ! { make -s -C "$build/$PYXIS" -j"$jobs" && make -s -C "$build/$PYXIS" install prefix="$PREFIX"; } \
    >"$build/pyxis.log" 2>&1; then
    tail -20 "$build/pyxis.log" >&2
    die "pyxis build failed"
  fi
  if ! { make -C "$build/$ENROOT" -j"$jobs" prefix="$PREFIX" && make -C "$build/$ENROOT" install prefix="$PREFIX"; } \
    >"$build/enroot.log" 2>&1; then
    tail -20 "$build/enroot.log" >&2
    die "enroot build failed"
  fi
  echo "$want" >"$STAMP"
  log "built in $((SECONDS - start)) s"
fi

# enroot's paths: one directory per node and user under sticky, world-writable parents, so jobs
# run as root and as unprivileged users (the default /run/enroot is root-only). Every node of
# the local Slurm is this one host: up.sh gives each slurmd an `enroot` wrapper that sets
# VITPOD_ENROOT_NODE=<node>, so two nodes never extract a job's container into the same
# directory; outside Slurm it is "host". pyxis removes ENROOT_* from
# the job's environment, so the paths live in the configuration file (values are shell-expanded).
VAR=$PREFIX/var
# Every job start extracts its image (unsquashfs) into ENROOT_DATA_PATH on each node, and an
# import unpacks the image's layers under ENROOT_TEMP_PATH. On this host's ext4 disk one
# extraction of the 280 MB test image took 12-13 s of system CPU, on tmpfs 0.9 s (the suite
# extracts about 65), so $VAR/data and $VAR/tmp link to /dev/shm when it can be written and has
# 4 GiB free, as clusters keep containers on node-local fast storage; VITPOD_ENROOT_SCRATCH=DIR
# picks another place. pyxis removes a job's container when the job ends. Images are squashed
# uncompressed (enroot's default is `-comp lzo -noD`): lzo on the inodes and fragments of the
# test image took 21 s of CPU per import, none 1.2 s, for 245 MB instead of 173 MB.
mkdir -p "$VAR"
scratch=${VITPOD_ENROOT_SCRATCH:-}
shm_free_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
if [ -z "$scratch" ] && [ -w /dev/shm ] && [ "${shm_free_kb:-0}" -ge $((4 * 1024 * 1024)) ]; then
  scratch=/dev/shm/vitpod-enroot-$(printf %s "$PREFIX" | sha256sum | cut -c1-8)
fi
if [ -n "$scratch" ]; then
  mkdir -p "$scratch/data" "$scratch/tmp"  # made sticky and world-writable through the links below
  chmod 0755 "$scratch"
fi
for d in data tmp; do
  if [ -n "$scratch" ]; then
    if [ "$(readlink "$VAR/$d" 2>/dev/null)" != "$scratch/$d" ]; then
      rm -rf "${VAR:?}/$d"
      ln -s "$scratch/$d" "$VAR/$d"
    fi
  elif [ -L "$VAR/$d" ]; then
    rm -f "$VAR/$d"
  fi
done
mkdir -p "$VAR/run/host" "$VAR/data/host" "$VAR/cache/host" "$VAR/tmp"
chmod 1777 "$VAR/run" "$VAR/data" "$VAR/cache" "$VAR/tmp" "$VAR/run/host" "$VAR/data/host" "$VAR/cache/host"
chmod 0755 "$PREFIX" "$VAR"
conf=$PREFIX/etc/enroot/enroot.conf
tmp=$(mktemp "$conf.XXXX")
cat >"$tmp" <<EOF
# Written by workflows/localslurm/runtime.sh for the vitpod local test Slurm.
ENROOT_RUNTIME_PATH $VAR/run/\${VITPOD_ENROOT_NODE:-host}/user-\$(id -u)
ENROOT_DATA_PATH $VAR/data/\${VITPOD_ENROOT_NODE:-host}/user-\$(id -u)
ENROOT_CACHE_PATH $VAR/cache/\${VITPOD_ENROOT_NODE:-host}/user-\$(id -u)
ENROOT_TEMP_PATH $VAR/tmp
ENROOT_ROOTFS_WRITABLE yes
ENROOT_MOUNT_HOME no
ENROOT_SQUASH_OPTIONS -noI -noD -noF -noX -exit-on-error
EOF
chmod 0644 "$tmp"
mv -f "$tmp" "$conf"
echo "runtime: ready $PREFIX"
