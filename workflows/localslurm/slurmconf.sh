# Sourced by up.sh and cluster2.sh: the slurm.conf lines both local clusters share.
# shellcheck shell=bash
# slurm_conf_common: print them for cluster $CLUSTER (controller on $HOST:$CTLD_PORT, state under
# $STATE, accounting through the one slurmdbd on $DBD_PORT).
slurm_conf_common() {
  cat <<EOF2
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
AuthType=auth/munge
# Slurm's minimum: a requeued job may start again only cred_expire+1 s later (every live
# preemption test pays it; 10 -> 5 with sched_interval 2 -> 1 took a requeue from 11.2 to 6.4 s).
AuthInfo=cred_expire=5
EOF2
  [ -z "${FIRST_JOB_ID:-}" ] || echo "FirstJobId=$FIRST_JOB_ID"
  cat <<EOF2
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=1
DependencyParameters=kill_invalid_depend
ReturnToService=2
KillWait=10
MinJobAge=600
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
GresTypes=gpu
PlugStackConfig=$STATE/etc/plugstack.conf
EOF2
}
