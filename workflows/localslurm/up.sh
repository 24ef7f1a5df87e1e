#!/usr/bin/env bash
# Start a real two-node Slurm (with accounting) on this host; idempotent, run as root.
#
# Daemons: munged (user munge), mariadbd (127.0.0.1, own datadir), slurmdbd, slurmctld and
# one `slurmd -N nodeX` per node. All state lives under the repository's .slurm/ directory;
# the configuration is also copied to /etc/slurm so plain `sbatch` works in any shell.
# Containers: pyxis + enroot built by runtime.sh (from the vendored sources) are loaded through
# plugstack.conf into srun, sbatch and every slurmd; without the sources the cluster runs
# without them. Prints `export SLURM_CONF=...` as its last line.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=SCRIPTDIR/slurmconf.sh
. "$HERE/slurmconf.sh"
REPO=$(cd "$HERE/../.." && pwd)
STATE=${VITPOD_SLURM_STATE:-$REPO/.slurm}
CLUSTER=vitpod
NODES=(node1 node2)
DB_PORT=13306
DBD_PORT=16819
CTLD_PORT=16817
DB_PASS=vitpod-local-only
HOST=$(hostname -s)

log() { echo "slurm-up: $*" >&2; }
die() { echo "slurm-up: error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it starts munged, mariadbd and the Slurm daemons)"
for b in munged mariadbd slurmdbd slurmctld slurmd sacctmgr sinfo; do
  command -v "$b" >/dev/null || PATH=$PATH:/usr/sbin
  command -v "$b" >/dev/null || die "$b not found; run 'make setup' (installs Debian's slurm, munge, mariadb)"
done

mkdir -p "$STATE"/{etc,log,run,ctld,db,spool,dev} /etc/slurm
chmod 0755 "$STATE"

# Is the daemon whose pid file is $1 alive, and still that program (pids are reused)?
alive() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1")
  kill -0 "$pid" 2>/dev/null && grep -q "$2" "/proc/$pid/comm" 2>/dev/null
}

# Poll `$@` for up to $WAIT seconds (default 30).
wait_for() {
  local what=$1; shift
  for _ in $(seq 1 "${WAIT:-60}"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  die "timed out waiting for $what (logs under $STATE/log)"
}

# One local Slurm per host: its ports are fixed, so a second checkout's cluster cannot start.
if pgrep -x slurmctld >/dev/null && ! alive "$STATE/run/slurmctld.pid" slurmctld; then
  die "a Slurm controller not started from $STATE is running (another checkout's local Slurm?); \
stop it with 'make slurm-down' in that checkout, or point VITPOD_SLURM_STATE at its state dir"
fi

# --- container runtime: pyxis + enroot (runtime.sh says why when it cannot) ---
RUNTIME_PREFIX=${VITPOD_RUNTIME_PREFIX:-$REPO/.runtime}
PLUGSTACK_LINE=""
rt_rc=0
VITPOD_RUNTIME_PREFIX=$RUNTIME_PREFIX bash "$HERE/runtime.sh" >/dev/null || rt_rc=$?
case $rt_rc in
  0) # pyxis runs enroot through slurmstepd's PATH, inherited from slurmd (started below; of
     # slurmd's environment, slurmstepd keeps PATH but not other variables).
     # container_scope stays pyxis's default (global): with `job`, every job's epilog runs
     # `enroot list` with PATH=/usr/local/bin:/usr/bin:/bin (pyxis_slurmd.c), which cannot
     # find a project-prefix enroot, fails, and drains the node. Unnamed containers (all that
     # vitpod starts) are removed at the end of their step either way.
     export PATH="$RUNTIME_PREFIX/bin:$PATH"
     PLUGSTACK_LINE="required $RUNTIME_PREFIX/lib/slurm/spank_pyxis.so runtime_path=$RUNTIME_PREFIX/var/pyxis"
     mkdir -p "$RUNTIME_PREFIX/var/pyxis"
     # All nodes are this host: each slurmd finds, first on its PATH, an `enroot` that names
     # its node, so enroot's per-node directories (runtime.sh) keep two nodes from extracting
     # one job's container into the same place.
     for n in "${NODES[@]}"; do
       for d in run data cache; do
         mkdir -p "$RUNTIME_PREFIX/var/$d/$n" && chmod 1777 "$RUNTIME_PREFIX/var/$d/$n"
       done
       mkdir -p "$RUNTIME_PREFIX/var/nodes/$n/bin"
       printf '#!/bin/sh\nVITPOD_ENROOT_NODE=%s exec %s "$@"\n' "$n" "$RUNTIME_PREFIX/bin/enroot" \
         >"$RUNTIME_PREFIX/var/nodes/$n/bin/enroot"
       chmod 0755 "$RUNTIME_PREFIX/var/nodes/$n/bin/enroot"
     done
     # Job steps (not pyxis) find enroot on the job's PATH, as on a site's nodes: a job removes
     # its named container with `enroot remove` (container.start_once). The node is the step's.
     # shellcheck disable=SC2016  # expanded by the wrapper, at each call
     printf '#!/bin/sh\nVITPOD_ENROOT_NODE=${SLURMD_NODENAME:-host} exec %s "$@"\n' \
       "$RUNTIME_PREFIX/bin/enroot" >/usr/local/bin/enroot.tmp
     chmod 0755 /usr/local/bin/enroot.tmp && mv -f /usr/local/bin/enroot.tmp /usr/local/bin/enroot ;;
  3) log "no pyxis/enroot: container jobs are not available on this cluster" ;;
  *) die "building pyxis/enroot failed (see above)" ;;
