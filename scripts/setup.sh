#!/usr/bin/env bash
# Install everything the demo and the tests need on a fresh Debian machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PIP=("$VENV/bin/pip" install --quiet -c constraints.txt)

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  # chromium: the report test renders report.html in a real headless browser. The second line:
  # the container runtime of the local Slurm (pyxis and enroot build from the vendored sources;
  # docker.io's private dockerd and mmdebstrap make the local image; docker-registry and
  # apache2-utils (htpasswd) the local authenticated registry).
  for p in slurmctld slurmd slurm-client slurmdbd munge mariadb-server shellcheck numactl squashfs-tools chromium \
    libslurm-dev build-essential libcap-dev jq parallel bsdmainutils pigz gawk zstd curl libcap2-bin \
    busybox-static docker.io mmdebstrap docker-registry apache2-utils ca-certificates openssl; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
  done
  if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet -U pip
"${PIP[@]}" torch torchvision
"${PIP[@]}" -e '.[train,analysis,dev]'
# DeepSpeed builds from its sdist against the torch above: no isolated build env.
"$VENV/bin/python" -c 'import deepspeed' 2>/dev/null || "${PIP[@]}" --no-build-isolation deepspeed
# pyxis + enroot for the local Slurm (exit 3: no vendored sources; containers are then skipped).
if [ "$(id -u)" = 0 ]; then
  rc=0
  bash workflows/localslurm/runtime.sh || rc=$?
  [ "$rc" = 0 ] || [ "$rc" = 3 ] || exit "$rc"
fi
echo "setup done: $VENV"
