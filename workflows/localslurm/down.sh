#!/usr/bin/env bash
# Stop the local Slurm started by up.sh, and cluster 2 when cluster2.sh started it (idempotent);
# state under .slurm/ is kept for the next up.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
STATE=${VITPOD_SLURM_STATE:-$REPO/.slurm}
STATE2=${VITPOD_SLURM_STATE2:-$STATE/cluster2}

[ "$(id -u)" = 0 ] || { echo "slurm-down: error: must run as root" >&2; exit 1; }

# Stop the daemon whose pid file is $1 and wait until it is gone.
stop() {
  local pidfile=$1 pid
  [ -s "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    echo "slurm-down: stopping $(basename "$pidfile" .pid) ($pid)" >&2
    kill "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$pidfile"
}

bash "$HERE/registry.sh" stop
for f in "$STATE2"/run/slurmd-*.pid; do stop "$f"; done  # cluster 2 first: it uses slurmdbd
stop "$STATE2/run/slurmctld.pid"
for f in "$STATE"/run/slurmd-*.pid; do stop "$f"; done
stop "$STATE/run/slurmctld.pid"
stop "$STATE/run/slurmdbd.pid"
stop "$STATE/run/mariadbd.pid"
stop /run/munge/munged.pid
echo "slurm-down: stopped" >&2