esac

CHANGED=()
write_if_changed() {  # write stdin to $1 only when the content differs; mode $2
  local tmp
  tmp=$(mktemp "$1.XXXX")
  cat >"$tmp"
  chmod "$2" "$tmp"
  if [ -f "$1" ] && cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv -f "$tmp" "$1"; CHANGED+=("$1"); fi
}

# --- host names: node1/node2 resolve to this host (MASTER_ADDR is a node name) ---
for n in "${NODES[@]}"; do
  grep -qE "^[^#]*[[:space:]]$n([[:space:]]|$)" /etc/hosts || echo "127.0.0.1 $n" >>/etc/hosts
done

# --- munge ---
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key; }
  runuser -u munge -- /usr/sbin/munged
  wait_for munged bash -c 'munge -n | unmunge'
fi

# --- MariaDB (own datadir, loopback only) ---
DB_SOCK=$STATE/run/mysqld.sock
if ! alive "$STATE/run/mariadbd.pid" mariadbd; then
  if [ ! -d "$STATE/db/mysql" ]; then
    log "initialising MariaDB in $STATE/db"
    mariadb-install-db --user=root --datadir="$STATE/db" --auth-root-authentication-method=socket \
      --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1
  fi
  log "starting mariadbd on 127.0.0.1:$DB_PORT"
  setsid mariadbd --user=root --datadir="$STATE/db" --bind-address=127.0.0.1 --port=$DB_PORT \
    --socket="$DB_SOCK" --pid-file="$STATE/run/mariadbd.pid" --skip-name-resolve \
    --innodb-buffer-pool-size=64M --log-error="$STATE/log/mariadbd.log" </dev/null >/dev/null 2>&1 &
  WAIT=120 wait_for mariadbd mariadb-admin --socket="$DB_SOCK" ping
fi
mariadb --socket="$DB_SOCK" -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"

# --- configuration ---
write_if_changed "$STATE/etc/slurmdbd.conf" 0600 <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF

write_if_changed "$STATE/etc/slurm.conf" 0644 <<EOF
# vitpod local test cluster (generated by workflows/localslurm/up.sh)
$(slurm_conf_common)
NodeName=node[1-2] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=8 RealMemory=4000 Gres=gpu:2 State=UNKNOWN
PartitionName=pretrain Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=finetune Nodes=node[1-2] MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

# Fake GPUs for gres accounting only: gres/gpu needs one device file per GPU.
mkdir -p "$STATE/dev" && touch "$STATE/dev/gpu0" "$STATE/dev/gpu1"
write_if_changed "$STATE/etc/gres.conf" 0644 <<EOF
NodeName=node[1-2] Name=gpu File=$STATE/dev/gpu[0-1]
EOF

