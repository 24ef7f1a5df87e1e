#!/usr/bin/env bash
# Usage: ./distributed_train.sh NPROC DATA_DIR [trainer flags...]
# Starts NPROC ranks of `python -m vitpod.trainer` on this node with torchrun (VOLO-compatible wrapper;
# --standalone picks a free rendezvous port). Multi-node jobs are launched by srun, one task
# per GPU (see workflows/), not by this script. Exit status: the trainer's (75 = requeue me).
set -euo pipefail
if [[ $# -lt 2 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NPROC DATA_DIR [trainer flags...]  (NPROC: processes on this node)" >&2
  exit 2
fi
NPROC=$1
shift
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nnodes=1 \
  --nproc-per-node="$NPROC" -m vitpod.trainer "$@"