# SPANK plugins (pyxis); srun/sbatch and each slurmstepd read this file at every job and step.
write_if_changed "$STATE/etc/plugstack.conf" 0644 <<EOF
# vitpod local test cluster (generated by workflows/localslurm/up.sh)
$PLUGSTACK_LINE
EOF

for f in slurm.conf gres.conf plugstack.conf; do
  cmp -s "$STATE/etc/$f" "/etc/slurm/$f" 2>/dev/null || cp "$STATE/etc/$f" "/etc/slurm/$f"
done
export SLURM_CONF=$STATE/etc/slurm.conf

# --- slurmdbd + cluster registration ---
if ! alive "$STATE/run/slurmdbd.pid" slurmdbd; then
  log "starting slurmdbd"
  slurmdbd  # reads slurmdbd.conf beside $SLURM_CONF
  wait_for slurmdbd sacctmgr -n list cluster
fi
sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" \
  || sacctmgr -i add cluster "$CLUSTER" >/dev/null

# --- slurmctld, slurmd per node ---
if ! alive "$STATE/run/slurmctld.pid" slurmctld; then
  log "starting slurmctld"
  slurmctld -f "$SLURM_CONF"
  wait_for slurmctld scontrol ping
elif [ ${#CHANGED[@]} -gt 0 ]; then
  log "configuration changed (${CHANGED[*]}): scontrol reconfigure"
  scontrol reconfigure
fi
# Was the running slurmd started without its node's enroot first on its PATH (before the
# runtime was built)? Its job steps then could not run containers: restart it (running steps
# are unaffected).
slurmd_env_stale() {
  [ -n "$PLUGSTACK_LINE" ] || return 1
  local env
  env=$(tr '\0' '\n' <"/proc/$(cat "$1")/environ" 2>/dev/null)
  ! grep -q "^PATH=$RUNTIME_PREFIX/var/nodes/$2/bin:$RUNTIME_PREFIX/bin:" <<<"$env"
}
for n in "${NODES[@]}"; do
  mkdir -p "$STATE/spool/$n"
  if alive "$STATE/run/slurmd-$n.pid" slurmd && slurmd_env_stale "$STATE/run/slurmd-$n.pid" "$n"; then
    log "restarting slurmd -N $n (its PATH lacks enroot)"
    pid=$(cat "$STATE/run/slurmd-$n.pid")
    kill -TERM "$pid"
    WAIT=30 wait_for "slurmd $n to stop" bash -c "! kill -0 $pid"
  fi
  if ! alive "$STATE/run/slurmd-$n.pid" slurmd; then
    log "starting slurmd -N $n"
    if [ -n "$PLUGSTACK_LINE" ]; then
      PATH="$RUNTIME_PREFIX/var/nodes/$n/bin:$PATH" slurmd -f "$SLURM_CONF" -N "$n"
    else
      slurmd -f "$SLURM_CONF" -N "$n"
    fi
  fi
done

nodes_idle() {
  local states
  states=$(sinfo -h -N -p pretrain -o '%N %t' | sort -u)
  echo "$states" | grep -qE 'down|drain|fail' && scontrol update nodename=node[1-2] state=resume 2>/dev/null
  [ "$(echo "$states" | grep -cE ' (idle|mix|alloc)')" -ge ${#NODES[@]} ]
}
wait_for "nodes idle" nodes_idle
wait_for "sacct" sacct -n -X -S now-1minute
# The container registry jobs pull from (profile localregistry): registry.sh says why it cannot.
if command -v docker-registry >/dev/null; then
  bash "$HERE/registry.sh" start
else
  log "no docker-registry (make setup installs it): profile localregistry is not available"
fi
log "cluster '$CLUSTER' up: $(sinfo -h -o '%P %D %t' | tr '\n' ';')"
if [ -n "$PLUGSTACK_LINE" ]; then
  srun --help 2>/dev/null | grep -q -- '--container-image' \
    || die "pyxis is in $STATE/etc/plugstack.conf but srun --help does not list --container-image"
  log "pyxis + enroot loaded ($RUNTIME_PREFIX)"
fi
echo "export SLURM_CONF=$SLURM_CONF"
